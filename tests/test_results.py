"""Results that show themselves (DESIGN §11): every result class saves to safetensors and
loads back equal (tensors, tokens, coverage), renders self-contained HTML with a legend
and hover values, plots a matplotlib figure with a colour bar, and lays out as a table."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import pyattr
import pyattr.evaluate as E
import pyattr.toy
from pyattr.patching import attribution_patching

TEXT = "cat dog owl fox cat dog"


@pytest.fixture(scope="module")
def results(toy):
    tok, model = toy
    torch.manual_seed(0)
    rel = pyattr.relevance(model, [TEXT, "red blue king red"], target=["owl", "blue"], tokenizer=tok)
    out = {
        "relevance": rel,
        "k targets": pyattr.relevance(model, TEXT, target=torch.tensor([[35, 36]]), tokenizer=tok),
        "layer": pyattr.layer_relevance(model, TEXT, "residual", target="owl", tokenizer=tok),
        "ig": pyattr.integrated_gradients(model, TEXT, target="owl", n_steps=4, tokenizer=tok),
        "generation": pyattr.generation_relevance(model, ["cat dog owl fox cat", "red blue red"], max_new_tokens=2,
                                                  tokenizer=tok),
        "patching": attribution_patching(model, TEXT, "cat dog bee fox cat dog", lambda o: o.logits[:, -1, 5],
                                         nodes=("residual", "heads"), method="relp", tokenizer=tok),
        "curve": E.perturbation_curve(model, TEXT, rel.token_relevance[:1], target="owl", steps=4, tokenizer=tok),
        "audit": pyattr.audit(model, TEXT, target="owl", tokenizer=tok),
    }
    with pyattr.capture(model, ["model.layers.0"]) as cap:
        logits = model(torch.tensor([tok(TEXT)["input_ids"]])).logits
        logits[0, -1, 5].backward()
    out["capture"] = cap
    out["captured"] = cap["model.layers.0"]
    return out


def _equal(a, b, where="result"):
    """Deep equality: tensors with torch.equal (NaN equal to NaN), dataclasses by field."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(torch.nan_to_num(a, nan=1.5e38), torch.nan_to_num(b, nan=1.5e38)), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _equal(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("name", ["relevance", "k targets", "layer", "ig", "generation", "patching", "curve", "audit"])
def test_save_load_round_trip(results, tmp_path, name):
    r = results[name]
    path = r.save(tmp_path / name.replace(" ", "_"))
    assert path.endswith(".safetensors")
    back = pyattr.load(path)
    _equal(r, back)
    assert back._repr_html_() == r._repr_html_()


def test_capture_round_trip(results, tmp_path):
    cap = results["capture"]
    back = pyattr.load(cap.save(tmp_path / "cap.safetensors"))
    assert list(back) == ["model.layers.0"]
    _equal(cap["model.layers.0"].outputs[0], back["model.layers.0"].outputs[0])
    _equal(cap["model.layers.0"].grad, back["model.layers.0"].grad)
    one = pyattr.load(results["captured"].save(tmp_path / "one"))
    assert one.path == "model.layers.0" and len(one.call_grads) == 1
    _equal(results["captured"].grads, one.grads)


