"""Vision transformers: ViT and CLIP's vision tower, with ``pixel_values`` inputs.

The bar the text architectures meet: bit-identical forwards (eager and sdpa, AH-rule and
AttnLRP, bfloat16), exact coverage paths, conservation in float64 (zero biases) and the
bias-absorbed delta otherwise, scope hygiene, one command-line run each; plus what is new
for images: one relevance per patch and the [CLS] token, class-logit targets, the
relevance measured at the patch embeddings (checked against a hand-made gradient), and
clear errors for image inputs where they cannot work.
"""

import json

import numpy as np
import pytest
import torch

import pyattr
from conftest import assert_scope_hygiene, run_cli
from pyattr.targets import Logit, LogitDiff

T = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["vit_cls", "vit_model", "clip_vision", "clip_vision_proj", "clip_cls"]
SIZE, PATCH = 32, 8  # 4 × 4 patches + [CLS]


def _vit_cfg(**kw):
    return T.ViTConfig(image_size=SIZE, patch_size=PATCH, hidden_size=32, intermediate_size=48,
                       num_attention_heads=4, num_hidden_layers=2, num_labels=5, initializer_range=0.2, **kw)


def _clip_cfg():
    return T.CLIPVisionConfig(image_size=SIZE, patch_size=PATCH, hidden_size=32, intermediate_size=48,
                              num_attention_heads=4, num_hidden_layers=2, projection_dim=16, initializer_range=0.2)


def model(kind, attn="eager", dtype=torch.float32, biases=0.0):
    """A tiny random model; Hugging Face initialises biases to 0, ``biases`` > 0 draws them."""
    torch.manual_seed(0)
    if kind.startswith("vit"):
        cfg = _vit_cfg()
        cfg._attn_implementation = attn
        m = T.ViTForImageClassification(cfg) if kind == "vit_cls" else T.ViTModel(cfg)
    elif kind == "clip_cls":
        cfg = T.CLIPConfig(text_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 16,
                                        "num_attention_heads": 2, "num_hidden_layers": 1},
                           vision_config=_clip_cfg().to_dict(), num_labels=5)
        cfg.vision_config._attn_implementation = attn
        cfg._attn_implementation = attn
        m = T.CLIPForImageClassification(cfg)
    else:
        cfg = _clip_cfg()
        cfg._attn_implementation = attn
        m = (T.CLIPVisionModelWithProjection if kind == "clip_vision_proj" else T.CLIPVisionModel)(cfg)
    m = m.to(dtype).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p) * biases)
    return m


def pixels(batch=2, h=SIZE, w=SIZE, dtype=torch.float32, seed=0):
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _w(n, seed=2):
    return torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def target_of(kind):
    """A linear read-out of what each model returns (the classifiers: the default top-1 class)."""
    if kind in ("vit_cls", "clip_cls"):
        return None
    if kind == "vit_model":  # the pooler: dense → tanh (Identity-rule)
        w = _w(32)
        return lambda out: out.pooler_output @ w.to(out.pooler_output.dtype)
    if kind == "clip_vision":
        w = _w(32)
        return lambda out: out.pooler_output @ w.to(out.pooler_output.dtype)
    w = _w(16)
    return lambda out: out.image_embeds @ w.to(out.image_embeds.dtype)


def _first(out):
    return out.logits if hasattr(out, "logits") and out.logits is not None else out[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("attention", [True, "attnlrp"])
def test_forward_bit_identical(kind, attn, attention):
    m = model(kind, attn, biases=0.1)
    px = pixels()
    ref = _first(m(px))
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention=attention)):
        assert torch.equal(_first(m(px)), ref)
    assert torch.equal(_first(m(px)), ref)


@pytest.mark.parametrize("kind", ["vit_cls", "clip_vision"])
def test_forward_bit_identical_bfloat16(kind):
    m = model(kind, dtype=torch.bfloat16, biases=0.1)
    px = pixels(1, dtype=torch.bfloat16)
    ref = _first(m(px))
    with pyattr.use_relevance_rules(m):
        assert torch.equal(_first(m(px)), ref)


def _block_paths(prefix, layers, norms, q, k, act):
    return [f"{prefix}{layers}.{i}.{p}" for i in range(2) for p in (*norms, q, k, act)]


