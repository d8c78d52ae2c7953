"""Positions, pooling and scale the model decides, read back from the model (DESIGN §10),
each against an independent oracle: transformers' own forward (of the row alone, of the
perturbed input built by hand) and plain float64 autograd.

a) the position convention is observed on the model's own embeddings: MPNet and ESM number
   positions from ``padding_idx + 1`` through a module-level helper, not the RoBERTa method;
b) a perturbation keeps the position a sequence classifier pools from (the last token that
   is not the pad token, with pad = eos) on the unperturbed input;
c) ``"mean_embedding"`` inserts the mean of what the embedding module outputs (Gemma's
   √hidden scale included); on an image, the mean patch embedding of that image;
d) a model that pools inside itself at a token of the ids (CLIP's text tower, both eos
   conventions) keeps, under "pad" / "mask" and a "pad" baseline, the row it pooled on the
   input (its projection follows); where that cannot be observed it is refused;
e) a "pad" baseline of a sequence classifier is read where the input pooled (GPT-2's
   learned positions make position 0 another function).
"""

import pytest
import torch

import pyattr
import pyattr.evaluate as E
import pyattr.evaluate.perturbation as PT
import pyattr.methods._core.positions as P
from models import TEXT_ARCHS, VOCAB, _cfg, pad_rows, tiny_causal_lm
from pyattr import RelevanceRules
from pyattr.architectures import position_probe as B
from pyattr.evaluate.perturbation import perturbed_masks
from pyattr.targets import Logit, ModuleOutput

T = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

PLAIN = RelevanceRules()
PAD = 1
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
             max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
             initializer_range=0.2)


# --------------------------------------------------------------------------- a) position conventions


def _mpnet():
    torch.manual_seed(0)
    cfg = T.MPNetConfig(pad_token_id=PAD, **SMALL)
    cfg._attn_implementation = "eager"
    return T.MPNetForMaskedLM(cfg).double().eval()


def _esm():
    torch.manual_seed(0)
    cfg = T.EsmConfig(pad_token_id=PAD, mask_token_id=3, position_embedding_type="absolute", **SMALL)
    cfg._attn_implementation = "eager"
    return T.EsmForMaskedLM(cfg).double().eval()


BUILD = {"mpnet": _mpnet, "esm": _esm}
# transformers' own numbering (the module-level helper each model's embeddings call)
HF_POSITIONS = {
    "mpnet": lambda ids: T.models.mpnet.modeling_mpnet.create_position_ids_from_input_ids(ids, PAD),
    "esm": lambda ids: T.models.esm.modeling_esm.create_position_ids_from_input_ids(ids, PAD),
}
# where the residual stream enters the blocks (the embedding norm's input, else the first block's)
ENTRY = {"mpnet": "mpnet.embeddings.LayerNorm", "esm": "esm.encoder.layer.0"}


def _rows(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g) for n in (5, 8)]


def _autograd_relevance(model, kind, row, target):
    """Gradient × input at the entry of the row alone, summed over hidden: plain float64
    autograd through transformers' own forward (the row alone numbers its own positions)."""
    seen = {}

    def pre(mod, args, kwargs):
        if args:
            x = args[0].detach().requires_grad_(True)
            seen["x"] = x
            return (x, *args[1:]), kwargs
        x = kwargs["hidden_states"].detach().requires_grad_(True)
        seen["x"] = x
        return args, {**kwargs, "hidden_states": x}

    h = model.get_submodule(ENTRY[kind]).register_forward_pre_hook(pre, with_kwargs=True)
    try:
        logit = model(input_ids=row[None]).logits[0, -1, target]
    finally:
        h.remove()
    (g,) = torch.autograd.grad(logit, seen["x"])
    return logit.detach(), (g * seen["x"]).sum(-1)[0].detach()


