"""``pyattr patch``: outputs on the bundled MiniLM and a local causal LM, one-line errors."""

import json

import pytest
import torch

from conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


def test_default_pair_json_matches_the_api(tmp_path):
    out = tmp_path / "p.json"
    r = run_cli("patch", "--method", "atp", "--nodes", "residual,mlp", "--json", out)
    assert r.returncode == 0, r.stderr
    assert "top 10 nodes by |effect| (atp)" in r.stdout and f"JSON written to {out}" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["clean_tokens"][6] == "guitar" and doc["corrupt_tokens"][6] == "ladder"
    res = doc["methods"]["atp"]["effects"]
    assert len(res["residual"]) == 6 and len(res["residual"][0]) == len(doc["clean_tokens"])

    # the same numbers from the Python API
    from models import minilm

    from pyattr import patching as P
    from pyattr import targets as T
    from pyattr.apps.patch_report import DEFAULT_CLEAN, DEFAULT_CORRUPT, DEFAULT_PARTNER

    tok, model = minilm()
    with torch.no_grad():
        ref = model(**tok(DEFAULT_PARTNER, return_tensors="pt")).last_hidden_state.mean(1)[0]
    api = P.attribution_patching(model, dict(tok(DEFAULT_CLEAN, return_tensors="pt")),
                                 dict(tok(DEFAULT_CORRUPT, return_tensors="pt")), T.Cosine(ref),
                                 nodes=("residual", "mlp"), method="atp")
    torch.testing.assert_close(torch.tensor(res["mlp"]), api["mlp"][0], atol=1e-6, rtol=1e-5)
    assert doc["clean_metric"] == pytest.approx(float(api.clean_metric[0]), abs=1e-6)
    assert doc["corrupt_metric"] == pytest.approx(float(api.corrupt_metric[0]), abs=1e-6)


@pytest.mark.slow
def test_method_all_draws_heatmaps_and_scatter(tmp_path):
    png, page = tmp_path / "p.png", tmp_path / "p.html"
    r = run_cli("patch", "--method", "all", "--nodes", "residual,heads", "--png", png, "--html", page, "--top", "3")
    assert r.returncode == 0, r.stderr
    assert "Pearson / Spearman with activation patching" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert text.count("<table>") == 1 + 3 * 2  # correlations + 3 methods x 2 node types
    assert "exact: heads" in text and "L5 H11" in text and "data:image/png;base64," in text


def test_neurons_json_and_panels_compare_the_same_nodes(tmp_path):
    from pyattr.apps.patch_report import run_patch

    rep = run_patch(None, None, None, None, None, ["neurons"], ("atp", "exact"), 12)
    mask = rep.results["exact"].sampled["neurons"]
    assert int(mask.sum()) == 12
    for m in ("atp", "exact"):  # both panels add up the sampled neurons only
        want = torch.where(mask[0], torch.nan_to_num(rep.results[m]["neurons"][0]), torch.zeros(())).sum(-1)
        want = torch.where(mask[0].any(-1), want, torch.full((), float("nan")))
        torch.testing.assert_close(rep.panel(m, "neurons"), want, equal_nan=True)
    doc = rep.to_json()
    ex = doc["methods"]["exact"]
    assert ex["dims"]["neurons"] == ["layer", "position", "neuron"]
    assert len(ex["effects"]["neurons"]) == 6 and len(ex["effects"]["neurons"][0][0]) == 1536
    flat = [v for layer in ex["effects"]["neurons"] for pos in layer for v in pos]
    assert sum(v is not None for v in flat) == 12  # the rest were not patched: null
    assert sum(v for layer in ex["sampled"]["neurons"] for pos in layer for v in pos) == 12
    json.dumps(doc)


def test_causal_model_exact(causal_dir, tmp_path):
    out = tmp_path / "c.json"
    r = run_cli("patch", "--model", causal_dir, "--clean", "the cat sat on the mat",
                "--corrupt", "the dog sat on the mat", "--method", "exact", "--nodes", "residual,neurons",
                "--sample", "5", "--json", out)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["metric"].startswith("logit of the clean run's top-1")
    assert len(doc["methods"]["exact"]["effects"]["residual"]) == 2