EXPECTED = {
    "vit_cls": _block_paths("vit.", "layers", ("layernorm_before", "layernorm_after"), "attention.q_proj",
                            "attention.k_proj", "mlp.activation_fn") + ["vit.layernorm"],
    "vit_model": _block_paths("", "layers", ("layernorm_before", "layernorm_after"), "attention.q_proj",
                              "attention.k_proj", "mlp.activation_fn") + ["layernorm", "pooler.activation"],
    "clip_vision": _block_paths("", "encoder.layers", ("layer_norm1", "layer_norm2"), "self_attn.q_proj",
                                "self_attn.k_proj", "mlp.activation_fn") + ["pre_layrnorm", "post_layernorm"],
}
EXPECTED["clip_vision_proj"] = ["vision_model." + p for p in EXPECTED["clip_vision"]]
EXPECTED["clip_cls"] = EXPECTED["clip_vision_proj"]


@pytest.mark.parametrize("kind", KINDS)
def test_coverage_paths_exact(kind):
    m = model(kind)
    with pyattr.use_relevance_rules(m) as cov:
        assert sorted(cov.installed) == sorted(EXPECTED[kind])
        names = dict(m.named_modules())
        assert all(p in names for p in cov.installed + cov.skipped)
    assert cov.model_type == ("vit" if kind.startswith("vit") else "clip_vision_model")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_conservation_float64(kind, attn):
    """All rules, float64, zero biases: Σ relevance over [CLS] and the patches equals the
    target up to the float32 rounding of the relevance fields."""
    m = model(kind, attn, dtype=torch.float64)
    r = pyattr.relevance(m, pixels(3, dtype=torch.float64), target=target_of(kind))
    assert (r.target.abs() > 1e-3).all()
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all(), (r.target, r.conservation_delta)
    assert r.token_relevance.shape == (3, 17) and r.relevance.shape == (3, 17, 32)
    assert r.patch_grid == (4, 4)


@pytest.mark.parametrize("kind", ["vit_cls", "clip_cls"])
def test_biases_absorb_relevance(kind):
    m = model(kind, dtype=torch.float64, biases=0.2)
    r = pyattr.relevance(m, pixels(3, dtype=torch.float64))
    assert (r.conservation_delta.abs() > 1e-3 * r.target.abs()).any()
    # token_relevance holds float32 sums over the hidden size: they round at float32's eps of
    # the terms' magnitudes, which cancel in the total (DESIGN §13)
    scale = r.relevance.double().abs().flatten(1).sum(1)
    gap = r.token_relevance.double().sum(1) - (r.target - r.conservation_delta)
    assert (gap.abs() <= 4 * torch.finfo(torch.float32).eps * scale).all(), (gap, scale)


@pytest.mark.parametrize("kind", ["vit_cls", "clip_cls"])
def test_switching_the_activation_rule_off_breaks_conservation(kind):
    m = model(kind, dtype=torch.float64)
    r = pyattr.relevance(m, pixels(3, dtype=torch.float64), rules=pyattr.RelevanceRules(True, False, True, True))
    assert (r.conservation_delta.abs() > 1e-4 * r.target.abs()).any()


def _hand_relevance(m, px, cls, entry, where):
    """x · ∂logit/∂x at the patch embeddings, by hand: a hook makes the entry's tensor a
    leaf, the class logit is read off the output, autograd gives the gradient."""
    seen = []

    def grab(t):
        seen.append(t.detach().requires_grad_(True))
        return seen[-1]

    if where == "input":
        h = entry.register_forward_pre_hook(lambda mod, args: (grab(args[0]), *args[1:]))
    else:
        h = entry.register_forward_hook(lambda mod, args, out: grab(out))
    try:
        with torch.enable_grad():
            logits = m(px).logits
            value = logits[torch.arange(px.shape[0]), cls].sum()
            (g,) = torch.autograd.grad(value, seen[0])
    finally:
        h.remove()
    return (seen[0] * g).detach()


@pytest.mark.parametrize("kind,path,where", [("vit_cls", "vit.layers.0", "input"),
                                             ("clip_cls", "vision_model.pre_layrnorm", "input")])
