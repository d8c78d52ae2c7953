"""Layer and neuron relevance (:func:`pyattr.layer_relevance`, DESIGN §7): shorthands,
layer-wise conservation, parity with Captum's layer gradients with the rules off,
baselines, chunking, k targets, errors and the model state afterwards."""

import pytest
import torch
from torch import nn

import pyattr
from models import VOCAB, minilm, tiny_causal_lm
from pyattr.targets import Logit, LogitDiff, ModuleOutput

OFF = pyattr.RelevanceRules()
LLAMA_ALL = [
    "model.layers.0", "model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.0.mlp.down_proj",
    "model.layers.1", "model.layers.1.self_attn", "model.layers.1.mlp", "model.layers.1.mlp.down_proj",
    "model.norm",
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(batch=2, seq=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, seq), generator=g)


def _rel_close(actual, expected, rtol):
    """``|actual − expected| ≤ rtol · max|expected|``."""
    actual, expected = actual.detach(), expected.detach()
    scale = float(expected.abs().max())
    err = float((actual.double() - expected.double()).abs().max())
    assert err <= rtol * scale, f"max error {err:.3e} > {rtol:.0e} × {scale:.3e}"


def _state(model):
    """Everything a pass could leave behind on the modules."""
    return [
        (name, sorted(vars(m)), len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
         len(m._backward_pre_hooks), m.training, [p.requires_grad for p in m.parameters(recurse=False)])
        for name, m in model.named_modules()
    ]


def _no_hooks(model):
    return all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())


# --------------------------------------------------------------------------- result, shorthands


def test_result_fields_and_model_order(llama):
    ids = _ids()
    r = pyattr.layer_relevance(llama, ids, ["neurons", "mlp", "residual", "attention"], target=3)
    assert r.paths == LLAMA_ALL and list(r) == LLAMA_ALL and len(r) == 9
    assert "model.norm" in r and "model.layers.0.input_layernorm" not in r
    with pytest.raises(KeyError, match="not among the layers"):
        r["model.layers.0.input_layernorm"]
    plain = pyattr.relevance(llama, ids, target=3)
    assert torch.equal(r.target, plain.target) and torch.equal(r.target_ids, plain.target_ids)
    for p in r.paths:
        lay = r[p]
        assert lay.activation.shape == lay.gradient.shape == lay.relevance.shape
        assert lay.activation.shape == ((2, 6, 48) if p.endswith("down_proj") else (2, 6, 32))
        assert torch.equal(lay.relevance, lay.activation * lay.gradient)
        residual = p in ("model.layers.0", "model.layers.1", "model.norm")
        assert lay.where == ("input" if residual or p.endswith("down_proj") else "output")
        assert (lay.conservation_delta is not None) == residual
    # the first block's input is where relevance() measures
    torch.testing.assert_close(r["model.layers.0"].relevance, plain.relevance, atol=0, rtol=0)


@pytest.mark.parametrize(
    "arch,expected",
    [
        ("gpt2", ["transformer.h.0", "transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.0.mlp.c_proj",
                  "transformer.h.1", "transformer.h.1.attn", "transformer.h.1.mlp", "transformer.h.1.mlp.c_proj",
                  "transformer.ln_f"]),
        # post-norm: the sublayers' dense projections (before residual + LayerNorm); neurons
        # are the intermediate activation
        ("bert", ["bert.encoder.layer.0", "bert.encoder.layer.0.attention.output.dense",
                  "bert.encoder.layer.0.intermediate", "bert.encoder.layer.0.output.dense", "bert.encoder.layer.1",
                  "bert.encoder.layer.1.attention.output.dense", "bert.encoder.layer.1.intermediate",
                  "bert.encoder.layer.1.output.dense"]),
    ],
)
def test_shorthands_on_other_architectures(arch, expected):
    m = tiny_causal_lm(arch)
    r = pyattr.layer_relevance(m, _ids(), ["residual", "attention", "mlp", "neurons"], target=3)
    assert r.paths == expected
    hidden = 64 if arch == "bert" else 128  # intermediate size (GPT-2: 4 × n_embd)
    for p in expected:
        assert r[p].activation.shape[-1] == (hidden if p.endswith(("c_proj", "intermediate")) else 32)