@pytest.mark.parametrize("kind", ["mpnet", "esm"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_generic_padded_row_equals_the_row_alone(kind, side):
    m = BUILD[kind]()
    assert P.convention(m) == ("padding_idx", PAD)
    rows = _rows()
    ids, mask = pad_rows(rows, side, pad_id=PAD)
    targets = [7, 11]
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=targets, rules=PLAIN, generic=True)
    for i, (row, t) in enumerate(zip(rows, targets)):
        real = mask[i].bool()
        want, grad_x = _autograd_relevance(m, kind, row, t)
        with torch.no_grad():  # transformers pads by the ids and gives the padded row what it gives alone
            hf_padded = m(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1]).logits[0, real.nonzero()[-1, 0], t]
        torch.testing.assert_close(hf_padded, want, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(r.target[i], want, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(r.token_relevance[i, real].double(), grad_x, atol=1e-5, rtol=1e-4)
        assert bool((r.token_relevance[i, ~real] == 0).all())


@pytest.mark.parametrize("kind", ["mpnet", "esm"])
def test_generic_pad_baseline_is_transformers_on_the_pad_ids_at_the_rows_positions(kind):
    m = BUILD[kind]()
    rows = _rows(4)
    ids, mask = pad_rows(rows, "right", pad_id=PAD)
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=7, rules=PLAIN, generic=True,
                         baseline="pad")
    ig = pyattr.integrated_gradients(m, rows[0][None], target=7, baseline="pad", n_steps=2)
    for i, row in enumerate(rows):
        with torch.no_grad():
            f0 = m(input_ids=torch.full_like(row, PAD)[None], position_ids=HF_POSITIONS[kind](row[None])
                   ).logits[0, -1, 7].double()
            at_pad_positions = m(input_ids=torch.full_like(row, PAD)[None]).logits[0, -1, 7].double()
        assert (f0 - at_pad_positions).abs() > 1e-3  # the positions matter: the old numbering gave another f(x₀)
        torch.testing.assert_close(r.baseline_target[i], f0, atol=1e-9, rtol=1e-9)
        if i == 0:
            torch.testing.assert_close(ig.baseline_target[0], f0, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("kind", ["mpnet", "esm"])
def test_pad_perturbation_keeps_transformers_positions(kind):
    m = BUILD[kind]()
    rows = _rows(5)
    ids, mask = pad_rows(rows, "right", pad_id=PAD)
    rel = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    curve = E.perturbation_curve(m, {"input_ids": ids, "attention_mask": mask}, rel, Logit(7), order="morf",
                                 perturbation="pad", steps=3)
    levels = perturbed_masks(rel, mask.bool(), "morf", 3)
    pos = HF_POSITIONS[kind](ids)  # the unperturbed rows' own positions, as transformers numbers them
    last = mask.sum(1) - 1
    for j in range(4):
        with torch.no_grad():
            out = m(input_ids=ids.masked_fill(levels[:, j], PAD), attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(curve.values[:, j], out[torch.arange(2), last, 7].double(), atol=1e-9, rtol=1e-9)


def _family(name):
    """Tiny base models of the families that number positions from the ids, and of some that do not."""
    s = dict(SMALL)
    cases = {
        "roberta": (T.RobertaConfig, T.RobertaModel, {}),
        "xlm-roberta": (T.XLMRobertaConfig, T.XLMRobertaModel, {}),
        "camembert": (T.CamembertConfig, T.CamembertModel, {}),
        "mpnet": (T.MPNetConfig, T.MPNetModel, {}),
        "esm": (T.EsmConfig, T.EsmModel, dict(position_embedding_type="absolute")),
        "longformer": (T.LongformerConfig, T.LongformerModel, dict(attention_window=4)),
        "luke": (T.LukeConfig, T.LukeModel, dict(entity_vocab_size=10, entity_emb_size=16)),
        "xmod": (T.XmodConfig, T.XmodModel, dict(languages=["en_XX"], default_language="en_XX")),
        "data2vec-text": (T.Data2VecTextConfig, T.Data2VecTextModel, {}),
        "roberta-prelayernorm": (T.RobertaPreLayerNormConfig, T.RobertaPreLayerNormModel, {}),
        "bert": (T.BertConfig, T.BertModel, dict(pad_token_id=0)),
        "electra": (T.ElectraConfig, T.ElectraModel, dict(embedding_size=32, pad_token_id=0)),
        "opt": (T.OPTConfig, T.OPTModel, dict(ffn_dim=64, word_embed_proj_dim=32)),
        "distilbert": (T.DistilBertConfig, T.DistilBertModel,
                       dict(dim=32, hidden_dim=64, n_heads=4, n_layers=2, pad_token_id=0)),
        "gpt2": (T.GPT2Config, T.GPT2Model, dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0)),
    }
    cfg_cls, cls, extra = cases[name]
    kw = {**s, "pad_token_id": PAD, **extra}
    if name == "gpt2":
        kw = {"vocab_size": VOCAB, "initializer_range": 0.2, **extra}
    torch.manual_seed(0)
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    return cls(cfg).double().eval()


FROM_IDS = ("roberta", "xlm-roberta", "camembert", "mpnet", "esm", "longformer", "luke", "xmod", "data2vec-text",
            "roberta-prelayernorm")
FROM_ZERO = ("bert", "electra", "opt", "distilbert", "gpt2")


@pytest.mark.parametrize("name", FROM_IDS + FROM_ZERO)
def test_observed_convention_reproduces_transformers_own_numbering(name):
    """The position ids pyattr passes give what transformers computes when it numbers the
    positions itself (right padding with the model's pad token, where both agree on what a
    row alone gets); the other convention would not."""
    m = _family(name)
    kind, pad = P.convention(m)
    assert (kind, pad) == (("padding_idx", PAD) if name in FROM_IDS else ("mask", 0))
    pad_id = m.config.pad_token_id
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, VOCAB, (n,), generator=g) for n in (6, 9)]
    ids, mask = pad_rows(rows, "right", pad_id=pad_id)
    real = mask.bool()
    with torch.no_grad():
        own = m(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = m(input_ids=ids, attention_mask=mask, position_ids=P.position_ids(m, mask)).last_hidden_state
        m_ = mask.to(torch.long)
        counted = (m_.cumsum(-1) - 1).clamp_min(0)
        other = (counted + PAD + 1) * m_ + PAD * (1 - m_) if kind == "mask" else counted * m_
        wrong = m(input_ids=ids, attention_mask=mask, position_ids=other).last_hidden_state
    torch.testing.assert_close(ours[real], own[real], atol=1e-9, rtol=1e-9)
    assert (wrong[real] - own[real]).abs().max() > 1e-3


def test_mapped_roberta_family_still_right():
    for arch in ("roberta", "xlm-roberta", "camembert"):
        m = tiny_causal_lm(arch, dtype=torch.float64)
        assert P.convention(m) == ("padding_idx", m.config.pad_token_id)
        rows = _rows(6)
        ids, mask = pad_rows(rows, "left", pad_id=m.config.pad_token_id)
        r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=7, rules=PLAIN)
        for i, row in enumerate(rows):
            with torch.no_grad():
                want = m(input_ids=row[None]).logits[0, -1, 7].double()
            torch.testing.assert_close(r.target[i], want, atol=1e-9, rtol=1e-9)