@pytest.mark.parametrize("rules_on", [False, True])
def test_relevance_is_input_times_gradient_at_the_patch_embeddings(kind, path, where, rules_on):
    """Plain gradients (rules off) and the rule scope (rules on): pyattr's relevance equals
    a hand-made x · grad at the module where patch, [CLS] and position embeddings meet."""
    m = model(kind, dtype=torch.float64, biases=0.1)
    px = pixels(2, dtype=torch.float64)
    rules = pyattr.RelevanceRules.all() if rules_on else pyattr.RelevanceRules()
    r = pyattr.relevance(m, px, target=[1, 3], rules=rules)
    entry = m.get_submodule(path)
    if rules_on:
        with pyattr.use_relevance_rules(m, rules):
            ref = _hand_relevance(m, px, torch.tensor([1, 3]), entry, where)
    else:
        ref = _hand_relevance(m, px, torch.tensor([1, 3]), entry, where)
    torch.testing.assert_close(r.relevance.double(), ref, rtol=1e-5, atol=1e-7)
    # the entry tensor is what the embeddings module returns (patches, [CLS], positions)
    emb = (m.vit.embeddings if kind == "vit_cls" else m.vision_model.embeddings)(px)
    torch.testing.assert_close(r.relevance.double(), emb * (ref / emb), rtol=1e-5, atol=1e-7)
    assert r.target_ids.tolist() == [1, 3]
    torch.testing.assert_close(r.target, m(px).logits[[0, 1], [1, 3]].double())


def test_patch_relevance_layout_and_a_non_square_image():
    """[CLS] first, then the patches row by row: a 24 × 40 image (interpolated position
    embeddings) has a 3 × 5 grid, and patch (r, c) is token 1 + r·5 + c."""
    m = model("vit_cls", dtype=torch.float64)
    px = pixels(2, 24, 40, dtype=torch.float64)
    r = pyattr.relevance(m, {"pixel_values": px, "interpolate_pos_encoding": True})
    assert r.patch_grid == (3, 5) and r.token_relevance.shape == (2, 16)
    grid = r.patch_relevance()
    assert grid.shape == (2, 3, 5)
    assert torch.equal(grid[1, 2, 3], r.token_relevance[1, 1 + 2 * 5 + 3])
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all()


def test_top1_class_and_k_targets():
    m = model("vit_cls", dtype=torch.float64)
    px = pixels(3, dtype=torch.float64)
    logits = m(px).logits
    r = pyattr.relevance(m, px)
    assert torch.equal(r.target_ids, logits.argmax(-1))
    torch.testing.assert_close(r.target, logits.max(-1).values)
    rk = pyattr.relevance(m, px, target=torch.tensor([[0, 4]] * 3))
    assert rk.token_relevance.shape == (2, 3, 17) and rk.patch_relevance().shape == (2, 3, 4, 4)
    for j, c in enumerate((0, 4)):
        one = pyattr.relevance(m, px, target=c)
        torch.testing.assert_close(rk.relevance[j], one.relevance, rtol=1e-6, atol=1e-9)
    rd = pyattr.relevance(m, px, target=LogitDiff(0, 4))
    torch.testing.assert_close(rd.target, (logits[:, 0] - logits[:, 4]).double())


def test_image_processor_output_and_a_single_image():
    m = model("vit_cls")
    px = pixels(1)
    a = pyattr.relevance(m, px[0])  # (channels, height, width)
    b = pyattr.relevance(m, T.BatchFeature({"pixel_values": px}))
    assert torch.equal(a.relevance, b.relevance) and a.relevance.shape == (1, 17, 32)