def test_load_errors(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(FileNotFoundError, match=r"^load\(\): no file '.*nothing.safetensors'$"):
        pyattr.load(tmp_path / "nothing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"^load\(\): '.*junk.safetensors' is not a safetensors file"):
        pyattr.load(tmp_path / "junk.safetensors")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match=r"is a safetensors file but not a pyattr result \(save\(\) writes those\)$"):
        pyattr.load(tmp_path / "plain.safetensors")
    # a file cannot name code outside the allow-list (no pickle, no arbitrary import)
    doc = {"__dataclass__": "os:system", "fields": {}}
    save_file({"x": torch.zeros(1)}, str(tmp_path / "evil.safetensors"),
              metadata={"format": "pyattr-result/1", "pyattr": json.dumps(doc)})
    with pytest.raises(ValueError, match=r"^load\(\): the file asks for class 'os:system', which is not a pyattr "
                                         r"result type$"):
        pyattr.load(tmp_path / "evil.safetensors")
    with pytest.raises(ValueError, match=r"^save\(\): directory '.*' does not exist$"):
        from pyattr.results.store import save

        save(pyattr.load.__module__ and _dummy_result(), tmp_path / "no" / "such" / "dir.safetensors")


def _dummy_result():
    from pyattr.evaluate.perturbation import PerturbationCurve

    return PerturbationCurve(torch.zeros(2), torch.zeros(1, 2), torch.zeros(1), "morf", "zero_embedding")


def test_html_is_self_contained_with_tokens_legend_and_hover(results):
    r = results["relevance"]
    page = r._repr_html_()
    assert "<script" not in page and "http" not in page and "src=" not in page
    assert page.count("class='legend'") + page.count('class="legend"') == 2  # one legend per row
    for tok in [" dog", " owl", " fox"]:
        assert f">{tok}</span>" in page
    v = float(r.token_relevance[0, 3])
    assert f"position 3 · &#x27; owl&#x27; · relevance {v:+.4g}" in page
    assert "target &#x27; owl&#x27;" in page
    # padding (None) is not drawn
    assert page.count('class="tok"') == sum(t is not None for row in r.tokens for t in row)


def test_generation_view_marks_cells_outside_the_context(results):
    g = results["generation"]
    df = g.to_pandas()
    # row 0, step 0: context is every column before the step's own token (7 real prompt columns)
    step0 = df[(df.panel == 0) & (df.step_index == 0)]
    own = g.prompt_width
    real = [j for j in range(g.sequences.shape[1]) if g.attention_mask[0, j]]
    assert list(step0.token_index) == [i for i, j in enumerate(real) if j < own]
    torch.testing.assert_close(torch.tensor(step0.relevance.to_numpy()),
                               g.token_relevance[0, 0, [j for j in real if j < own]].double())
    assert 'class="na"' in g._repr_html_()
    # every column is a source of some step: the last generated token, in no step's
    # context, is not drawn as a column hatched in every row
    from pyattr.results.layouts import panels

    matrices = [p for p in panels(g) if hasattr(p, "values")]
    assert len(matrices) == g.sequences.shape[0]
    for r, p in enumerate(matrices):
        cols = list(zip(*p.values))
        assert cols and all(any(v is not None for v in c) for c in cols), p.title
        last = g.prompt_width + int(g.step_mask[r].nonzero().max())  # the last step's own column
        assert len(p.cols) == int(g.attention_mask[r, :last].sum())


def test_to_pandas_values_are_the_tensors(results):
    r = results["relevance"]
    df = r.to_pandas()
    row1 = df[df.panel == 1]
    real = [j for j, t in enumerate(r.tokens[1]) if t is not None]
    assert list(row1.position) == real
    assert list(row1.token) == [r.tokens[1][j] for j in real]
    torch.testing.assert_close(torch.tensor(row1.relevance.to_numpy()), r.token_relevance[1, real].double())
    lay = results["layer"].to_pandas()
    path = results["layer"].paths[1]
    sel = lay[lay.layer == path]
    torch.testing.assert_close(torch.tensor(sel.relevance.to_numpy()),
                               results["layer"][path].relevance[0].double().sum(-1))
    audit = results["audit"].to_pandas()  # the audit keeps its own per-module table
    assert list(audit.path) == [m.path for m in results["audit"].modules]


@pytest.mark.parametrize("name", ["relevance", "layer", "ig", "generation", "patching", "curve", "capture"])
def test_plot_is_a_figure_with_a_colour_bar(results, name):
    from matplotlib.figure import Figure

    fig = results[name].plot()
    assert isinstance(fig, Figure)
    labels = [ax.get_ylabel() for ax in fig.axes]
    if name == "curve":
        assert "target" in labels
    else:
        assert any(lab in ("relevance", "attribution", "effect", "gradient norm") for lab in labels)  # the colour bar
    fig.savefig(__import__("io").BytesIO(), format="png")


def test_show_prints_text_outside_a_notebook(results, capsys):
    results["relevance"].show()
    out = capsys.readouterr().out
    assert out.startswith("RelevanceResult · backend ")
    assert "owl(" in out and "row 1 · target ' blue'" in out


def test_table_only_results_refuse_to_plot(results):
    with pytest.raises(ValueError, match=r"^plot\(\): this result has nothing to draw \(only tables; use to_pandas\(\)\)$"):
        results["audit"].plot()


def test_rows_of_one_result_share_one_colour_scale(results):
    import re

    r = results["relevance"]
    page = r._repr_html_()
    ends = re.findall(r'id="pyattr-[0-9a-f]+-\d+-hi">([^<]+)<', page)
    top = float(r.token_relevance.abs().max())
    assert len(ends) == 2 and ends[0] == ends[1] and abs(float(ends[0]) - top) <= 0.05 * top


@pytest.mark.parametrize("field,value,msg", [
    ("token_relevance", 5.0, r"RelevanceResult\.token_relevance must be Tensor, the file holds float 5\.0"),
    ("token_relevance", "x", r"RelevanceResult\.token_relevance must be Tensor, the file holds str 'x'"),
    ("token_relevance", torch.zeros(2, 3), r"RelevanceResult: relevance \(2, 7, 64\) does not extend token_relevance "
                                           r"\(2, 3\) by a hidden dimension"),
    ("target", torch.zeros(5), r"RelevanceResult: target must be shaped \(2,\) \(or a scalar\), the file holds \(5,\)"),
    ("backend", 3, r"RelevanceResult\.backend must be str, the file holds int 3"),
    ("tokens", [["a"]], r"RelevanceResult: tokens must be 2 rows of 7 strings"),
])
def test_load_checks_each_fields_type_and_shape(results, tmp_path, field, value, msg):
    """A file save() did not write (a field of another type or shape) is a ValueError that
    names the field, never a result that breaks later (issue 45 §6)."""
    from safetensors.torch import save_file

    from pyattr.results.store import _Encoder

    r = dataclasses.replace(results["relevance"], **{field: value})
    enc = _Encoder()
    doc = enc(r)
    path = tmp_path / "edited.safetensors"
    save_file(enc.tensors, str(path), metadata={"format": "pyattr-result/1", "pyattr": json.dumps(doc)})
    with pytest.raises(ValueError, match=r"^load\(\): '.*edited\.safetensors': " + msg):
        pyattr.load(path)


def test_to_pandas_is_one_tidy_table_named_for_what_it_holds(results):
    # the batch row is a column, each panel's long title is said once (df.attrs), not per row
    df = results["relevance"].to_pandas()
    assert list(df.columns) == ["panel", "row", "position", "token", "relevance"]
    assert sorted(df.row.unique().tolist()) == list(range(results["relevance"].token_relevance.shape[0]))
    assert set(df.attrs["titles"]) == set(df.panel.unique().tolist())
    assert df.attrs["titles"][0].startswith("row 0 · target")
    g = results["generation"].to_pandas()
    assert list(g.columns) == ["panel", "row", "step_index", "step", "token_index", "token", "relevance"]
