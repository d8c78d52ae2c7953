"""Models bigger than one device, and wrapped models.

accelerate places a model with hooks (``cpu_offload``, ``dispatch_model``,
``from_pretrained(device_map=...)``): weights of an offloaded module sit on ``meta`` and
are brought in from the CPU or the disk by the hook around each call. Relevance must equal
the single-device run, and the scope must leave the hooks exactly as it found them.
``nn.DataParallel`` / DDP wrappers are explained through the module they wrap; FSDP is
refused.
"""

import copy
import json
import re

import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from accelerate.hooks import remove_hook_from_module

import pyattr
from conftest import run_cli, save_tiny_llama
from models import VOCAB, tiny_causal_lm
import pyattr.architectures as A
from pyattr.integration.install import state_of

pytestmark = pytest.mark.usefixtures("one_thread")

# (architecture, attention): Gemma 2 has no sdpa path in transformers (softcapping)
CASES = [(a, attn) for a in ["llama", "gemma", "gpt2", "gpt_neox", "bert"] for attn in ("eager", "sdpa")] + [("gemma2", "eager")]


def _ids(batch=2, seq=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _device_map(model, disk_layers=(1,)) -> dict:
    """Every block on "cpu" except ``disk_layers`` on "disk"; the norms outside the blocks
    (they carry the LN-rule) on disk too, everything else on "cpu"."""
    arch = A.ARCHITECTURES[model.config.model_type]
    layers = A.join(A.base_prefix(model), arch.layers)
    outer = {A.join(A.base_prefix(model), n) for n in arch.outer_norms}
    dm = {}
    for key in model.state_dict():
        module = key.rsplit(".", 1)[0]
        if module.startswith(layers + "."):
            i = int(module[len(layers) + 1:].split(".")[0])
            dm[f"{layers}.{i}"] = "disk" if i in disk_layers else "cpu"
        else:
            dm[module] = "disk" if module in outer else "cpu"
    assert "disk" in dm.values()
    return dm


def _assert_same(got, want):
    torch.testing.assert_close(got.relevance, want.relevance, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.target, want.target, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.conservation_delta, want.conservation_delta, rtol=1e-4, atol=1e-6)


def test_cpu_offload_relevance_equals_the_plain_model(tmp_path):
    # reported: ValueError: weight is on meta but x is on cpu (the rule forward bypassed
    # accelerate's hook, which is what loads the offloaded weight)
    model = tiny_causal_lm("llama")
    ids = _ids()
    want = pyattr.relevance(model, ids)
    placed = cpu_offload(copy.deepcopy(model), execution_device="cpu")
    assert placed.model.norm.weight.device.type == "meta"
    _assert_same(pyattr.relevance(placed, ids), want)
    assert placed.model.norm.weight.device.type == "meta"  # still offloaded afterwards


@pytest.mark.parametrize("arch, attn", CASES)
def test_dispatch_with_cpu_and_disk_equals_one_device(arch, attn, tmp_path):
    model = tiny_causal_lm(arch, attn)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # a padded row
    want = pyattr.relevance(model, ids, attention_mask=mask)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    placed = dispatch_model(copy.deepcopy(model), _device_map(model), offload_dir=str(tmp_path))
    got = pyattr.relevance(placed, ids, attention_mask=mask)
    _assert_same(got, want)
    assert got.coverage.installed == want.coverage.installed
    with pyattr.use_relevance_rules(placed), torch.no_grad():  # forward bit-identical under the rules
        assert torch.equal(placed(ids, attention_mask=mask).logits, logits)


def test_layer_relevance_and_patching_on_a_dispatched_model(tmp_path):
    model = tiny_causal_lm("llama")
    ids = _ids()
    placed = dispatch_model(copy.deepcopy(model), _device_map(model, (0, 1)), offload_dir=str(tmp_path))
    want = pyattr.layer_relevance(model, ids, layers=["residual", "mlp"])
    got = pyattr.layer_relevance(placed, ids, layers=["residual", "mlp"])
    assert got.paths == want.paths and len(want.paths) == 5
    for path in want.paths:
        torch.testing.assert_close(got[path].relevance, want[path].relevance, rtol=1e-5, atol=1e-7)
    corrupt = _ids(seed=2)
    want = pyattr.patching.attribution_patching(model, ids, corrupt, pyattr.targets.Logit(3), nodes=("residual", "mlp"))
    got = pyattr.patching.attribution_patching(placed, ids, corrupt, pyattr.targets.Logit(3), nodes=("residual", "mlp"))
    for node in ("residual", "mlp"):
        torch.testing.assert_close(got[node], want[node], rtol=1e-5, atol=1e-7)


def test_scope_leaves_accelerate_hooks_as_they_were(tmp_path):
    model = tiny_causal_lm("llama")
    ids = _ids()
    placed = dispatch_model(copy.deepcopy(model), _device_map(model), offload_dir=str(tmp_path))
    norm = placed.model.layers[1].input_layernorm
    wrapper, own = norm.__dict__["forward"], norm.__dict__["_old_forward"]
    with pyattr.use_relevance_rules(placed):
        assert norm.__dict__["forward"] is wrapper  # accelerate's hook still runs around the rule
        assert norm.__dict__["_old_forward"] is not own and state_of(norm) is not None
    assert norm.__dict__["forward"] is wrapper and norm.__dict__["_old_forward"] is own
    assert state_of(norm) is None
    remove_hook_from_module(placed, recurse=True)  # accelerate can still take its hooks off
    assert "_old_forward" not in norm.__dict__
    with torch.no_grad():
        torch.testing.assert_close(placed.model.embed_tokens(ids), model.model.embed_tokens(ids))


def test_from_pretrained_device_map_and_the_cli(tmp_path):
    from models import minilm
    from transformers import AutoModelForCausalLM

    tok, _ = minilm()
    d = save_tiny_llama(tmp_path / "m", len(tok), tok, max_position_embeddings=32)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    dm = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
          "model.norm": "disk", "model.rotary_emb": "cpu", "lm_head": "disk"}
    placed = AutoModelForCausalLM.from_pretrained(d, device_map=dm, offload_folder=str(tmp_path / "off")).eval()
    assert placed.lm_head.weight.device.type == "meta"
    ids = tok(["the cat sat on the mat", "a dog ran"], return_tensors="pt", padding=True)
    _assert_same(pyattr.relevance(placed, ids), pyattr.relevance(model, ids))

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the cat sat", "one two three four", "hello"]))
    (tmp_path / "map.json").write_text(json.dumps(dm))
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "a")
    assert r.returncode == 0, r.stderr
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "b",
                           "--device-map", tmp_path / "map.json", "--offload-folder", tmp_path / "off2")
    assert r.returncode == 0, r.stderr
    import pandas as pd

    a, b = pd.read_parquet(tmp_path / "a"), pd.read_parquet(tmp_path / "b")
    for x, y in zip(a["token_relevance"], b["token_relevance"]):
        torch.testing.assert_close(torch.tensor(list(y)), torch.tensor(list(x)), rtol=1e-5, atol=1e-7)
    manifest = json.loads((tmp_path / "b" / "_manifest.json").read_text())
    assert manifest["device_map"] == dm and manifest["device"] == "cpu"
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "c", "--device-map", "auto")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args, message", [
    (["--device-map", "nowhere"], "--device-map: expected auto, balanced, balanced_low_0, sequential or a JSON file"),
    (["--max-memory", "cpu=1GiB"], "--max-memory and --offload-folder need --device-map"),
    (["--device-map", "auto", "--max-memory", "cpu"], "--max-memory: expected DEVICE=SIZE"),
    (["--device-map", "BAD"], "must hold a JSON object of module name -> device"),
    (["--device-map", "auto", "--device", "cpu"], "not allowed with argument --device"),
])
def test_cli_placement_errors(tmp_path, args, message):
    (tmp_path / "bad.json").write_text(json.dumps(["cpu"]))
    args = [str(tmp_path / "bad.json") if a == "BAD" else a for a in args]
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "x"}\n')
    r = run_cli("run", "--model", tmp_path, "--data", data, "--out", tmp_path / "o", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_device_map_under_torchrun_is_refused(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "x"}\n')
    r = run_cli("run", "--model", tmp_path, "--data", data, "--out", tmp_path / "o",
                           "--device-map", "auto", env={"WORLD_SIZE": "2"})
    assert r.returncode == 2 and "under torchrun each rank would do so over the same devices" in r.stderr


def test_data_parallel_and_ddp_are_unwrapped(tmp_path):
    import torch.distributed as dist

    model = tiny_causal_lm("llama")
    ids = _ids()
    want = pyattr.relevance(model, ids)
    dp = torch.nn.DataParallel(model)
    assert torch.equal(pyattr.relevance(dp, ids).relevance, want.relevance)
    with pyattr.use_relevance_rules(dp) as cov:
        assert cov.installed == want.coverage.installed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        assert torch.equal(pyattr.relevance(ddp, ids).relevance, want.relevance)
        assert torch.equal(pyattr.integrated_gradients(ddp, ids, n_steps=4).attribution,
                           pyattr.integrated_gradients(model, ids, n_steps=4).attribution)
        assert all(p.requires_grad for p in model.parameters())  # training state given back

        from torch.distributed.fsdp import FullyShardedDataParallel

        sharded = FullyShardedDataParallel(tiny_causal_lm("llama"), device_id=torch.device("cpu"))
        with pytest.raises(TypeError, match=r"model is sharded with FSDP \(FullyShardedDataParallel\): "
                                            r"relevance needs whole parameters in one process"):
            pyattr.relevance(sharded, ids)
    finally:
        dist.destroy_process_group()


def test_placing_or_unplacing_inside_an_open_scope(tmp_path):
    """Reported: cpu_offload inside a scope left the model with NaN logits after it (the
    scope popped accelerate's wrapper); remove_hook_from_module inside a scope left a stale
    rule forward raising KeyError. The original forward goes back where the rule forward
    is now, so accelerate's own changes stand."""
    model = tiny_causal_lm("llama")
    ids = _ids()
    ref = copy.deepcopy(model)
    want_logits = ref(ids).logits.detach()
    want = pyattr.relevance(ref, ids)
    m = copy.deepcopy(model)
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules(attention=True)):
        m = cpu_offload(m, execution_device="cpu")
        torch.testing.assert_close(m(ids).logits, want_logits)
    assert m.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want_logits)
    _assert_same(pyattr.relevance(m, ids), want)

    placed = dispatch_model(copy.deepcopy(model), _device_map(model), offload_dir=str(tmp_path))
    with pyattr.use_relevance_rules(placed):
        remove_hook_from_module(placed, recurse=True)
    assert all(state_of(mod) is None for mod in placed.modules())
    with torch.no_grad():  # every weight lives on the offload map now: back to a plain model via state_dict
        torch.testing.assert_close(placed.model.embed_tokens(ids), ref.model.embed_tokens(ids))
    assert "_old_forward" not in placed.model.norm.__dict__