def test_layer_relevance_and_integrated_gradients_on_images():
    m = model("vit_cls", dtype=torch.float64)
    px = pixels(2, dtype=torch.float64)
    lr = pyattr.layer_relevance(m, px, layers="residual")
    assert lr.paths[0] == "vit.layers.0"
    for p in lr.paths:
        d = lr[p].conservation_delta
        assert d is not None and (d.abs() <= 1e-4 * lr.target.abs()).all(), (p, d)
    mlp = pyattr.layer_relevance(m, px, layers="mlp")
    assert mlp.paths == ["vit.layers.0.mlp", "vit.layers.1.mlp"]
    # a zero baseline would put the path through LayerNorm's singularity at 0: a random one
    base = torch.randn(17, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ig = pyattr.integrated_gradients(m, px, baseline=base, n_steps=64, rules=pyattr.RelevanceRules())
    # completeness: Σ attribution = f(x) − f(x₀) up to the quadrature error
    assert (ig.convergence_delta.abs() <= 1e-3 * (ig.target - ig.baseline_target).abs()).all()


@pytest.mark.parametrize("kind", ["vit_cls", "clip_vision_proj"])
def test_scope_hygiene(kind):
    assert_scope_hygiene(model(kind), model(kind))


# --------------------------------------------------------------------------- errors


def test_errors_for_image_inputs():
    m = model("vit_cls")
    px = pixels(1)
    with pytest.raises(ValueError, match="attention_mask: image inputs"):
        pyattr.relevance(m, px, attention_mask=torch.ones(1, 17))
    with pytest.raises(ValueError, match="baseline='pad' runs the pad token"):
        pyattr.relevance(m, px, baseline="pad")
    with pytest.raises(ValueError, match="pixel_values has 1 channels, the model expects 3"):
        pyattr.relevance(m, torch.randn(1, 1, SIZE, SIZE))
    with pytest.raises(ValueError, match="smaller than one 8×8 patch"):
        pyattr.relevance(m, {"pixel_values": torch.randn(1, 3, 4, 40), "interpolate_pos_encoding": True})
    with pytest.raises(ValueError, match="pixel_values holds NaN or inf"):
        pyattr.relevance(m, torch.full((1, 3, SIZE, SIZE), float("nan")))
    with pytest.raises(TypeError, match="pixel_values must be a floating tensor"):
        pyattr.relevance(m, torch.zeros(1, 3, SIZE, SIZE, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"shape \(batch, channels, height, width\) with no empty"):
        pyattr.relevance(m, torch.randn(0, 3, SIZE, SIZE))
    with pytest.raises(ValueError, match="position 3 given, but the model returns one logit per class"):
        pyattr.relevance(m, px, target=Logit(1, position=3))
    with pytest.raises(ValueError, match=r"class ids must be in \[0, 5\)"):
        pyattr.relevance(m, px, target=7)
    with pytest.raises(ValueError, match=r"baseline of shape \(3, 3\) does not match"):
        pyattr.relevance(m, px, baseline=torch.zeros(3, 3))
    with pytest.raises(TypeError, match="clean is an image"):
        pyattr.patching.attribution_patching(m, px, px, metric=lambda out: out.logits[:, 0])


def test_pixel_values_to_a_text_model_names_the_model_type():
    from models import tiny_causal_lm

    m = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match="model type 'llama'.*not a supported vision transformer"):
        pyattr.relevance(m, pixels(1))


def test_patch_relevance_of_a_token_result_raises():
    from models import tiny_causal_lm

    r = pyattr.relevance(tiny_causal_lm("llama"), torch.tensor([[3, 4, 5]]))
    assert r.patch_grid is None
    with pytest.raises(ValueError, match="the input was token ids, not an image"):
        r.patch_relevance()


def test_zeros_baseline_on_images():
    """A zero patch embedding as baseline: relevance is (x − 0)·g and the delta is taken
    against f(x) − f(x₀)."""
    m = model("vit_cls", dtype=torch.float64)
    px = pixels(2, dtype=torch.float64)
    r = pyattr.relevance(m, px, baseline="zeros")
    plain = pyattr.relevance(m, px)
    torch.testing.assert_close(r.relevance, plain.relevance)
    torch.testing.assert_close(r.conservation_delta, plain.conservation_delta - (-r.baseline_target))


# --------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def image_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    labels = {0: "cat", 1: "dog", 2: "bird", 3: "fish", 4: "frog"}
    vit = model("vit_cls")
    vit.config.id2label, vit.config.label2id = labels, {v: k for k, v in labels.items()}
    vit.save_pretrained(root / "vit")
    T.ViTImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(root / "vit")
    clip = model("clip_cls")
    clip.config.id2label, clip.config.label2id = labels, {v: k for k, v in labels.items()}
    clip.save_pretrained(root / "clip")
    T.CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}).save_pretrained(
        root / "clip")
    rng = np.random.default_rng(0)
    PIL.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(root / "img.png")
    (root / "not_an_image.png").write_text("hello")
    model("vit_model").save_pretrained(root / "vit_model")  # no classification head
    T.ViTImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(root / "vit_model")
    bert = T.BertModel(T.BertConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_attention_heads=2,
                                    num_hidden_layers=1))
    bert.save_pretrained(root / "bert")
    T.ViTImageProcessor().save_pretrained(root / "bert")
    return root


