"""The trained toy induction decoder (pyattr.toy): the task, the shipped model, its circuit
found with plain PyTorch, and what explanations of it must show."""

import json
import subprocess
import sys

import pytest
import torch

import pyattr
import pyattr.toy as toy
import pyattr.toy.circuit as C
import pyattr.toy.task as task
import pyattr.toy.train as train
from conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shipped():
    return toy.load()


def test_task_sequences_repeat_a_segment_of_distinct_words():
    ids, determined = task.batch(torch.Generator().manual_seed(0), 32)
    assert ids.shape == (32, task.LENGTH + 1) and bool((ids[:, 0] == 1).all())
    for row, det in zip(ids, determined):
        n = int(det.float().argmax())
        seg = row[1:n + 1].tolist()
        assert n in task.PERIODS and len(set(seg)) == n
        assert row[1:].tolist() == [seg[j % n] for j in range(task.LENGTH)]
        assert det.tolist() == [n <= p < task.LENGTH for p in range(task.LENGTH + 1)]


@pytest.mark.parametrize("kind", task.KINDS)
def test_pairs_differ_in_one_word_of_the_first_segment(kind):
    for p in task.pairs(torch.Generator().manual_seed(2), 20, kind=kind):
        diff = [i for i, (a, b) in enumerate(zip(p.clean, p.corrupt)) if a != b]
        assert len(p.clean) == len(p.corrupt) == 1 + 6 + 3
        assert diff == [p.source if kind == "value" else p.source - 1]
        assert p.clean[p.source] == p.answer and p.alternative not in p.clean
    with pytest.raises(ValueError, match=r"kind must be one of \('value', 'key'\), got 'query'"):
        task.pairs(torch.Generator(), 1, kind="query")


def test_tokenizer_reads_words_and_prepends_bos(shipped):
    _, tok, _ = shipped
    enc = tok(["sun cat red", "dog"], padding=True)
    vocab = task.vocabulary()
    assert enc["input_ids"] == [[1, vocab["sun"], vocab["cat"], vocab["red"]], [0, 0, 1, vocab["dog"]]]
    assert enc["attention_mask"] == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert tok.decode(enc["input_ids"][0]) == "<s> sun cat red"


def test_shipped_model_is_small_and_solves_the_task(shipped):
    model, _, circuit = shipped
    size = sum(f.stat().st_size for f in toy.INDUCTION_DIR.iterdir())
    assert size < 2_000_000
    assert (model.config.num_hidden_layers, model.config.num_attention_heads) == (2, 4)
    assert train.accuracy(model, count=256, seed=123) >= 0.99
    assert circuit["training"]["accuracy"] >= 0.99


def test_the_known_circuit_shows_itself_in_a_few_lines(shipped):
    import json

    _, _, circuit = shipped
    assert circuit == json.loads((toy.INDUCTION_DIR / "circuit.json").read_text())  # still the record, a dict
    text = repr(circuit)
    assert "\n" not in text and len(text) < 500  # printed bare it was 50 lines
    assert text.startswith("KnownCircuit(previous-token 0.0, previous-token 0.3, induction 1.0, induction 1.1;")
    page = circuit._repr_html_()
    assert page.count("<tr>") == 5 and "<td>1.1</td><td>induction</td>" in page


def test_stored_circuit_is_what_the_analysis_finds(shipped):
    model, _, circuit = shipped
    fresh = C.analyse(model)
    assert fresh["previous_token_heads"] == circuit["previous_token_heads"]
    assert fresh["induction_heads"] == circuit["induction_heads"]
    torch.testing.assert_close(torch.tensor(fresh["scores"]["induction"]),
                               torch.tensor(circuit["scores"]["induction"]), atol=1e-5, rtol=0)


