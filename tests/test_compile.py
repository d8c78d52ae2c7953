"""torch.compile (inductor, CPU) with the rules installed: a decoder block compiles with
``fullgraph=True`` (the pyattr ops are custom ops with fake kernels, the rule Functions
trace), and a whole model's relevance, compiled, equals the eager relevance."""

import warnings

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's notes on lru_cache-wrapped probes
        yield
    torch._dynamo.reset()


def _block_inputs(m, arch, seq=12):
    x = torch.randn(1, seq, m.config.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    if arch == "llama":
        pos = torch.arange(seq)[None]
        return x, {"position_embeddings": m.model.rotary_emb(x, pos)}
    return x, {}


@pytest.mark.parametrize("arch,impl", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa")])
@pytest.mark.parametrize("attention", [True, "attnlrp"])
def test_block_compiles_fullgraph(arch, impl, attention):
    m = tiny_causal_lm(arch, impl)
    for p in m.parameters():
        p.requires_grad_(False)
    block = m.model.layers[0] if arch == "llama" else m.transformer.h[0]
    x, kw = _block_inputs(m, arch)
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention=attention)):
        first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
        ref = first(block(x, **kw))
        (g_ref,) = torch.autograd.grad(ref.sum(), x)
        out = first(torch.compile(block, fullgraph=True)(x, **kw))
        (g,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    assert (g - g_ref).abs().max() <= 1e-5 * g_ref.abs().max()


def test_compiled_model_relevance_equals_eager():
    """Llama with sdpa attention (the frozen attention core, RMSNorm, the gated MLP; the
    LayerNorm path is in the GPT-2 block above)."""
    arch = "llama"
    m = tiny_causal_lm(arch, "sdpa")
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    ref = pyattr.relevance(m, ids, target=5)
    got = pyattr.relevance(torch.compile(m), ids, target=5)
    scale = ref.relevance.abs().max()
    assert (got.relevance - ref.relevance).abs().max() <= 1e-5 * scale
    torch.testing.assert_close(got.target, ref.target, rtol=1e-5, atol=1e-6)
    # and by hand, compiling inside the scope
    with pyattr.use_relevance_rules(m):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        out = torch.compile(m)(inputs_embeds=emb).logits[:, -1, 5].sum()
        (g,) = torch.autograd.grad(out, emb)
        assert ((emb * g).detach() - ref.relevance).abs().max() <= 1e-5 * scale


def test_new_ops_pass_opcheck():
    from pyattr.backends import compiled

    compiled._ops()
    g = torch.Generator().manual_seed(0)
    q, k, do = torch.randn(1, 4, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 4, 9, 8, generator=g)
    mask = torch.zeros(1, 1, 9, 9)
    torch.library.opcheck(torch.ops.pyattr.attention_dv, (q, k, do, mask, 0.3, None, True))
    torch.library.opcheck(torch.ops.pyattr.attention_dv, (q, k, do, None, 0.3, 2.0, False))
    dy, w, rstd = torch.randn(3, 5, 16, generator=g), torch.randn(16, generator=g), torch.rand(3, 5, 1, generator=g)
    torch.library.opcheck(torch.ops.pyattr.layer_norm_rule_dx, (dy, w, rstd))
    torch.library.opcheck(torch.ops.pyattr.layer_norm_rule_dx, (dy, None, rstd))
    x, mean = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 1, generator=g)
    torch.library.opcheck(torch.ops.pyattr.layer_norm_backward_stats, (x, w, dy, mean, rstd, True, True))
    torch.library.opcheck(torch.ops.pyattr.layer_norm_backward_stats, (x, None, dy, mean, rstd, False, False))


FRESH = r"""
import sys, warnings
import torch
sys.path.insert(0, {tests!r})
from models import tiny_causal_lm
from pyattr import RelevanceRules, use_relevance_rules
m = tiny_causal_lm("llama", "sdpa")
for p in m.parameters():
    p.requires_grad_(False)
x = torch.randn(1, 12, 32, requires_grad=True)
pe = m.model.rotary_emb(x, torch.arange(12)[None])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for attention in (True, "attnlrp", True):
        with use_relevance_rules(m, RelevanceRules.all(attention=attention)):
            out = torch.compile(m.model.layers[0], fullgraph=True)(x, position_embeddings=pe)
            (g,) = torch.autograd.grad(out.sum(), x)
            print(attention, float(g.abs().sum()))
print("notes", sum("lru_cache" in str(w.message) for w in caught))
"""