@pytest.mark.parametrize("kind", ["vit", "clip"])
def test_cli_image_run(kind, image_dirs, tmp_path):
    out = tmp_path / "map.png"
    res = run_cli("explain", "--model", str(image_dirs / kind), "--image", str(image_dirs / "img.png"),
                  "--png", str(out), "--json")
    assert res.returncode == 0, res.stderr
    j = json.loads(res.stdout)
    assert j["mode"] == "image" and j["patch_grid"] == [4, 4] and j["image_png"] == str(out)
    rel = j["segments"][0]["relevance"]
    assert len(rel) == 17 and j["segments"][0]["tokens"][:2] == ["[CLS]", "patch(0,0)"]
    assert abs(j["conservation_delta"]) <= 1e-4 * abs(j["target"])
    assert j["target_description"].endswith(", top-1)")
    # the map: a figure (title, the image, the overlay, a colour bar); the overlay's box is in
    # the PNG's text chunk: 4 × 4 blocks of 8 pixels drawn 6 times as large (the map at least
    # 192 pixels a side)
    im = PIL.open(out)
    x, y, w, h = map(int, im.info["pyattr-overlay"].split(","))
    assert (w, h) == (192, 192) and im.mode == "RGB" and im.size[0] > x + w and im.size[1] > y + h
    arr = np.asarray(im).astype(int)[y:y + h, x:x + w]
    patches = np.array(rel[1:]).reshape(4, 4)
    r, c = np.unravel_index(np.abs(patches).argmax(), patches.shape)
    block = arr[48 * r:48 * r + 48, 48 * c:48 * c + 48]
    red_minus_blue = block[..., 0].mean() - block[..., 2].mean()
    assert (red_minus_blue > 0) == (patches[r, c] > 0)
    # the same number from the Python API on the processed image
    proc = (T.ViTImageProcessor if kind == "vit" else T.CLIPImageProcessor).from_pretrained(image_dirs / kind)
    m = (T.ViTForImageClassification if kind == "vit" else T.CLIPForImageClassification).from_pretrained(
        image_dirs / kind).eval()
    px = proc(images=PIL.open(image_dirs / "img.png").convert("RGB"), return_tensors="pt")["pixel_values"]
    api = pyattr.relevance(m, px)
    np.testing.assert_allclose(rel, api.token_relevance[0].tolist(), rtol=1e-5, atol=1e-7)


def test_cli_image_target_label_and_terminal(image_dirs, tmp_path):
    res = run_cli("explain", "--model", str(image_dirs / "vit"), "--image", str(image_dirs / "img.png"),
                  "--target", "Dog", "--png", str(tmp_path / "m.png"), "--html", str(tmp_path / "m.html"))
    assert res.returncode == 0, res.stderr
    assert "class logit of 'dog' (class 1)" in res.stdout
    assert "4×4 patches" in res.stdout and "top patches by |relevance|" in res.stdout
    assert "data:image/png;base64," in (tmp_path / "m.html").read_text()