def test_neurons_are_the_gated_mlp_activation(llama):
    """``neurons`` = act(gate_proj(x))·up_proj(x), recomputed by hand from each block's
    captured input and attention output."""
    ids = _ids()
    r = pyattr.layer_relevance(llama, ids, ["residual", "attention", "neurons"], target=3)
    for i, block in enumerate(llama.model.layers):
        h = r[f"model.layers.{i}"].activation + r[f"model.layers.{i}.self_attn"].activation
        with torch.no_grad():
            x = block.post_attention_layernorm(h)
            mlp = block.mlp
            by_hand = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
            torch.testing.assert_close(r[f"model.layers.{i}.mlp.down_proj"].activation, by_hand, atol=1e-6, rtol=1e-5)
            # the next block's input is this block's output
            nxt = r["model.norm" if i == 1 else "model.layers.1"].activation
            torch.testing.assert_close(nxt, h + mlp.down_proj(by_hand), atol=1e-6, rtol=1e-5)


def test_neurons_gpt2():
    m = tiny_causal_lm("gpt2")
    r = pyattr.layer_relevance(m, _ids(), ["residual", "attention", "neurons"], target=3)
    for i, block in enumerate(m.transformer.h):
        h = r[f"transformer.h.{i}"].activation + r[f"transformer.h.{i}.attn"].activation
        with torch.no_grad():
            by_hand = block.mlp.act(block.mlp.c_fc(block.ln_2(h)))
        torch.testing.assert_close(r[f"transformer.h.{i}.mlp.c_proj"].activation, by_hand, atol=1e-6, rtol=1e-5)


def test_attribute_to_layer_input(llama):
    """A module's input is its producer's output; ``self_attn`` takes it as the keyword
    ``hidden_states``."""
    ids = _ids()
    out0 = pyattr.layer_relevance(llama, ids, ["model.layers.0", "model.layers.1.input_layernorm",
                                               "model.layers.1.post_attention_layernorm"], target=3)
    inp = pyattr.layer_relevance(llama, ids, ["model.layers.1", "model.layers.1.self_attn", "model.layers.1.mlp"],
                                 target=3, attribute_to_layer_input=True)
    assert [inp[p].where for p in inp.paths] == ["input"] * 3
    for a, b in [("model.layers.0", "model.layers.1"), ("model.layers.1.input_layernorm", "model.layers.1.self_attn"),
                 ("model.layers.1.post_attention_layernorm", "model.layers.1.mlp")]:
        for field in ("activation", "gradient", "relevance"):
            torch.testing.assert_close(getattr(inp[b], field), getattr(out0[a], field), atol=0, rtol=0)


# --------------------------------------------------------------------------- conservation


def _check_conservation(r, rtol):
    residual = [p for p in r.paths if r[p].conservation_delta is not None]
    assert residual == ["model.layers.0", "model.layers.1", "model.norm"]
    for p in residual:
        sums = r[p].relevance.double().flatten(start_dim=r.target.dim()).sum(-1)
        torch.testing.assert_close(r[p].conservation_delta, r.target - sums, atol=1e-12, rtol=0)
        assert float((sums - r.target).abs().max()) <= rtol * float(r.target.abs().max()), p
    return residual


def test_layerwise_conservation_float32(llama):
    r = pyattr.layer_relevance(llama, _ids(3, 7), ["residual", "mlp", "neurons"], target=[3, 8, 11])
    _check_conservation(r, 1e-4)
    # the MLP output and its hidden activation carry the same relevance (a bias-free linear map)
    for i in range(2):
        torch.testing.assert_close(r[f"model.layers.{i}.mlp"].relevance.sum((1, 2)),
                                   r[f"model.layers.{i}.mlp.down_proj"].relevance.sum((1, 2)), atol=1e-5, rtol=1e-4)