def test_fullgraph_first_in_a_fresh_process_and_across_rule_modes():
    """Compiling is the first pyattr work of the process (the backend probe and the op
    registrations happen at scope entry, not inside the trace), then the same block is
    compiled again under AttnLRP and again under the AH-rule; no notes from Dynamo about
    pyattr's cached probes."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", FRESH.format(tests=tests)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert [ln.split()[0] for ln in lines[:3]] == ["True", "attnlrp", "True"]
    assert lines[0] == lines[2] and lines[0] != lines[1]  # the AH-rule and AttnLRP gradients differ
    assert lines[3] == "notes 0"


def test_k_targets_on_a_compiled_model_raise_a_clear_error():
    """PyTorch cannot run a compiled backward batched (is_grads_batched): one clear error."""
    m = tiny_causal_lm("llama", "sdpa")
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="2 targets run as one batched backward"):
        pyattr.relevance(torch.compile(m), ids, target=torch.tensor([[3, 4]] * 2))


_TRACE_SCRIPT = r"""
import json, torch
from pyattr.backends import triton_backend as tb
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

ops = torch.ops.pyattr_triton
torch.manual_seed(0)
x, dy, w = torch.randn(8, 64), torch.randn(8, 64), torch.randn(64)
q, k, do = torch.randn(1, 4, 16, 64), torch.randn(1, 2, 16, 64), torch.randn(1, 4, 16, 64)
cases = {
    "identity": (lambda x, dy: ops.identity_backward(x, dy, "gelu"), (x, dy)),
    "half": (lambda x, dy: ops.half_backward(x, dy, dy), (x, dy)),
    "gated": (lambda x, dy: ops.gated_backward(x, dy, dy, "silu", True, True), (x, dy)),
    "layer_norm": (lambda x, dy, w: ops.layer_norm_backward(x, w, 1e-5, dy, True, True), (x, dy, w)),
    "rms_norm": (lambda x, dy, w: ops.rms_norm_backward(x, w, 1e-6, 0.0, dy, True), (x, dy, w)),
    "attention_dv": (lambda q, k, do: ops.attention_dv(q, k, do, None, 0.125, None, True), (q, k, do)),
}
out = {"traceable": tb.TRACEABLE}
for name, (f, args) in cases.items():
    gm = make_fx(dispatch_functionalize(f), tracing_mode="fake")(*args)
    kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]) for n in gm.graph.nodes
               if "triton_kernel_wrapper" in str(n.target)]
    out[name] = [getattr(kn, "fn", kn).__name__ for kn in kernels]
    # the fake implementation (the launcher on fake tensors) gives the op's output shapes
    with torch._subclasses.FakeTensorMode() as mode:
        res = f(*[mode.from_tensor(a) for a in args])
    out[name + "_shapes"] = [list(r.shape) for r in (res if isinstance(res, tuple) else (res,))]
print(json.dumps(out))
"""


def test_triton_ops_trace_into_their_kernels():
    """With compiled Triton (no interpreter) the Triton backend's operators are
    ``triton_op``s: functionalized tracing, what torch.compile's AOT step does, records
    the kernels themselves (``wrap_triton``), and the launcher on fake tensors gives the
    output shapes. Traced on CPU tensors in a process without TRITON_INTERPRET: tracing
    needs no GPU (the kernels are never launched)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _TRACE_SCRIPT], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["traceable"] is True
    assert got["identity"] == ["_identity_backward"] and got["half"] == ["_half_backward"]
    assert got["gated"] == ["_gated_backward"]
    assert got["layer_norm"] == ["_layer_norm_backward", "_sum_partials", "_sum_partials"]
    assert got["rms_norm"] == ["_rms_norm_backward", "_sum_partials"]
    assert got["attention_dv"] == ["_attention_row_stats", "_attention_dv"]
    assert got["identity_shapes"] == [[8, 64]] and got["half_shapes"] == [[8, 64], [8, 64]]
    assert got["layer_norm_shapes"] == [[8, 64], [64], [64]] and got["rms_norm_shapes"] == [[8, 64], [64]]
    assert got["attention_dv_shapes"] == [[1, 2, 16, 64]]


def test_triton_ops_are_opaque_under_the_interpreter():
    """Under TRITON_INTERPRET=1 (how CI runs the kernels) the operators are custom ops
    with explicit fake implementations: the interpreter cannot be traced."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("this process runs compiled Triton")
    from pyattr.backends import triton_backend

    assert triton_backend.TRACEABLE is False
    x, dy = torch.randn(4, 8), torch.randn(4, 8)
    torch.library.opcheck(torch.ops.pyattr_triton.identity_backward, (x, dy, "silu"),
                          test_utils=("test_schema", "test_faketensor"))