@pytest.mark.parametrize("args, message", [
    (["--image", "x.png"], "--image needs --model DIR"),
    (["--model", "{vit}", "--image", "{img}", "--text", "hi"], "--image explains an image; drop --text"),
    (["--model", "{vit}", "--png", "o.png"], "--png is the relevance map of --image"),
    (["--model", "{vit}", "--image", "{root}/missing.png"], "does not exist or is not a file"),
    (["--model", "{vit}", "--image", "{root}/not_an_image.png"], "cannot read image"),
    (["--model", "{vit}", "--image", "{img}", "--target", "zebra"], "--target 'zebra' is not one of the model's class labels"),
    (["--model", "{vit}", "--image", "{img}", "--target", "9"], "class index 9 is outside the model's 5 classes"),
    # decided from config.json before any weights load (pyattr.cli._common.checkpoint_kind)
    (["--model", "{minilm}", "--image", "{img}"], "is a sentence encoder (BertModel)"),
    (["--model", "{root}/bert", "--image", "{img}"], "--image needs an image classifier; --model "),
    (["--model", "{root}/vit_model", "--image", "{img}"], "vit_model is an encoder (ViTModel)"),
])
def test_cli_image_errors(image_dirs, args, message):
    from pyattr.apps.explain import bundled_model_dir

    fill = {"vit": str(image_dirs / "vit"), "img": str(image_dirs / "img.png"), "root": str(image_dirs),
            "minilm": str(bundled_model_dir())}
    res = run_cli("explain", *[a.format(**fill) for a in args])
    assert res.returncode != 0
    assert message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_cli_refuses_images_deeper_than_8_bits(image_dirs, tmp_path):
    """A 16-bit PNG would be clipped by an RGB conversion: refused, not explained wrongly."""
    deep = tmp_path / "deep.png"
    PIL.fromarray(np.full((32, 32), 40000, dtype=np.uint16)).save(deep)
    assert PIL.open(deep).mode.startswith("I")
    res = run_cli("explain", "--model", str(image_dirs / "vit"), "--image", str(deep))
    assert res.returncode != 0 and "more than 8 bits per channel" in res.stderr


def test_target_labels_exact_first_then_loose_then_index():
    from types import SimpleNamespace

    from pyattr.apps.explain import ExplainError
    from pyattr.apps.image import class_id

    cfg = SimpleNamespace(id2label={0: "7", 1: "3", 2: " cat ", 3: "Dog", 4: "dog", 5: "crane", 6: "Crane"},
                          num_labels=7)
    m = SimpleNamespace(config=cfg)
    assert class_id(m, "dog") == 4 and class_id(m, "Dog") == 3   # exact label wins
    assert class_id(m, "3") == 1 and class_id(m, "7") == 0       # a label made of digits is a label
    assert class_id(m, "cat") == 2 and class_id(m, " cat ") == 2  # spaces and case, when unique
    assert class_id(m, "5") == 5                                 # otherwise a digit string is an index
    with pytest.raises(ExplainError, match="names 2 classes"):
        class_id(m, "CRANE")
    with pytest.raises(ExplainError, match="nor a class index"):
        class_id(m, "zebra")


def test_cli_grid_prints_numbers_into_a_pipe(image_dirs, tmp_path):
    res = run_cli("explain", "--model", str(image_dirs / "vit"), "--image", str(image_dirs / "img.png"),
                  "--png", str(tmp_path / "m.png"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    i = next(k for k, ln in enumerate(lines) if "4×4 patches" in ln)
    grid = [ln.split() for ln in lines[i + 1:i + 5]]
    assert all(len(row) == 4 and all(v[0] in "+-0" for v in row) for row in grid), grid


def test_text_on_an_image_model_points_to_image(image_dirs):
    res = run_cli("explain", "--model", str(image_dirs / "vit"), "--text", "hello")
    assert res.returncode != 0 and "explain an image with --image FILE" in res.stderr


@pytest.mark.parametrize("bad, exc, msg", [
    (torch.randn(1, 1, 3, 32, 32, generator=torch.Generator().manual_seed(0)), ValueError, r"pixel_values must have shape \(batch, channels, height, width\)"),
    (torch.zeros(3, 32, 32, dtype=torch.uint8), TypeError, "pixel_values must be a floating tensor"),
    (torch.randn(2, 32, generator=torch.Generator().manual_seed(1)), TypeError, r"got torch.float32 \(images go in as pixel_values"),
])
def test_tensor_inputs_that_are_neither_ids_nor_an_image(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        pyattr.relevance(model("vit_cls"), bad)


def test_layer_before_the_entry_with_a_zeros_baseline_names_no_pad_token():
    m = model("vit_cls")
    with pytest.raises(ValueError, match="image inputs have no pad token"):
        pyattr.layer_relevance(m, pixels(1), layers="vit.embeddings", baseline="zeros")