def test_layerwise_conservation_float64(llama64):
    r = pyattr.layer_relevance(llama64, _ids(), "residual", target=LogitDiff(3, 8))
    # float64 model, float32 relevance fields: their rounding (≈ 1e-7) bounds the error
    _check_conservation(r, 2e-6)


def test_grad_outputs_weight_each_row(llama64):
    ids = _ids()
    w = torch.tensor([2.0, -0.25], dtype=torch.float64)
    r = pyattr.layer_relevance(llama64, ids, ["residual", "model.layers.0.mlp"], target=3, grad_outputs=w)
    ref = pyattr.layer_relevance(llama64, ids, ["residual", "model.layers.0.mlp"], target=3)
    for p in r.paths:
        _rel_close(r[p].gradient, w.view(2, 1, 1) * ref[p].gradient, 1e-6)
        _rel_close(r[p].relevance, w.view(2, 1, 1) * ref[p].relevance, 1e-6)
    for p in ("model.layers.0", "model.layers.1", "model.norm"):
        sums = r[p].relevance.double().sum((1, 2))
        torch.testing.assert_close(r[p].conservation_delta, w * r.target - sums, atol=1e-12, rtol=0)
        assert float((sums - w * r.target).abs().max()) <= 2e-6 * float((w * r.target).abs().max())


def test_layer_before_the_entry(llama):
    """The embedding lookup's output feeds the first block unchanged: same activation,
    gradient and relevance as the first block's input."""
    r = pyattr.layer_relevance(llama, _ids(), ["model.embed_tokens", "residual"], target=3)
    assert r.paths[:2] == ["model.embed_tokens", "model.layers.0"]
    for field in ("activation", "gradient", "relevance"):
        assert torch.equal(getattr(r["model.embed_tokens"], field), getattr(r["model.layers.0"], field))


def test_rules_off_do_not_conserve(llama):
    """The check above can fail: without the rules the gradient × activation sums differ."""
    r = pyattr.layer_relevance(llama, _ids(), "residual", target=3, rules=OFF)
    assert float((r["model.layers.0"].conservation_delta / r.target).abs().max()) > 1e-2


def test_neuron_target_conserves_before_the_neuron(llama64):
    """A neuron target (ModuleOutput with select) is explained like a logit: its relevance at
    the embeddings is the input relevance, and Σ relevance equals the neuron's value at
    every residual layer before it; after it the gradient is 0."""
    ids = _ids()
    neuron = ModuleOutput("model.layers.1.mlp.down_proj", select=(slice(None), 5))
    r = pyattr.layer_relevance(llama64, ids, ["residual", "model.layers.1.mlp.down_proj"], target=neuron)
    plain = pyattr.relevance(llama64, ids, target=neuron)
    assert torch.equal(r["model.layers.0"].relevance, plain.relevance)
    torch.testing.assert_close(r.target, r["model.layers.1.mlp.down_proj"].activation[:, :, 5].sum(-1).double(),
                               atol=1e-6, rtol=1e-6)
    for p in ("model.layers.0", "model.layers.1"):
        sums = r[p].relevance.double().sum((1, 2))
        assert float((sums - r.target).abs().max()) <= 2e-6 * float(r.target.abs().max()), p
    assert (r["model.norm"].gradient == 0).all()
    assert r["model.norm"].conservation_delta is None  # the target does not depend on it


# --------------------------------------------------------------------------- Captum parity (rules off)