def test_the_probe_fires_no_caller_hook_and_is_cached():
    m = _mpnet()
    calls = []
    h = m.get_input_embeddings().register_forward_hook(lambda *a: calls.append(1))
    try:
        B._OBSERVED.pop(m, None)
        assert B.observed_positions(m) == ("padding_idx", PAD)
        assert calls == []  # a caller's tap (a once-only replacement) is not spent on the probe
        assert m in B._OBSERVED
    finally:
        h.remove()


def test_source_fallback_knows_the_module_level_helper():
    """Where the embeddings cannot be probed, their source decides: MPNet and ESM call
    ``create_position_ids_from_input_ids`` as a module-level function."""
    for build in (_mpnet, _esm):
        assert B.padding_idx_embeddings(build()) is not None
    assert B.padding_idx_embeddings(tiny_causal_lm("bert")) is None


def test_embeddings_that_cannot_be_probed_fall_back_on_the_source(monkeypatch):
    m = _mpnet()
    B._OBSERVED.pop(m, None)

    def broken(*a, **k):
        raise RuntimeError("needs other inputs")

    monkeypatch.setattr(m.mpnet.embeddings, "forward", broken)
    assert B.observed_positions(m) is None
    assert P.convention(m) == ("padding_idx", PAD)


# --------------------------------------------------------------------------- b) the pooled position


CLASSIFIERS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "phi3", "mixtral",
               "qwen2_moe", "qwen3_moe", "gpt2", "gpt_neox", "phi")
EOS = 2