def test_reentrant_checkpointing_behind_an_unknown_wrapper_is_a_clear_error():
    model = tiny_causal_lm("llama")
    if not hasattr(model, "activation_checkpointing_enable"):
        pytest.skip("transformers < 5 has no offload option for activation checkpointing")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True}, offload=True)
    with pytest.raises(RuntimeError) as err:
        pyattr.relevance(model, _ids())
    if "pin_memory allocator" in str(err.value):  # CPU-only torch 2.6: offloaded checkpointing pins memory
        pytest.skip(f"this torch cannot pin memory, which transformers' offloaded checkpointing needs ({err.value})")
    assert re.search(r"relevance\(\): the model checkpoints with use_reentrant=True through a function pyattr "
                     r"cannot switch", str(err.value)), str(err.value)


@pytest.mark.parametrize("content, args, message", [
    ({"model": "meta"}, [], "'meta' is not one"),
    (None, ["--device-map", "auto", "--max-memory", "cpu=1GiB,cpu=2GiB"], "--max-memory: device 'cpu' is given twice"),
    (None, ["--device-map", "auto", "--max-memory", ""], "--max-memory: expected DEVICE=SIZE"),
    (None, ["--device-map", "auto", "--offload-folder", " "], "--offload-folder needs a directory"),
])
def test_cli_placement_values(tmp_path, content, args, message):
    if content is not None:
        (tmp_path / "map.json").write_text(json.dumps(content))
        args = ["--device-map", str(tmp_path / "map.json")] + args
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "x"}\n')
    r = run_cli("run", "--model", tmp_path, "--data", data, "--out", tmp_path / "o", *args)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "o").exists()


def test_cli_gpu_index_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without CUDA")
    from models import minilm

    tok, _ = minilm()
    d = save_tiny_llama(tmp_path / "m", len(tok), tok)
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "x"}\n')
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "o", "--device-map", "auto",
                "--max-memory", "0=1GiB,cpu=2GiB")
    assert r.returncode == 2 and "name GPU 0, but no CUDA device is visible to torch" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


def test_capture_unwraps_data_parallel():
    model = tiny_causal_lm("llama")
    ids = _ids()
    with pyattr.capture(torch.nn.DataParallel(model), ["model.layers.0.mlp"]) as cap:
        model(ids).logits[:, -1, 3].sum().backward()
    assert len(cap["model.layers.0.mlp"].outputs) == 1