@pytest.mark.parametrize("args, message", [
    (("--nodes", "residual,head"), "--nodes: unknown node type(s) ['head']"),
    (("--clean", "  ", "--corrupt", "x"), "--clean is empty"),
    (("--clean", "A man is playing a guitar on stage.", "--corrupt", "A man is playing a loud guitar on stage."),
     "the two texts must have the same number of tokens"),
    (("--target", "x"), "--target needs --model"),
    (("--model", ".", "--pair", "x"), "--pair works with the sentence-embedding model only"),
    (("--png", "/nonexistent-dir/p.png"), "--png: cannot write '/nonexistent-dir/p.png': directory"),
    (("--top", "0"), "--top must be >= 1"),
    (("--clean", "The dog chased the ball."), "--clean and --corrupt go together"),
    (("--clean", "word " * 600, "--corrupt", "word " * 599 + "cat"), "--clean is 602 tokens long; the model reads at most 512"),
    (("--pair", "word " * 600), "--pair is 602 tokens long; the model reads at most 512"),
    (("--method", "eap"), "argument --method: invalid choice: 'eap'"),
])
def test_errors_are_one_line_with_status_2(args, message):
    r = run_cli("patch", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("pyattr patch: error: ")
    assert message in r.stderr


def test_unmapped_architecture_is_refused_naming_generic_or_runs_with_it(tmp_path):
    """`pyattr patch --model DIR` of an architecture without a table entry is one line naming
    --generic; with --generic the effects are the API's attribution_patching(generic=True)."""
    import pyattr.patching as P
    import pyattr.targets as targets
    from models import minilm, tiny_unmapped

    tok, _ = minilm()
    model = tiny_unmapped("CohereConfig", torch.float32, attn=None, vocab_size=len(tok), pad_token_id=0)
    d = tmp_path / "cohere"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    args = ("patch", "--model", d, "--clean", "the cat sat", "--corrupt", "the dog sat", "--nodes", "heads,mlp")
    r = run_cli(*args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "CohereForCausalLM (model_type 'cohere')" in r.stderr and "pass --generic" in r.stderr, r.stderr
    out = tmp_path / "p.json"
    r = run_cli(*args, "--generic", "--json", out)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())["methods"]["relp"]["effects"]
    # a causal model's metric is the next token after the text: its ids without the [SEP] the
    # tokenizer appends (the next token after [SEP] is what follows the end of a text)
    ids = {w: torch.tensor([tok(f"the {w} sat")["input_ids"][:-1]]) for w in ("cat", "dog")}
    assert tok.convert_ids_to_tokens(tok("the cat sat")["input_ids"])[-1] == "[SEP]"
    api = P.attribution_patching(model, ids["cat"], ids["dog"], targets.Logit(), nodes=("heads", "mlp"), generic=True)
    torch.testing.assert_close(torch.tensor(doc["heads"]), api["heads"][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(doc["mlp"]), api["mlp"][0], atol=1e-6, rtol=1e-5)


# --- review: --generic beyond --model --text ------------------------------------------------

def _unmapped_dirs(tmp_path):
    """An unmapped encoder (Electra) with the MiniLM tokenizer, and an unmapped image
    classifier (BEiT) with an image processor, saved as directories."""
    import numpy as np
    import transformers as T
    from PIL import Image

    from models import minilm

    tok, _ = minilm()
    torch.manual_seed(0)
    enc = T.ElectraModel(T.ElectraConfig(vocab_size=len(tok), hidden_size=32, embedding_size=32, intermediate_size=48,
                                         num_attention_heads=4, num_hidden_layers=2)).eval()
    enc.save_pretrained(tmp_path / "electra")
    tok.save_pretrained(tmp_path / "electra")
    cfg = T.BeitConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                       num_hidden_layers=2, num_labels=3, use_mean_pooling=False)
    cfg._attn_implementation = "eager"
    T.BeitForImageClassification(cfg).eval().save_pretrained(tmp_path / "beit")
    T.BeitImageProcessor(size={"height": 32, "width": 32}, do_center_crop=False).save_pretrained(tmp_path / "beit")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(tmp_path / "img.png")
    return tok, enc


def test_explain_generic_reaches_pairs_and_images(tmp_path):
    """`explain --generic` was read for --model --text only: with --pair or --image the
    unmapped model was refused with a message asking for --generic, which was given. Both
    now run through the discovered entry, with the API's numbers."""
    import transformers as T
    from PIL import Image

    import pyattr

    tok, enc = _unmapped_dirs(tmp_path)
    pair = ("explain", "--model", tmp_path / "electra", "--text", "the cat sat", "--pair", "a dog ran", "--json")
    r = run_cli(*pair)
    assert r.returncode == 2 and "--generic" in r.stderr, r.stderr
    r = run_cli(*pair, "--generic")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["segments"][0]["tokens"][:2] == ["[CLS]", "the"]
    image = ("explain", "--model", tmp_path / "beit", "--image", tmp_path / "img.png", "--png", tmp_path / "m.png",
             "--json")
    r = run_cli(*image)
    assert r.returncode == 2 and "--generic" in r.stderr, r.stderr
    r = run_cli(*image, "--generic")
    assert r.returncode == 0, r.stderr
    rel = json.loads(r.stdout)["segments"][0]["relevance"]
    proc = T.BeitImageProcessor.from_pretrained(tmp_path / "beit")
    m = T.BeitForImageClassification.from_pretrained(tmp_path / "beit").eval()
    px = proc(images=Image.open(tmp_path / "img.png").convert("RGB"), return_tensors="pt")["pixel_values"]
    api = pyattr.relevance(m, px, generic=True)
    torch.testing.assert_close(torch.tensor(rel), api.token_relevance[0], rtol=1e-5, atol=1e-7)


def test_png_panels_of_a_node_type_share_one_scale():
    """The PNG's panels of one node type (one column) are on one colour scale, the largest
    |effect| over the methods, stated in each title with the panel's own largest."""
    import matplotlib.pyplot as plt

    from pyattr.apps.patch_report import figure, run_patch, shared_limits

    rep = run_patch("sun cat red tree sun", "sun dog red tree sun", None, "induction", None, ["residual", "heads"],
                    ("relp", "atp", "exact"), 10)
    assert rep.model == "induction (bundled)"
    lims = shared_limits(rep)
    for n in rep.nodes:
        own = {m: float(torch.nan_to_num(rep.panel(m, n)).abs().max()) for m in rep.results}
        assert lims[n] == max(own.values()) > 0
    fig = figure(rep)
    axes = [ax for ax in fig.axes if ax.images and ax.get_title()]
    assert len(axes) == 3 * 2
    for ax in axes:
        m, n = ax.get_title().split("\n")[0].split(": ")
        own = float(torch.nan_to_num(rep.panel(m, n)).abs().max())
        assert ax.images[0].get_clim() == pytest.approx((-lims[n], lims[n]))
        assert ax.get_title() == f"{m}: {n}\ncolour ±{lims[n]:.3g} (the column's), max here {own:.3g}"
    assert "the panels of a column share one colour scale (±limit in each title)" in \
        " ".join(fig._suptitle.get_text().split())
    plt.close(fig)