def _classifier(arch, attn="eager"):
    """A sequence classifier with the standard recipe: pad token = eos."""
    cfg = _cfg(arch, attn)
    cfg.num_labels = 3
    cfg.eos_token_id = EOS
    cfg.pad_token_id = EOS
    torch.manual_seed(0)
    moe = {"experts_implementation": "batched_mm"} if "moe" in arch or arch == "mixtral" else {}  # float64 kernels
    return T.AutoModelForSequenceClassification.from_config(cfg, **moe).double().eval()


def _pooled_oracle(model, ids, mask, pos, pooled_at, label):
    """transformers' base model and score head on ``ids``, read at ``pooled_at`` (the
    position transformers pooled from on the unperturbed ids)."""
    with torch.no_grad():
        h = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        return model.score(h)[torch.arange(ids.shape[0]), pooled_at, label].double()


@pytest.mark.parametrize("arch", CLASSIFIERS)
def test_pad_perturbation_keeps_the_pooled_position(arch):
    m = _classifier(arch)
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in (6, 4)]
    ids, mask = pad_rows(rows, "right", pad_id=EOS)
    pooled_at = mask.sum(1) - 1  # transformers: the last token that is not the pad token
    with torch.no_grad():  # the rule the oracle assumes, checked on transformers' own forward
        whole = m(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(whole[:, 1].double(), _pooled_oracle(m, ids, mask, None, pooled_at, 1))
    rel = torch.tensor([[0.1, 0.5, -0.2, 0.3, 0.0, 2.0], [0.4, -1.0, 0.2, 3.0, 0.0, 0.0]], dtype=torch.float64)
    inputs = {"input_ids": ids, "attention_mask": mask}
    for order in ("morf", "lerf", "insertion"):
        curve = E.perturbation_curve(m, inputs, rel, Logit(1), order=order, perturbation="pad", steps=2)
        levels = perturbed_masks(rel, mask.bool(), order, 2)
        for j in range(3):
            want = _pooled_oracle(m, ids.masked_fill(levels[:, j], EOS), mask, None, pooled_at, 1)
            torch.testing.assert_close(curve.values[:, j], want, atol=1e-9, rtol=1e-9)


def test_mask_perturbation_with_the_pad_id_and_left_padding_keep_the_pooled_position():
    m = _classifier("llama", "sdpa")  # eager float64 left padding gives NaN in transformers itself
    g = torch.Generator().manual_seed(8)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in (6, 3)]
    ids, mask = pad_rows(rows, "left", pad_id=EOS)
    pos = (mask.cumsum(-1) - 1).clamp_min(0) * mask  # each row's own positions, as alone
    pooled_at = torch.full((2,), ids.shape[1] - 1)
    rel = torch.randn(ids.shape, generator=g, dtype=torch.float64)
    inputs = {"input_ids": ids, "attention_mask": mask}
    morf = E.perturbation_curve(m, inputs, rel, Logit(0), order="morf", perturbation="mask", token_id=EOS, steps=3)
    zero = E.perturbation_curve(m, inputs, rel, Logit(0), order="morf", steps=3)  # ids unchanged: the same pooling
    levels = perturbed_masks(rel, mask.bool(), "morf", 3)
    moved = []
    for j in range(4):
        want = _pooled_oracle(m, ids.masked_fill(levels[:, j], EOS), mask, pos, pooled_at, 0)
        torch.testing.assert_close(morf.values[:, j], want, atol=1e-9, rtol=1e-9)
        with torch.no_grad():  # transformers left alone pools at the last token it still finds
            own = m(input_ids=ids.masked_fill(levels[:, j], EOS), attention_mask=mask, position_ids=pos).logits
        moved.append((own[:, 0].double() - want).abs().max())
    assert max(moved) > 1e-3  # some level replaced the last real token: the pooled position would have moved
    torch.testing.assert_close(zero.values[:, 0], morf.values[:, 0], atol=0, rtol=0)


def test_a_target_reading_the_head_reads_what_it_computed():
    """The kept position replaces the head's output downstream only: a target on the head
    itself reads its own per-position output on the perturbed ids."""
    m = _classifier("llama")
    ids = torch.tensor([[5, 9, 14, 3, 22, 7], [11, 4, 4, 30, 12, 17]])
    rel = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 5.0], [0.0, 0.1, 0.2, 0.3, 0.4, 5.0]], dtype=torch.float64)
    target = ModuleOutput("score", select=(2, 1))
    curve = E.perturbation_curve(m, ids, rel, target, order="morf", perturbation="pad", steps=3)
    levels = perturbed_masks(rel, torch.ones_like(ids, dtype=torch.bool), "morf", 3)
    for j in range(4):
        with torch.no_grad():
            want = m.score(m.base_model(input_ids=ids.masked_fill(levels[:, j], EOS)).last_hidden_state)[:, 2, 1]
        torch.testing.assert_close(curve.values[:, j], want.double(), atol=1e-9, rtol=1e-9)