def test_circuit_heads_carry_the_mechanism(shipped):
    model, _, circuit = shipped
    prev, ind = circuit["previous_token_heads"], circuit["induction_heads"]
    assert prev and ind and all(l == 0 for l, _ in prev) and all(l == 1 for l, _ in ind)
    scores = circuit["scores"]
    for l, h in prev:
        assert scores["previous_token"][l][h] > C.THRESHOLD
    for l, h in ind:
        assert scores["induction"][l][h] > C.THRESHOLD
    # mean-ablating the circuit breaks the task; the same number of other heads does not
    circuit_heads = [tuple(h) for h in prev + ind]
    others = [(l, h) for l in range(2) for h in range(4) if (l, h) not in circuit_heads][:len(circuit_heads)]
    assert C.mean_ablation(model, circuit_heads)["circuit"] < 0.5
    assert C.mean_ablation(model, others)["circuit"] > 0.9
    # exact patching on value pairs: the two largest effects are induction heads
    effects = C.head_patching(model, task.pairs(torch.Generator().manual_seed(4), 32)).mean(0)
    top = {divmod(i, 4) for i in effects.flatten().abs().topk(2).indices.tolist()}
    assert top <= {tuple(h) for h in ind}


def test_plain_head_patching_equals_pyattr_activation_patching(shipped):
    from pyattr.patching import activation_patching
    from pyattr.targets import LogitDiff

    model, _, _ = shipped
    for kind in task.KINDS:
        pairs = task.pairs(torch.Generator().manual_seed(5), 8, kind=kind)
        clean, corrupt, answer, alternative = C.pair_tensors(pairs)
        ours = activation_patching(model, clean, corrupt, LogitDiff(answer, alternative), nodes="heads",
                                   sum_positions=True)["heads"]
        torch.testing.assert_close(ours.double(), C.head_patching(model, pairs), atol=2e-5, rtol=1e-5)


def test_relevance_of_a_copied_word_points_at_its_source(shipped):
    model, tok, _ = shipped
    pairs = task.pairs(torch.Generator().manual_seed(6), 64)
    clean, _, answer, _ = C.pair_tensors(pairs)
    r = pyattr.relevance(model, clean, target=pyattr.targets.Logit(answer))
    source = torch.tensor([p.source for p in pairs])
    assert bool((r.token_relevance.argmax(-1) == source).all())
    assert r.conservation_delta.abs().max() < 1e-3
    # a left-padded batch of different periods: each row's top token is its copied word
    texts = ["sun cat red sun cat", "dog fish bird moon star rain dog fish bird moon"]
    enc = dict(tok(texts, padding=True, return_tensors="pt"))
    r = pyattr.relevance(model, enc)
    assert tok.convert_ids_to_tokens(r.target_ids.tolist()) == ["red", "star"]
    top = r.token_relevance.argmax(-1)
    assert [enc["input_ids"][i, top[i]].item() for i in range(2)] == r.target_ids.tolist()


def test_cli_explain_and_patch_take_model_induction(tmp_path):
    r = run_cli("explain", "--model", "induction", "--text", "sun cat red tree sun cat red", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["target_description"] == "next-token logit of 'tree' (id 7, top-1)"
    seg = doc["segments"][0]
    top = max(range(len(seg["tokens"])), key=lambda i: seg["relevance"][i])
    assert seg["tokens"][top] == "tree" and top == 4
    out = tmp_path / "p.json"
    r = run_cli("patch", "--model", "induction", "--clean", "sun cat red tree sun cat",
                "--corrupt", "sun cat dog tree sun cat", "--nodes", "heads", "--method", "exact", "--json", out)
    assert r.returncode == 0, r.stderr
    heads = torch.tensor(json.loads(out.read_text())["methods"]["exact"]["effects"]["heads"])  # (layer, pos, head)
    layer, rest = divmod(int(heads.abs().argmax()), heads.shape[1] * heads.shape[2])
    pos, head = divmod(rest, heads.shape[2])
    # the largest effect: an induction head, at the last position (where it copies)
    assert [layer, head] in toy.load()[2]["induction_heads"] and pos == heads.shape[1] - 1


@pytest.mark.slow
def test_retraining_keeps_the_circuit_and_the_accuracy(tmp_path, shipped):
    _, _, circuit = shipped
    r = subprocess.run([sys.executable, "-m", "pyattr.toy.train", str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    model, _, again = toy.load(tmp_path)
    assert again["previous_token_heads"] == circuit["previous_token_heads"]
    assert again["induction_heads"] == circuit["induction_heads"]
    assert again["training"]["accuracy"] >= 0.99 and train.accuracy(model, count=256, seed=123) >= 0.99