@pytest.mark.parametrize(
    "path,to_input",
    [("model.layers.0", False), ("model.layers.1", True), ("model.layers.0.mlp", False), ("model.layers.0.mlp", True),
     ("model.layers.1.self_attn.o_proj", True), ("model.layers.1.mlp.down_proj", True), ("model.norm", False)],
)
def test_captum_parity_llama(llama, path, to_input):
    from captum._utils.gradient import compute_layer_gradients_and_eval
    from captum.attr import LayerGradientXActivation

    ids = _ids()
    fwd = lambda i: llama(i).logits[:, -1]  # noqa: E731
    layer = llama.get_submodule(path)
    grads, evals = compute_layer_gradients_and_eval(fwd, layer, ids, target_ind=[3, 9], attribute_to_layer_input=to_input)
    lgxa = LayerGradientXActivation(fwd, layer).attribute(ids, target=[3, 9], attribute_to_layer_input=to_input)
    r = pyattr.layer_relevance(llama, ids, path, target=[3, 9], rules=OFF, attribute_to_layer_input=to_input)[path]
    _rel_close(r.activation, evals[0], 1e-5)
    _rel_close(r.gradient, grads[0], 1e-5)
    _rel_close(r.relevance, lgxa, 1e-5)


def test_captum_parity_minilm():
    from captum._utils.gradient import compute_layer_gradients_and_eval
    from captum.attr import LayerGradientXActivation

    tok, m = minilm()
    enc = tok(["a cat sat on the mat", "dogs bark"], padding=True, return_tensors="pt")
    mask = enc["attention_mask"]
    fwd = lambda i: m(input_ids=i, attention_mask=mask).last_hidden_state[:, 0]  # noqa: E731
    target = lambda out: out.last_hidden_state[:, 0, 7]  # noqa: E731
    for paths, to_input in [(["encoder.layer.2", "encoder.layer.4.intermediate"], False),
                            (["encoder.layer.3.intermediate"], True)]:
        r = pyattr.layer_relevance(m, dict(enc), paths, rules=OFF, target=target, attribute_to_layer_input=to_input)
        for path in r.paths:
            layer = m.get_submodule(path)
            grads, evals = compute_layer_gradients_and_eval(fwd, layer, enc["input_ids"], target_ind=7,
                                                            attribute_to_layer_input=to_input)
            lgxa = LayerGradientXActivation(fwd, layer).attribute(enc["input_ids"], target=7,
                                                                  attribute_to_layer_input=to_input)
            _rel_close(r[path].activation, evals[0], 1e-5)
            _rel_close(r[path].gradient, grads[0], 1e-5)
            _rel_close(r[path].relevance, lgxa, 1e-5)


@pytest.mark.parametrize(
    "select",
    [(2, 3), (slice(None), 3), (slice(1, 4), slice(0, 6)), lambda o: o[:, -1, :4].sum(-1)],
    ids=["neuron", "column", "slices", "callable"],
)
def test_captum_neuron_selector_llama(llama, select):
    """Captum's ``gradient_neuron_selector`` = ``ModuleOutput(path, select)``: the neuron's
    gradient at the input embeddings (the first block's input) and the layer's value."""
    from captum._utils.gradient import compute_layer_gradients_and_eval

    ids = _ids()
    path = "model.layers.0.mlp"
    x = llama.get_input_embeddings()(ids).detach().requires_grad_(True)
    fwd = lambda e: llama(inputs_embeds=e).logits[:, -1]  # noqa: E731
    _, evals, in_grads = compute_layer_gradients_and_eval(
        fwd, llama.get_submodule(path), x, target_ind=0, gradient_neuron_selector=select
    )
    r = pyattr.layer_relevance(llama, ids, ["residual", path], target=ModuleOutput(path, select=select), rules=OFF)
    _rel_close(r["model.layers.0"].gradient, in_grads[0], 1e-5)
    _rel_close(r["model.layers.0"].activation, x.detach(), 1e-6)
    _rel_close(r[path].activation, evals[0], 1e-5)
    # the neuron's own gradient: 1 on the selected entries, 0 elsewhere
    assert set(r[path].gradient.unique().tolist()) <= {0.0, 1.0}


