"""Views of patching results, reported by a fresh-eyes pass: per-position head and neuron
effects reached to_pandas() summed over positions (and were drawn under the label a
sum_positions=True result has), sum_positions=True heads with MLPs crashed to_pandas(), and
plot() took no path."""

import torch

import pyattr.toy as toy
from pyattr.patching import activation_patching, attribution_patching
from pyattr.targets import LogitDiff


def _pair():
    model, tok, _ = toy.load()
    clean = tok(["sun cat red tree sun cat"], return_tensors="pt")["input_ids"]
    corrupt = tok(["sun cat ant tree sun cat"], return_tensors="pt")["input_ids"]
    return model, clean, corrupt, LogitDiff(tok.convert_tokens_to_ids("red"), tok.convert_tokens_to_ids("ant"))


def test_per_position_heads_keep_their_positions_in_to_pandas(tmp_path):
    model, clean, corrupt, metric = _pair()
    r = activation_patching(model, clean, corrupt, metric, nodes="heads", progress=False)
    eff = r.effects["heads"][0]                                   # (layers, positions, heads)
    df = r.to_pandas()
    assert len(df) == eff.numel() and {"position", "token", "layer", "head", "effect"} <= set(df.columns)
    for _, row in df.sample(10, random_state=0).iterrows():
        assert float(eff[int(row["layer"]), int(row["position"]), int(row["head"])]) == row["effect"]
    text = r._panels()[0].title
    assert "as the sum of its per-position effects" in text and "sum_positions=True" in text
    fig = r.plot(tmp_path / "heads.png")
    assert (tmp_path / "heads.png").stat().st_size > 0 and fig is not None


def test_summed_heads_with_mlp_to_pandas():
    model, clean, corrupt, metric = _pair()
    r = attribution_patching(model, clean, corrupt, metric, nodes=["heads", "mlp"], sum_positions=True)
    df = r.to_pandas()
    heads, mlp = r.effects["heads"][0], r.effects["mlp"][0]
    assert len(df) == heads.numel() + mlp.numel()
    got = sorted(df.effect.tolist())
    want = sorted(heads.flatten().double().tolist() + mlp.flatten().double().tolist())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))


def test_sampled_neurons_unpatched_stay_out_of_the_views():
    model, clean, corrupt, metric = _pair()
    s = activation_patching(model, clean, corrupt, metric, nodes="neurons", sample=10, progress=False)
    eff = s.effects["neurons"]
    df = s.to_pandas()
    assert len(df) == int((~eff.isnan()).sum()) == 10 and not df.effect.isna().any()
    drawn = s._panels()                                           # the drawing: unpatched cells are None
    cells = [v for p in drawn for row in p.values for v in row]
    assert sum(v is not None for v in cells) == len({(int(l), int(n)) for l, _, n in
                                                      (~eff[0].isnan()).nonzero().tolist()})


def test_generation_warns_where_the_models_config_samples():
    import warnings

    import pytest

    import pyattr

    model, tok, _ = toy.load()
    enc = tok(["sun cat red"], return_tensors="pt")
    was = model.generation_config.do_sample
    model.generation_config.do_sample = True
    try:
        with pytest.warns(UserWarning, match=r"generates greedily; model.generation_config has do_sample=True"):
            greedy = pyattr.generation_relevance(model, enc, max_new_tokens=3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # asked for explicitly: no warning
            same = pyattr.generation_relevance(model, enc, max_new_tokens=3, generate_kwargs={"do_sample": False})
    finally:
        model.generation_config.do_sample = was
    assert torch.equal(greedy.sequences, same.sequences)
