"""The zoo (pyattr/bench/zoo.py): ``generic=True`` over transformers' own mappings — every
entry right, declared (a mapped architecture's documented loss) or a clear refusal; never a
wrong number without an error, never a crash from inside pyattr."""

import pytest

from pyattr.bench import zoo

pytestmark = pytest.mark.usefixtures("one_thread")


# representative entries, each with the status it must have and a fragment of its detail
FAST = [
    ("causal_lm", "llama", "LlamaForCausalLM", "right", "|delta|/|target|"),          # mapped
    ("masked_lm", "roformer", "RoFormerForMaskedLM", "right", "|delta|/|target|"),    # gelu(x) in its head
    ("masked_lm", "luke", "LukeForMaskedLM", "right", "|delta|/|target|"),            # functional gelu heads
    ("sequence_classification", "roberta", "RobertaForSequenceClassification", "declared", "torch.tanh"),
    ("masked_lm", "albert", "AlbertForMaskedLM", "refused", "AlbertForMaskedLM"),     # a norm left native, measured
    ("masked_lm", "fnet", "FNetForMaskedLM", "refused", "'entry' role"),              # no entry: never a fallback
    ("image_classification", "resnet", "ResNetForImageClassification", "refused", "'entry' role"),
    ("sequence_classification", "biogpt", "BioGptForSequenceClassification", "right", "|delta|/|target|"),
]


@pytest.mark.parametrize("mapping,model_type,cls,status,fragment", FAST, ids=[f"{e[1]}-{e[0]}" for e in FAST])
def test_representative_entries(mapping, model_type, cls, status, fragment):
    row = zoo.classify(mapping, model_type, cls)
    assert (row["status"], fragment in row["detail"]) == (status, True), row


@pytest.mark.slow
def test_the_whole_zoo_has_no_wrong_number_and_no_crash():
    rows = zoo.run()
    counts = zoo.counts(rows)
    bad = [f"{r['status']}: {r['mapping']} {r['model_type']}: {r['detail']}" for r in rows
           if r["status"] in ("wrong", "crash")]
    assert not bad, "\n".join(bad)
    assert counts["right"] >= 103, counts  # the count before the functional rules and the plan check
