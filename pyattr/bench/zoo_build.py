"""Tiny models for the zoo (:mod:`pyattr.bench.zoo`): a config of each model type with its
sizes shrunk (hidden 32, 2 layers, 4 heads, vocabulary 128, 32×32 images), built in float64
with seed 0, eval mode, and the inputs it is explained at.

The sizes are read off the type's default config: every size attribute it has is
overridden by name (text sizes, heads, experts, state-space sizes, per-stage lists of
hierarchical vision models scaled down together), per-layer lists (``layer_types``) keep
one layer of each kind, special token ids outside the small vocabulary are moved inside
it, and sub-configs (``text_config``, ``vision_config``, …) are shrunk the same way. The
config is rebuilt from these keyword arguments so that what its ``__init__`` derives from
them (head sizes, layer patterns) stays consistent; where a key is not an argument it is
set as an attribute.
"""

from __future__ import annotations

from typing import Optional

import torch

HIDDEN = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim")
FFN = ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "d_inner", "feed_forward_size", "encoder_ffn_dim",
       "decoder_ffn_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
       "moe_shared_expert_intermediate_size", "expert_intermediate_size")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEADS = ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
FIXED = dict(
    head_dim=8, kv_channels=8, d_head=8, attention_head_dim=8, attention_head_size=8, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=16, kv_lora_rank=16, rotary_dim=4, embedding_rank=16,
    vocab_size=128, max_position_embeddings=64, n_positions=64, max_seq_len=64, max_sequence_length=64,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_topk=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
    state_size=8, ssm_state_size=8, mamba_d_state=8, d_state=8, time_step_rank=4, mamba_dt_rank=4,
    mamba_num_heads=8, mamba_head_dim=8, mamba_n_heads=8, mamba_d_head=8, n_mamba_heads=2, moe_k=2,
    num_experts_per_token=2, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, attention_hidden_size=64, intra_bottleneck_size=16,
    local_attention=4, sliding_window=4, block_size=4, coordinate_size=8, shape_size=8,
    attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
)
#: per-stage lists of hierarchical vision models, scaled so the first stage becomes this
STAGE_FIRST = dict(hidden_sizes=32, num_heads=1, num_attention_heads=1, embed_dims=16, base_attn_unit_dims=16,
                   key_dim=8, in_channels=16, out_channels=16, neck_hidden_sizes=16, num_channels_per_stage=16)
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
             "unk_token_id", "decoder_start_token_id", "eod_token_id")
VOCAB, IMAGE = 128, 32


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _layer_lists(d: dict, n_old: Optional[int]) -> tuple:
    """The layer count and the per-layer lists cut to one layer of each kind (at least 2)."""
    lists = {k: v for k, v in d.items() if isinstance(v, (list, tuple)) and n_old and len(v) == n_old and n_old > 2
             and k.endswith(("layer_types", "layers_block_type", "block_types", "attn_layers", "layer_type"))}
    keep = [0]
    for k, v in lists.items():
        for i, t in enumerate(v):
            if t not in [v[j] for j in keep] and len(keep) < 4:
                keep.append(i)
    keep = sorted(set(keep))
    if len(keep) < 2:
        keep = [0, 1]
    return len(keep), {k: [v[i] for i in keep] for k, v in lists.items()}