def test_captum_neuron_selector_int_minilm():
    """An int selector on a (batch, n) output: Captum's ``out[:, i]``."""
    from captum._utils.gradient import compute_layer_gradients_and_eval

    tok, m = minilm()
    enc = tok(["a cat sat on the mat", "dogs bark"], padding=True, return_tensors="pt")
    mask = enc["attention_mask"]
    x = m.embeddings.word_embeddings(enc["input_ids"]).detach().requires_grad_(True)
    fwd = lambda e: m(inputs_embeds=e, attention_mask=mask).pooler_output  # noqa: E731
    _, evals, in_grads = compute_layer_gradients_and_eval(fwd, m.pooler.dense, x, target_ind=0, gradient_neuron_selector=5)
    r = pyattr.layer_relevance(m, dict(enc), ["embeddings.LayerNorm", "pooler.dense"], attribute_to_layer_input=True,
                               target=ModuleOutput("pooler.dense", select=5), rules=OFF)
    # the gradient at the embedding sum equals the gradient at the word embeddings
    _rel_close(r["embeddings.LayerNorm"].gradient, in_grads[0], 1e-5)
    torch.testing.assert_close(r.target, evals[0][:, 5].double(), atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        first = m(**enc).last_hidden_state[:, 0]  # the pooler's input
    _rel_close(r["pooler.dense"].activation, first, 1e-5)


# --------------------------------------------------------------------------- baselines


def test_pad_baseline_uses_activations_at_the_pad_input(llama, monkeypatch):
    monkeypatch.setattr(llama.config, "pad_token_id", 2)
    ids = _ids()
    layers = ["residual", "model.layers.0.mlp", "model.layers.1.self_attn"]
    w = torch.tensor([1.0, -0.5])
    r = pyattr.layer_relevance(llama, ids, layers, target=4, baseline="pad", grad_outputs=w)
    plain = pyattr.layer_relevance(llama, ids, layers, target=4, grad_outputs=w)
    at_pad = pyattr.layer_relevance(llama, torch.full_like(ids, 2), layers, target=4)
    torch.testing.assert_close(r.baseline_target, at_pad.target, atol=1e-6, rtol=1e-5)
    for p in r.paths:
        assert torch.equal(r[p].gradient, plain[p].gradient) and torch.equal(r[p].activation, plain[p].activation)
        torch.testing.assert_close(r[p].relevance, (plain[p].activation - at_pad[p].activation) * plain[p].gradient,
                                   atol=1e-6, rtol=1e-5)
    for p in ("model.layers.0", "model.layers.1", "model.norm"):
        sums = r[p].relevance.double().sum((1, 2))
        torch.testing.assert_close(r[p].conservation_delta, w.double() * (r.target - r.baseline_target) - sums,
                                   atol=1e-12, rtol=0)


def test_tensor_baseline(llama):
    ids = _ids()
    x0 = 0.1 * torch.randn(6, 32, generator=torch.Generator().manual_seed(3))
    r = pyattr.layer_relevance(llama, ids, ["model.layers.0", "model.layers.1"], target=4, baseline=x0,
                               attribute_to_layer_input=True)
    plain = pyattr.layer_relevance(llama, ids, ["model.layers.0"], target=4, attribute_to_layer_input=True)
    torch.testing.assert_close(r["model.layers.0"].relevance, (plain["model.layers.0"].activation - x0) *
                               plain["model.layers.0"].gradient, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        f0 = llama(inputs_embeds=x0.expand(2, 6, 32)).logits[:, -1, 4].double()
    torch.testing.assert_close(r.baseline_target, f0, atol=1e-6, rtol=1e-5)
    z = pyattr.layer_relevance(llama, ids, "residual", target=4, baseline="zeros")
    p = pyattr.layer_relevance(llama, ids, "residual", target=4)
    for path in z.paths:
        assert torch.equal(z[path].relevance, p[path].relevance)


@pytest.mark.parametrize(
    "baseline,exc,msg",
    [
        (torch.zeros(6, 31), ValueError, r"baseline of shape \(6, 31\)"),
        (torch.zeros(6, 32, dtype=torch.int32), TypeError, r"baseline must be a floating tensor"),
        ("zeros", ValueError, r"baseline: layer 'model.embed_tokens' runs before the input embeddings"),
    ],
)
def test_baseline_errors(llama, baseline, exc, msg):
    with pytest.raises(exc, match=msg):
        pyattr.layer_relevance(llama, _ids(), ["model.embed_tokens", "model.layers.0"], target=3, baseline=baseline)
    assert _no_hooks(llama)


# --------------------------------------------------------------------------- chunks, k targets


@pytest.mark.parametrize("chunk", [1, 2, 5, 7])
def test_internal_batch_size_equals_unchunked(llama, chunk):
    ids = _ids(5, 6, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    mask[3, -1] = 0  # a right-padded row
    tgt = [Logit([3, 4, 5, 6, 7]), LogitDiff([1, 2, 3, 4, 5], 9)]
    w = torch.linspace(0.5, 2.0, 10).view(2, 5)
    kw = dict(attention_mask=mask, target=tgt, grad_outputs=w, baseline=0.05 * torch.randn(5, 6, 32))
    full = pyattr.layer_relevance(llama, ids, ["residual", "neurons"], **kw)
    part = pyattr.layer_relevance(llama, ids, ["residual", "neurons"], internal_batch_size=chunk, **kw)
    assert part.paths == full.paths and part.target.shape == (2, 5)
    # chunks run in other batch shapes, which other CPUs' GEMM kernels round apart (32 float32
    # eps of the logits with MKL's SSE4.2 kernels): float32 rounding of the values' scale
    eps = torch.finfo(torch.float32).eps
    tol = 64 * eps * float(torch.cat([full.target, full.baseline_target]).abs().max())
    torch.testing.assert_close(part.target, full.target, atol=tol, rtol=1e-6)
    torch.testing.assert_close(part.baseline_target, full.baseline_target, atol=tol, rtol=1e-6)
    for p in full.paths:
        for field in ("activation", "gradient", "relevance"):
            _rel_close(getattr(part[p], field), getattr(full[p], field), 64 * eps)
        if full[p].conservation_delta is not None:
            # a difference of near-equal sums: compare on the scale of the summed relevance
            scale = float(full[p].relevance.abs().sum((-1, -2)).max())
            torch.testing.assert_close(part[p].conservation_delta, full[p].conservation_delta, atol=1e-6 * scale, rtol=0)


def test_internal_batch_size_top1_target(llama):
    ids = _ids(3, 5)
    full = pyattr.layer_relevance(llama, ids, "model.layers.1")
    part = pyattr.layer_relevance(llama, ids, "model.layers.1", internal_batch_size=2)
    assert torch.equal(part.target_ids, full.target_ids)
    _rel_close(part["model.layers.1"].relevance, full["model.layers.1"].relevance, 1e-6)


def test_k_targets_equal_separate_calls(llama):
    ids = _ids()
    tk = [Logit(3), LogitDiff(4, 5), ModuleOutput("model.layers.1.mlp", select=(slice(None), 2))]
    layers = ["residual", "model.layers.0.mlp"]
    rk = pyattr.layer_relevance(llama, ids, layers, target=tk)
    assert rk.target.shape == (3, 2)
    for j, t in enumerate(tk):
        s = pyattr.layer_relevance(llama, ids, layers, target=t)
        # the forwards may round differently in the last bit (the k call records one more module)
        torch.testing.assert_close(rk.target[j], s.target, atol=1e-6, rtol=1e-5)
        for p in s.paths:
            assert rk[p].gradient.shape == (3, *s[p].gradient.shape)
            assert torch.equal(rk[p].activation, s[p].activation)
            _rel_close(rk[p].gradient[j], s[p].gradient, 1e-5)
            _rel_close(rk[p].relevance[j], s[p].relevance, 1e-5)
            if s[p].conservation_delta is not None:
                torch.testing.assert_close(rk[p].conservation_delta[j], s[p].conservation_delta, atol=1e-5, rtol=1e-4)
    # k token ids per row
    kid = torch.tensor([[3, 7], [9, 1]])
    rid = pyattr.layer_relevance(llama, ids, "model.layers.1", target=kid)
    s = pyattr.layer_relevance(llama, ids, "model.layers.1", target=[7, 1])
    _rel_close(rid["model.layers.1"].relevance[1], s["model.layers.1"].relevance, 1e-5)


# --------------------------------------------------------------------------- grad mode, errors, state


def test_no_grad_equals_grad_and_inference_mode_refused(llama):
    ids = _ids()
    ref = pyattr.layer_relevance(llama, ids, "residual", target=3)
    with torch.no_grad():
        ng = pyattr.layer_relevance(llama, ids, "residual", target=3)
    for p in ref.paths:
        assert torch.equal(ng[p].relevance, ref[p].relevance)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"layer_relevance\(\) cannot run under torch.inference_mode"):
        pyattr.layer_relevance(llama, ids, "residual", target=3)


class _Tiny(nn.Module):
    """A model that takes ``input_ids`` but has no mapped architecture."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, VOCAB))

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, **kw):
        return self.body(self.emb(input_ids))


@pytest.mark.parametrize("model", ["sequential", "tiny"])
def test_shorthand_on_unmapped_model(model):
    m = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)) if model == "sequential" else _Tiny()
    name = type(m).__name__
    with pytest.raises(ValueError, match=rf"shorthand 'mlp' needs a mapped architecture, and {name} \(model_type None\)"):
        pyattr.layer_relevance(m, _ids(), ["mlp"], target=lambda o: o[:, -1, 3], rules=OFF)


def test_shorthand_on_unmapped_model_type(llama, monkeypatch):
    monkeypatch.setattr(llama.config, "model_type", "llama_unmapped")
    with pytest.raises(ValueError, match=r"shorthand 'residual' needs a mapped architecture.*'llama_unmapped'"):
        pyattr.layer_relevance(llama, _ids(), "residual", target=3)


def test_rules_off_on_unmapped_model_type(llama, monkeypatch):
    # DESIGN §7: with every rule off there is nothing to install, so any architecture works
    ids = _ids()
    ref = pyattr.layer_relevance(llama, ids, "model.layers.1", target=3, rules=OFF)
    monkeypatch.setattr(llama.config, "model_type", "llama_unmapped")
    r = pyattr.layer_relevance(llama, ids, "model.layers.1", target=3, rules=OFF)
    assert torch.equal(r["model.layers.1"].relevance, ref["model.layers.1"].relevance)
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match="has no rule map"):
        pyattr.layer_relevance(llama, ids, "model.layers.1", target=3)


def test_rules_off_on_an_architecture_without_a_rule_map():
    import transformers as T

    torch.manual_seed(0)
    cfg = T.OPTConfig(vocab_size=96, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=64, word_embed_proj_dim=32)
    opt = T.OPTForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (2, 6))
    r = pyattr.layer_relevance(opt, ids, "model.decoder.layers.1", target=3, rules=OFF)
    emb = opt.get_input_embeddings()(ids).detach().requires_grad_()
    acts = {}
    h = opt.model.decoder.layers[1].register_forward_hook(lambda m, a, o: acts.setdefault("o", o[0] if isinstance(o, tuple) else o))
    try:
        out = opt(inputs_embeds=emb).logits[:, -1, 3].sum()
        (g,) = torch.autograd.grad(out, acts["o"])
    finally:
        h.remove()
    torch.testing.assert_close(r["model.decoder.layers.1"].gradient, g, rtol=1e-5, atol=1e-7)
    rel = pyattr.relevance(opt, ids, target=3, rules=OFF)
    (ge,) = torch.autograd.grad(opt(inputs_embeds=emb).logits[:, -1, 3].sum(), emb)
    torch.testing.assert_close(rel.relevance, (emb * ge).detach(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs,exc,msg",
    [
        (dict(layers="model.layers.0.mpl"), ValueError, r"layers: LlamaForCausalLM has no module 'model.layers.0.mpl'; nearest: model.layers.0.mlp"),
        (dict(layers=["model.layers.1", "residual"]), ValueError, r"'model.layers.1' is asked for both at its input and at its output"),
        (dict(layers=["model.layers.1.mlp.down_proj", "neurons"]), ValueError, r"asked for both at its input and at its output"),
        (dict(layers=[]), ValueError, r"layers must be a module path, a shorthand"),
        (dict(layers=[3]), TypeError, r"layers: module paths must be strings"),
        (dict(layers="model.layers.0", internal_batch_size=0), ValueError, r"internal_batch_size must be an int ≥ 1, got 0"),
        (dict(layers="model.layers.0", internal_batch_size=-2), ValueError, r"internal_batch_size must be an int ≥ 1"),
        (dict(layers="model.layers.0", internal_batch_size=1.5), ValueError, r"internal_batch_size must be an int ≥ 1"),
        (dict(layers="model.layers.0", internal_batch_size=True), ValueError, r"internal_batch_size must be an int ≥ 1"),
        (dict(layers="residual", target=ModuleOutput("model.embed_tokens")), ValueError, r"does not depend on the inputs"),
        (dict(layers="residual", target=lambda o: o.logits[:, -1, 3].detach()), ValueError, r"does not depend on the model output"),
        (dict(layers="residual", grad_outputs=torch.ones(3)), ValueError, r"grad_outputs of shape \(3,\)"),
        # checked before the rows are split (a chunk's slice of a too-long tensor would fit)
        (dict(layers="residual", grad_outputs=torch.ones(3), internal_batch_size=1), ValueError, r"grad_outputs of shape \(3,\) must match the target's shape \(2,\)"),
        (dict(layers="residual", grad_outputs=torch.ones(1), internal_batch_size=1), ValueError, r"grad_outputs of shape \(1,\)"),
        (dict(layers="residual", target=[Logit(3), Logit(4)], grad_outputs=torch.ones(2, 3), internal_batch_size=1), ValueError,
         r"grad_outputs of shape \(2, 3\) must match the target's shape \(2, 2\)"),
        (dict(layers="residual", baseline=torch.zeros(3, 6, 32), internal_batch_size=1), ValueError, r"baseline of shape \(3, 6, 32\)"),
        (dict(layers="residual", target=lambda o: o.logits[:, -1, 3].sum(), internal_batch_size=1), ValueError,
         r"a scalar target .* cannot be split"),
    ],
)
def test_errors_leave_no_hooks(llama, kwargs, exc, msg):
    before = _state(llama)
    kwargs = {"target": 3, **kwargs}
    with pytest.raises(exc, match=msg):
        pyattr.layer_relevance(llama, _ids(), **kwargs)
    assert _no_hooks(llama) and _state(llama) == before


def test_state_restored_after_success_and_failure(llama):
    ids = _ids()
    x = llama.get_input_embeddings()(ids).detach()

    def native_grad():
        e = x.clone().requires_grad_(True)
        llama(inputs_embeds=e).logits[:, -1, 3].sum().backward()
        return e.grad

    g0 = native_grad()
    llama.zero_grad(set_to_none=True)
    llama.train()
    before = _state(llama)
    pyattr.layer_relevance(llama, ids, ["residual", "mlp", "neurons"], target=[Logit(3), LogitDiff(3, 4)])
    assert _state(llama) == before

    def boom(out):
        raise RuntimeError("target failed")

    with pytest.raises(RuntimeError, match="target failed"):
        pyattr.layer_relevance(llama, ids, ["residual", "attention"], target=boom)
    assert _state(llama) == before and _no_hooks(llama)
    llama.eval()
    # the rules are gone: plain autograd gives the native gradient again
    torch.testing.assert_close(native_grad(), g0, atol=0, rtol=0)
    llama.zero_grad(set_to_none=True)


def test_layer_that_runs_twice(llama, monkeypatch):
    monkeypatch.setitem(llama.model.layers[1]._modules, "mlp", llama.model.layers[0].mlp)  # one MLP used twice
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp' ran 2 times in one forward pass"):
        pyattr.layer_relevance(llama, _ids(), "model.layers.0.mlp", target=3)
    assert _no_hooks(llama)