# --------------------------------------------------------------------------- c) the mean embedding


IDS = torch.tensor([[5, 9, 14, 3, 22, 7], [11, 4, 4, 30, 12, 17]])


def _module_mean(emb):
    """The mean of what the embedding module outputs over its whole table (float64)."""
    with torch.no_grad():
        return emb(torch.arange(emb.num_embeddings)[None])[0].double().mean(0)


@pytest.mark.parametrize("arch", TEXT_ARCHS)
def test_mean_embedding_is_the_mean_of_the_module_output(arch):
    m = tiny_causal_lm(arch, dtype=torch.float64)
    if "moe" in arch or arch == "mixtral":
        m.set_experts_implementation("batched_mm")  # CPU grouped_mm has no float64 kernel
    emb = m.get_input_embeddings()
    mean = _module_mean(emb)
    if arch.startswith("gemma"):  # the module scales by √hidden: the weight's mean is not what it outputs
        assert (mean - emb.weight.double().mean(0)).abs().max() > 1e-3
    with torch.no_grad():  # inputs_embeds enters where the module's output does (no second scale)
        torch.testing.assert_close(m(inputs_embeds=emb(IDS)).logits, m(input_ids=IDS).logits)
    rel = torch.randn(IDS.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    curve = E.perturbation_curve(m, IDS, rel, Logit(7), order="morf", perturbation="mean_embedding", steps=3)
    levels = perturbed_masks(rel, torch.ones_like(IDS, dtype=torch.bool), "morf", 3)
    for j in range(4):
        with torch.no_grad():
            e = torch.where(levels[:, j, :, None], mean, emb(IDS))
            want = m(inputs_embeds=e).logits[:, -1, 7].double()
        torch.testing.assert_close(curve.values[:, j], want, atol=1e-9, rtol=1e-9)


def test_mean_embedding_chunks_do_not_change_the_mean(monkeypatch):
    m = tiny_causal_lm("gemma", dtype=torch.float64)
    whole = PT._vocabulary_mean(m)
    monkeypatch.setattr(PT, "_MEAN_CHUNK", 7)  # 96 ids: 14 chunks, the last one short
    torch.testing.assert_close(PT._vocabulary_mean(m), whole, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(whole, _module_mean(m.get_input_embeddings()), atol=1e-12, rtol=1e-12)


def _vision(kind):
    torch.manual_seed(0)
    if kind == "vit":
        cfg = T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                          num_hidden_layers=2, num_labels=5, initializer_range=0.2)
        return T.ViTForImageClassification(cfg).double().eval(), lambda out: out.logits[:, 2]
    cfg = T.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                             num_hidden_layers=2, initializer_range=0.2)
    w = torch.randn(32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return T.CLIPVisionModel(cfg).double().eval(), lambda out: out.pooler_output @ w


@pytest.mark.parametrize("kind", ["vit", "clip"])
def test_mean_embedding_of_an_image_is_its_mean_patch_embedding(kind):
    m, target = _vision(kind)
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rel = torch.randn(2, 17, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rel[:, 0] = 100.0  # [CLS] ranked first: never perturbed all the same
    curve = E.perturbation_curve(m, {"pixel_values": px}, rel, target, order="morf", perturbation="mean_embedding",
                                 steps=4)
    patches = torch.ones(2, 17, dtype=torch.bool)
    patches[:, 0] = False
    levels = perturbed_masks(rel, patches, "morf", 4)
    pe = m.get_input_embeddings()
    with torch.no_grad():
        own = pe(px)  # ViT: (batch, 16, hidden); CLIP's Conv2d: (batch, hidden, 4, 4)
    for j in range(5):
        if own.dim() == 3:
            hand = torch.where(levels[:, j, 1:, None], own.mean(1, keepdim=True), own)
        else:
            grid = levels[:, j, 1:].reshape(2, 1, 4, 4)
            hand = torch.where(grid, own.mean((-2, -1), keepdim=True), own)
        h = pe.register_forward_hook(lambda mod, a, o: hand)
        try:
            with torch.no_grad():
                want = target(m(pixel_values=px)).double()
        finally:
            h.remove()
        torch.testing.assert_close(curve.values[:, j], want, atol=1e-9, rtol=1e-9)
    assert (curve.values[:, 4] - curve.values[:, 0]).abs().max() > 1e-6  # the patches were perturbed


# --------------------------------------------------------------------------- d) pooled inside the model, from the ids
#
# CLIP's text tower pools inside its own forward: its pooler_output is the row of its
# last_hidden_state at the first end-of-text token (eos_token_id), or, with the legacy
# eos_token_id == 2 configs, at argmax(input_ids) (the end-of-text token is the highest id).
# A "pad" / "mask" perturbation or a "pad" baseline that replaces that token would move it.
# The oracle runs transformers' own tower on the replaced ids and reads its last_hidden_state
# at the position transformers pooled the original ids from, then its own projection.

EOT = VOCAB - 1  # the end-of-text token: the highest id, as in CLIP's vocabulary


def _clip_text(cls_name, legacy):
    """A tiny float64 CLIP text tower; ``legacy``: eos_token_id = 2 (pools at argmax(ids)),
    pad id 1; else eos = pad = the end-of-text token (the checkpoints' recipe)."""
    ids = dict(eos_token_id=2, pad_token_id=1, bos_token_id=0) if legacy else dict(
        eos_token_id=EOT, pad_token_id=EOT, bos_token_id=EOT - 1)
    cfg = T.CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                           num_hidden_layers=2, max_position_embeddings=32, initializer_range=0.2, projection_dim=16,
                           **ids)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(T, cls_name)(cfg).double().eval()


def _clip_batch(seed):
    """Two rows <bos> tokens <eot>, right-padded with <eot> (CLIP's tokenizer pads with it)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.cat([torch.tensor([EOT - 1]), torch.randint(3, EOT - 2, (n,), generator=g), torch.tensor([EOT])])
            for n in (3, 6)]
    return pad_rows(rows, "right", pad_id=EOT)


def _clip_pooled_at(model, ids):
    """Where transformers' tower pools each row of ``ids``, by its own rule (the first
    eos_token_id, or argmax(ids) with eos_token_id == 2), checked against its pooler_output."""
    eos = model.config.eos_token_id
    at = ids.argmax(-1) if eos == 2 else (ids == eos).int().argmax(-1)
    tower = getattr(model, "text_model", model)
    with torch.no_grad():
        out = tower(input_ids=ids)
    torch.testing.assert_close(out.pooler_output, out.last_hidden_state[torch.arange(ids.shape[0]), at],
                               atol=0, rtol=0)
    return at


def _clip_oracle(model, ids, mask, at, w):
    """transformers' tower on ``ids``, its last_hidden_state read at ``at``, its projection
    (CLIPTextModelWithProjection), dotted with ``w``."""
    tower = getattr(model, "text_model", model)
    with torch.no_grad():
        h = tower(input_ids=ids, attention_mask=mask).last_hidden_state[torch.arange(ids.shape[0]), at]
        if hasattr(model, "text_projection"):
            h = model.text_projection(h)
    return (h @ w).double()


def _clip_target(model):
    w = torch.randn(16 if hasattr(model, "text_projection") else 32, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    if hasattr(model, "text_projection"):
        return w, lambda out: out.text_embeds @ w
    return w, lambda out: out.pooler_output @ w


CLIP_CASES = [(c, legacy) for c in ("CLIPTextModel", "CLIPTextModelWithProjection") for legacy in (False, True)]


@pytest.mark.parametrize("cls_name,legacy", CLIP_CASES)
@pytest.mark.parametrize("perturbation", ["pad", "mask"])
def test_clip_text_perturbation_keeps_the_end_of_text_position(cls_name, legacy, perturbation):
    m = _clip_text(cls_name, legacy)
    ids, mask = _clip_batch(11)
    at = _clip_pooled_at(m, ids)
    # "mask": an id above every real token, so under argmax pooling it would draw the pool to itself
    token = EOT if perturbation == "mask" else None
    replaced = m.config.pad_token_id if token is None else token
    w, target = _clip_target(m)
    g = torch.Generator().manual_seed(3)
    rel = torch.randn(ids.shape, generator=g, dtype=torch.float64)
    rel[torch.arange(2), at] = 10.0  # the end-of-text token ranked first: replaced at the first level
    inputs = {"input_ids": ids, "attention_mask": mask}
    moved = []
    for order in ("morf", "lerf", "insertion"):
        curve = E.perturbation_curve(m, inputs, rel, target, order=order, perturbation=perturbation, token_id=token,
                                     steps=3)
        levels = perturbed_masks(rel, mask.bool(), order, 3)
        for j in range(4):
            perturbed = ids.masked_fill(levels[:, j], replaced)
            want = _clip_oracle(m, perturbed, mask, at, w)
            torch.testing.assert_close(curve.values[:, j], want, atol=1e-9, rtol=1e-9)
            with torch.no_grad():  # transformers left alone pools where it finds the token now
                moved.append((target(m(input_ids=perturbed, attention_mask=mask)).double() - want).abs().max())
    assert max(moved) > 1e-3  # some level moved transformers' own pooled position: the kept one matters


@pytest.mark.parametrize("cls_name,legacy", CLIP_CASES)
def test_clip_text_pad_baseline_is_read_at_the_inputs_end_of_text_position(cls_name, legacy):
    m = _clip_text(cls_name, legacy)
    ids, mask = _clip_batch(12)
    at = _clip_pooled_at(m, ids)
    w, target = _clip_target(m)
    base_ids = torch.full_like(ids, m.config.pad_token_id)
    want = _clip_oracle(m, base_ids, mask, at, w)
    with torch.no_grad():  # transformers alone pools the all-pad row at position 0
        own = target(m(input_ids=base_ids, attention_mask=mask)).double()
    assert (own - want).abs().max() > 1e-3
    inputs = {"input_ids": ids, "attention_mask": mask}
    r = pyattr.relevance(m, inputs, target=target, rules=PLAIN, baseline="pad")
    torch.testing.assert_close(r.baseline_target, want, atol=1e-9, rtol=1e-9)
    ig = pyattr.integrated_gradients(m, inputs, target=target, baseline="pad", n_steps=32)
    torch.testing.assert_close(ig.baseline_target, want, atol=1e-9, rtol=1e-9)
    # every point of the path pools at the input's position, f(x₀) too: the path's integral closes
    assert (ig.convergence_delta.abs() <= 1e-5 * (ig.target - want).abs()).all(), ig.convergence_delta
    layer = ("text_model." if hasattr(m, "text_projection") else "") + "encoder.layers.1"
    lr = pyattr.layer_relevance(m, inputs, [layer], target=target, rules=PLAIN, baseline="pad")
    torch.testing.assert_close(lr.baseline_target, want, atol=1e-9, rtol=1e-9)


def test_clip_text_unobservable_pooling_is_refused():
    """With return_dict=False the tower returns a tuple: no pooler_output to observe where it
    pooled, and its forward pools at a token it finds in the ids: "pad" / "mask" refused,
    naming the perturbation; "zero_embedding" leaves the ids, and the pooled position, as
    they are."""
    m = _clip_text("CLIPTextModel", False)
    ids, mask = _clip_batch(13)
    w = torch.randn(32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    inputs = {"input_ids": ids, "attention_mask": mask, "return_dict": False}
    rel = torch.randn(ids.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"perturbation='pad' replaces token ids, and CLIPTextModel pools its output "
                                         r"at a token it finds in the ids.*cannot be observed"):
        E.perturbation_curve(m, inputs, rel, lambda out: out[1] @ w, perturbation="pad", steps=2)
    with pytest.raises(ValueError, match=r"baseline='pad' replaces token ids, and CLIPTextModel pools"):
        pyattr.relevance(m, inputs, target=lambda out: out[1] @ w, rules=PLAIN, baseline="pad")
    curve = E.perturbation_curve(m, inputs, rel, lambda out: out[1] @ w, steps=2)
    with torch.no_grad():
        own = (m(input_ids=ids, attention_mask=mask).pooler_output @ w).double()
    torch.testing.assert_close(curve.values[:, 0], own, atol=1e-9, rtol=1e-9)


# --------------------------------------------------------------------------- e) "pad" baselines of sequence classifiers


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_pad_baseline_of_a_sequence_classifier_is_read_at_the_inputs_pooled_position(arch):
    """pad = eos: the all-pad baseline has no non-pad token, so transformers reads it at
    position 0; GPT-2's learned absolute positions make its states there another vector than
    at the input's last real token, where every point of a path from it pools. pyattr reads
    f(baseline) there."""
    m = _classifier(arch)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # a trained pad row (Llama's padding_idx row starts at 0: an ill-conditioned baseline)
        emb = m.get_input_embeddings().weight
        emb[EOS] = 0.2 * torch.randn(emb.shape[1], generator=g, dtype=emb.dtype)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in (6, 4)]
    ids, mask = pad_rows(rows, "right", pad_id=EOS)
    pooled_at = mask.sum(1) - 1
    base_ids = torch.full_like(ids, EOS)
    want = _pooled_oracle(m, base_ids, mask, None, pooled_at, 1)
    with torch.no_grad():
        own = m(input_ids=base_ids, attention_mask=mask).logits[:, 1].double()
    if arch == "gpt2":
        assert (own - want).abs().max() > 1e-3  # position 0 is another function of the pad token
    else:  # rotary positions only: every position of an all-pad row holds the same states (up to the
        # float32 softmax of transformers' eager attention)
        torch.testing.assert_close(own, want, atol=1e-6, rtol=1e-6)
    inputs = {"input_ids": ids, "attention_mask": mask}
    r = pyattr.relevance(m, inputs, target=1, rules=PLAIN, baseline="pad")
    torch.testing.assert_close(r.baseline_target, want, atol=1e-9, rtol=1e-9)
    ig = pyattr.integrated_gradients(m, inputs, target=1, baseline="pad", n_steps=32)
    torch.testing.assert_close(ig.baseline_target, want, atol=1e-9, rtol=1e-9)
    assert (ig.convergence_delta.abs() <= 1e-4 * (ig.target - want).abs()).all(), ig.convergence_delta
    for i, row in enumerate(rows):  # the padded row gives what the row alone gives
        alone = pyattr.relevance(m, row[None], target=1, rules=PLAIN, baseline="pad")
        torch.testing.assert_close(r.baseline_target[i], alone.baseline_target[0], atol=1e-9, rtol=1e-9)


def test_pad_baseline_of_a_left_padded_classifier_is_still_refused():
    m = _classifier("gpt2")
    ids, mask = pad_rows([[5, 6, 7], [5, 6, 7, 8, 9]], "left", pad_id=EOS)
    with pytest.raises(ValueError, match=r"baseline: 'pad' on a batch that pads row 0 on the left"):
        pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=1, rules=PLAIN, baseline="pad")


def test_gpt2_left_padded_pad_perturbation_keeps_the_pooled_position():
    """Learned absolute positions and left padding: each level pools at the last column
    (the input's last real token), at the row's own positions."""
    m = _classifier("gpt2")
    g = torch.Generator().manual_seed(10)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in (6, 3)]
    ids, mask = pad_rows(rows, "left", pad_id=EOS)
    pos = (mask.cumsum(-1) - 1).clamp_min(0) * mask
    pooled_at = torch.full((2,), ids.shape[1] - 1)
    rel = torch.randn(ids.shape, generator=g, dtype=torch.float64)
    rel[:, -1] = 10.0  # the pooled token first
    curve = E.perturbation_curve(m, {"input_ids": ids, "attention_mask": mask}, rel, Logit(2), order="morf",
                                 perturbation="pad", steps=3)
    levels = perturbed_masks(rel, mask.bool(), "morf", 3)
    for j in range(4):
        want = _pooled_oracle(m, ids.masked_fill(levels[:, j], EOS), mask, pos, pooled_at, 2)
        torch.testing.assert_close(curve.values[:, j], want, atol=1e-9, rtol=1e-9)
    for i, row in enumerate(rows):  # the padded row gives what the row alone gives
        alone = E.perturbation_curve(m, row[None], rel[i:i + 1, mask[i].bool()], Logit(2), order="morf",
                                     perturbation="pad", steps=3)
        torch.testing.assert_close(curve.values[i], alone.values[0], atol=1e-9, rtol=1e-9)