def overrides(d: dict) -> dict:
    """The keyword arguments that shrink a config whose ``to_dict()`` is ``d``."""
    out: dict = {}
    stages = isinstance(d.get("depths"), (list, tuple))
    for k in HIDDEN:
        if _int(d.get(k)) and not (k == "embed_dim" and stages):
            out[k] = 32
    if "dim" in d and _int(d.get("hidden_dim")):  # DistilBERT: hidden_dim is the FFN's size
        out["hidden_dim"] = 64
    if _int(d.get("embedding_size")):  # factorised embeddings (ALBERT) stay factorised
        hid = next((d[k] for k in HIDDEN if _int(d.get(k))), None)
        out["embedding_size"] = 32 if d["embedding_size"] == hid or "hidden_sizes" not in d and hid is None else 16
    for k in FFN:
        if _int(d.get(k)):
            out[k] = 64 if k in ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "d_inner", "feed_forward_size",
                                 "encoder_ffn_dim", "decoder_ffn_dim") else 32
    n_old = next((d[k] for k in LAYERS if _int(d.get(k))), None)
    n, lists = _layer_lists(d, n_old)
    out.update(lists)
    for k in LAYERS:
        if _int(d.get(k)) and not stages:
            out[k] = n
    for k in HEADS:
        if _int(d.get(k)):
            out[k] = 4
    if _int(d.get("num_heads")) and not stages:
        # Mamba-2's heads: 8 of 8 = 2 × hidden
        out["num_heads"] = 8 if any(k in d for k in ("state_size", "ssm_state_size")) else 4
    for k in KV_HEADS:
        if _int(d.get(k)) or (k in d and d[k] is None):
            out[k] = 4 if "kv_lora_rank" in d else 2  # multi-head latent attention: one key per head
    if "head_dim" in d and d["head_dim"] is None and "num_attention_heads" in d:
        out["head_dim"] = 8  # read as a number by some forwards (HunYuan)
    if isinstance(d.get("axial_pos_embds_dim"), (list, tuple)):  # Reformer: axial positions sum to hidden
        out.update(axial_pos_embds_dim=[16, 16], axial_pos_shape=[8, 8], local_attn_chunk_length=4,
                   lsh_attn_chunk_length=4, attention_head_size=8)
    for k, v in FIXED.items():
        if _int(d.get(k)) and d[k] > 0:
            out[k] = v
    if stages:
        out["depths"] = [1] * len(d["depths"])
        if _int(d.get("embed_dim")):
            out["embed_dim"] = 16
        if _int(d.get("embedding_size")):
            out["embedding_size"] = 32
        if _int(d.get("window_size")):
            out["window_size"] = 2  # Swin: a window that tiles every stage of a 64×64 image
        out["image_size"] = [64, 64] if isinstance(d.get("image_size"), (list, tuple)) else 64
        for k, first in STAGE_FIRST.items():
            v = d.get(k)
            if isinstance(v, (list, tuple)) and v and all(_int(x) and x > 0 for x in v):
                out[k] = [max(1, x * first // v[0]) for x in v]
    if _int(d.get("image_size")) and not stages:
        out["image_size"] = IMAGE
    if _int(d.get("patch_size")) and d["patch_size"] > 8:
        out["patch_size"] = 8
    for k, v in d.items():
        if isinstance(v, float) and ("dropout" in k or "pdrop" in k or k.startswith("drop_")):
            out[k] = 0.0
    _token_ids(d, out)
    return out


def _token_ids(d: dict, out: dict) -> None:
    vocab = out.get("vocab_size", d.get("vocab_size"))
    if not _int(vocab):
        if "vocab_size" in d:  # ESM: no default vocabulary
            out["vocab_size"] = vocab = VOCAB
        else:
            return
    for i, k in enumerate(TOKEN_IDS):
        v = d.get(k)
        if isinstance(v, (list, tuple)):
            out[k] = [x if _int(x) and x < vocab else 2 for x in v]
        elif (_int(v) and v >= vocab) or (v is None and k == "pad_token_id"):
            out[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(k, 3 + i)


def tiny_config(model_type: str, depth: int = 0):
    """The default config of ``model_type`` with its sizes shrunk (see the module docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return _shrink(CONFIG_MAPPING[model_type](), depth)


def _shrink(cfg, depth: int = 0):
    from transformers import PretrainedConfig

    d = cfg.to_dict()
    ov = overrides(d)
    subs = {}
    for k in list(d):
        sub = getattr(cfg, k, None)
        if isinstance(sub, PretrainedConfig) and depth < 2:
            subs[k] = _shrink(sub, depth + 1)
    kwargs = {**ov, **{k: s.to_dict() for k, s in subs.items()}}
    try:
        new = type(cfg)(**kwargs)
    except Exception:  # noqa: BLE001 - a config that does not take these as arguments
        new = None
    if new is None or any(_differs(getattr(new, k, None), v) for k, v in ov.items()):
        new = cfg if new is None else new
        for k, v in {**ov, **subs}.items():
            try:
                setattr(new, k, v)
            except (AttributeError, TypeError, ValueError):
                pass  # a derived property (Falcon's head_dim)
    for k, s in subs.items():
        if getattr(new, k, None) is not None and not isinstance(getattr(new, k), type(s)):
            setattr(new, k, s)
    return new


def _differs(have, want) -> bool:
    if isinstance(want, list):
        return list(have or []) != want
    return have != want


#: the sizes of the zoo's first version, set as attributes on the default config: the
#: fallback where the keyword-argument config does not build or run
PLAIN = dict(hidden_size=32, d_model=32, n_embd=32, embed_dim=32, dim=32, num_hidden_layers=2, n_layer=2,
             num_layers=2, n_layers=2, num_attention_heads=4, n_head=4, n_heads=4, num_heads=4,
             num_key_value_heads=2, intermediate_size=64, ffn_dim=64, n_inner=64, hidden_dim=64, d_ff=64,
             vocab_size=128, max_position_embeddings=128, n_positions=128, head_dim=8, image_size=32, patch_size=8)


def plain_config(model_type: str, depth: int = 0, cfg=None):
    """The default config with :data:`PLAIN`'s sizes set as attributes (the fallback)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]() if cfg is None else cfg
    for k, v in PLAIN.items():
        if _int(getattr(cfg, k, None)):
            try:
                setattr(cfg, k, v)
            except (AttributeError, TypeError, ValueError):
                pass
    lt = getattr(cfg, "layer_types", None)
    if isinstance(lt, (list, tuple)) and lt:
        n = next((getattr(cfg, k) for k in LAYERS if _int(getattr(cfg, k, None))), 2)
        cfg.layer_types = list(lt)[:n]
    if getattr(cfg, "pad_token_id", None) is None and _int(getattr(cfg, "vocab_size", None)):
        cfg.pad_token_id = 0
    for k in ("text_config", "vision_config"):
        sub = getattr(cfg, k, None)
        if sub is not None and depth < 2 and hasattr(sub, "to_dict"):
            plain_config(None, depth + 1, sub)
    return cfg


def _for_class(cfg, cls):
    """The config ``cls`` takes: ``cfg``, or its sub-config of ``cls.config_class`` (a
    causal-LM class of a multimodal type takes the text config)."""
    want = getattr(cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return cfg
    for k in cfg.to_dict():
        sub = getattr(cfg, k, None)
        if isinstance(sub, want):
            return sub
    return cfg


def build(mapping: str, model_type: str, cls_name: str, seq: int = 7):
    """``(model, x)``: the tiny float64 model in eval mode (seed 0, weights drawn by
    :func:`scale`, biases as they are) and the row it is explained at. The shrunk config
    (:func:`tiny_config`) is tried first, then :func:`plain_config`; the first whose
    model builds and runs a plain forward is taken, else the first error is raised."""
    import transformers as T
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = getattr(T, cls_name)
    first = None
    for make in (tiny_config, plain_config):
        try:
            model = _make(mapping, cls, _for_class(make(model_type), cls))
            x = inputs(model, mapping, seq)
            with torch.no_grad():
                model(x, **({"use_cache": False} if _takes(model, "use_cache") else {}))
            return model, x
        except Exception as e:  # noqa: BLE001 - anything that stops the build or the forward
            first = first or e
    raise first


def _takes(model, name: str) -> bool:
    import inspect

    return name in inspect.signature(model.forward).parameters


def _make(mapping: str, cls, cfg):
    if mapping in ("sequence_classification", "image_classification"):
        cfg.num_labels = 3
    if mapping == "causal_lm" and hasattr(cfg, "is_decoder"):
        cfg.is_decoder = True  # BertLMHeadModel and kin are decoders only so
    # grouped_mm has no float64 kernel; eager computes act(gate)·up inline, where no rule reaches
    cfg._experts_implementation = "batched_mm"
    if getattr(cfg, "is_encoder_decoder", False) and getattr(cfg, "decoder_start_token_id", None) is None:
        cfg.decoder_start_token_id = cfg.pad_token_id  # T5's checkpoints start the decoder at the pad token
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float64).eval()
    if hasattr(model, "set_default_language"):  # X-MOD
        langs = getattr(cfg, "languages", None) or ["en_XX"]
        model.set_default_language(getattr(cfg, "default_language", None) or next(iter(langs)))
    scale(model)
    return model


def scale(model, std: float = 0.2, seed: int = 0) -> None:
    """Weights drawn so every nonlinearity leaves its linear regime: each weight matrix
    rescaled to standard deviation ``std`` (its structure kept), and 1-d parameters at
    their constant init (norm weights, biases) moved off it by N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    seen = set()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            if p.dim() >= 2:
                s = float(p.std())
                if 0 < s < std:
                    p.mul_(std / s)
            elif p.dim() == 1 and p.numel() > 1 and bool((p == p[0]).all()):
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def zero_biases(model) -> None:
    """Every bias (a parameter whose name ends in ``bias``) and BatchNorm's running mean set
    to 0: with every nonlinearity under its rule, Σ relevance then equals the target."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.rsplit(".", 1)[-1].endswith("bias"):
                p.zero_()
        for n, b in model.named_buffers():
            if n.endswith("running_mean"):
                b.zero_()


def special_ids(cfg, depth: int = 0) -> set:
    """Every token id the config names (``*_token_id``, ``*_token_index``), sub-configs included."""
    from transformers import PretrainedConfig

    out = set()
    for k, v in cfg.to_dict().items():
        if k.endswith(("token_id", "token_index", "token_ids")):
            out.update(x for x in (v if isinstance(v, (list, tuple)) else [v]) if _int(x))
    for k in cfg.to_dict():
        sub = getattr(cfg, k, None)
        if isinstance(sub, PretrainedConfig) and depth < 2:
            out |= special_ids(sub, depth + 1)
    return out


def inputs(model, mapping: str, seq: int, seed: int = 1) -> torch.Tensor:
    """One row: token ids of length ``seq`` (no special ids), or one image for a model whose
    main input is ``pixel_values``."""
    g = torch.Generator().manual_seed(seed)
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values" or (mapping == "image_classification" and main != "input_ids"):
        cfg = getattr(model.config, "vision_config", None) or model.config
        size = getattr(cfg, "image_size", IMAGE)
        size = (size, size) if _int(size) else tuple(size)[-2:]
        return torch.randn(1, getattr(cfg, "num_channels", 3), *size, generator=g, dtype=torch.float64)
    cfg = getattr(model.config, "text_config", None) or model.config
    vocab = min(int(getattr(cfg, "vocab_size", None) or VOCAB), VOCAB)
    allowed = [i for i in range(3, vocab) if i not in special_ids(model.config)]
    pick = torch.randint(0, len(allowed), (1, seq), generator=g)
    x = torch.tensor(allowed)[pick]
    eos = getattr(model.config, "eos_token_id", None)
    if mapping == "sequence_classification" and getattr(model.config, "is_encoder_decoder", False) and _int(eos):
        x[0, -1] = eos  # the encoder–decoder classifiers pool the hidden state at the end-of-text token
    return x
