"""Structural discovery: the :class:`Arch` entry of a model the table does not map, read off
its module graph (the opt-in ``generic=True``), so that every method reads the same kind of
entry for it as for a mapped model.

What it finds, relative to the base model as in the table (the blocks' roles relative to
a block):

- ``layers``: the one ``nn.ModuleList`` of blocks with an attention module;
- per block: the attention module (q/k/v projections ``q_proj``/``k_proj``/``v_proj``,
  ``query``/``key``/``value`` or ``q_lin``/``k_lin``/``v_lin``), its output projection
  (``heads``), the attention contribution (``attention_out``: the attention module when the
  projection is inside it, else the projection, as BERT's post-norm), the module returning
  the attention probabilities (``attention_core``), q/k norms inside it; the MLP (a sparse
  mixture-of-experts block, a fused or plain gated forward under any attribute names, or an
  activation module), its contribution (``mlp_out``) and hidden units (``neurons``); the
  residual-stream norms (by class, kind and offset probed by what they compute);
- outside the blocks: outer norms (an outer norm registered before the blocks is the
  embedding norm and the ``entry``; else the first block's input), head and pooler norms
  and activations, the position-id convention (observed: the model's embeddings run on
  probe ids holding a pad token, :func:`~pyattr.architectures.position_probe.observed_positions`).

Every role it cannot find is left None and declared in ``Arch.refusals`` with the reason
(a fused q/k/v projection whose split cannot be read from the graph, an MoE block whose
routing needs the library's form, several stacks of blocks, …); a method that needs it
refuses with that reason instead of guessing. Roles only the rule planner reads
(``head_forward``, ``unruled_heads``) are not looked for: ``generic=True`` rule installation
keeps its own structural planning (:mod:`pyattr.integration.generic`), on the same finders.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import nn

from pyattr.architectures.blocks import (  # noqa: F401 - the finders, also read from here
    ACT_CLASS,
    ACT_NAMES,
    BLOCK_ROLES,
    _hidden,
    _layers,
    _merge,
    _spans,
    _under,
    fused_gated_form,
    fused_qkv,
    generic_gated_names,
    is_activation_like,
    is_norm_like,
    multiplies,
    plain_layer_norm,
    qkv_names,
)
from pyattr.architectures.forms import classify_norm
from pyattr.architectures.position_probe import observed_positions, padding_idx_embeddings
from pyattr.architectures.paths import base_prefix, get_submodule, input_embeddings, join, model_type
from pyattr.architectures.seq2seq import one_stack
from pyattr.architectures.table import ARCHITECTURES, Arch


# --------------------------------------------------------------------------- the entry


def _paths(role: str, value) -> Tuple[str, ...]:
    """The block-relative module paths a block role names."""
    if role in ("layer_norms", "qk_norms"):
        return tuple(value)
    if role in ("attention", "mlp"):
        return tuple(value[1:])
    if role == "neurons":
        return (value[0],)
    return (value,) if isinstance(value, str) else ()


def _norm_kind(mod: nn.Module, hidden: Optional[int]) -> Optional[Tuple[str, float]]:
    if plain_layer_norm(mod):
        return "layer_norm", 0.0
    got = classify_norm(mod, hidden) if isinstance(hidden, int) else None
    return None if got is None else (got[0], float(got[1][1]))


def _entry(model: nn.Module, base: nn.Module, outer: List[str], layers: str) -> Tuple[str, str]:
    """Where the residual stream enters the blocks: the embedding norm's input (an outer
    norm registered before the blocks, beside the input embeddings or named as an
    embedding / pre-blocks norm: BERT's ``embeddings.LayerNorm``, CLIP's ``pre_layrnorm``),
    else the first block's input. OPT registers its final norm before its blocks: not one."""
    order = {n: i for i, (n, _) in enumerate(base.named_modules())}
    emb = input_embeddings(model)
    emb_path = next((n for n, m in base.named_modules() if emb is not None and m is emb), None)
    home = emb_path.rsplit(".", 1)[0] if emb_path and "." in emb_path else None
    if home is not None and _under(layers, [home]):
        home = None
    for n in outer:
        leaf = n.rsplit(".", 1)[-1].lower()
        if order[n] < order[layers] and (_under(n, [home]) or "emb" in n.lower() or leaf.startswith("pre")):
            return n, "input"
    return join(layers, "0"), "hidden_states"


STREAM_KEYS = ("hc_mult", "hc_count", "num_residual_streams", "num_hyper_connections")


def _streams(model: nn.Module) -> Optional[str]:
    """Why the residual stream is not one tensor (batch, position, hidden), or None: a config
    declaring several streams (hyper-connections: DeepSeek-V4's and GLM-5's ``hc_mult``,
    Qwen4's ``hc_count``), whose blocks carry hidden states (batch, position, n, hidden)."""
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        for k in STREAM_KEYS:
            n = getattr(c, k, None) if c is not None else None
            if isinstance(n, int) and not isinstance(n, bool) and n > 1:
                return (f"several residual streams: config.{k} = {n} (hyper-connections), so the blocks carry hidden "
                        f"states shaped (batch, position, {n}, hidden), mixed by learned weights, and relevance per "
                        "token (one residual stream per position) cannot be read off them")
    return None


def _vision(model: nn.Module, base: nn.Module) -> Tuple[bool, Optional[str]]:
    """A vision transformer (a ``patch_size`` in its config, a Conv2d patch embedding and
    a [CLS] token, which the patch layout puts first); or why not, when it has patches."""
    cfg = getattr(model, "config", None)
    p = getattr(getattr(cfg, "vision_config", None) or cfg, "patch_size", None)
    if p is None:
        return False, None
    if not any(isinstance(m, nn.Conv2d) for m in base.modules()):
        return False, f"config.patch_size is {p}, but there is no nn.Conv2d patch embedding"
    if not any(n.rsplit(".", 1)[-1] in ("cls_token", "class_embedding") for n, _ in base.named_parameters()):
        return False, ("no [CLS] token parameter (cls_token, class_embedding): the patch layout of image inputs "
                       "([CLS] first, then the patches row by row) cannot be assumed")
    return True, None


def discover(model: nn.Module) -> Arch:
    """The :class:`Arch` entry of ``model`` read off its module graph (see the module
    docstring); roles it cannot find are None, each declared in ``refusals`` with why."""
    prefix = base_prefix(model)
    base = get_submodule(model, prefix)
    hidden = _hidden(model)
    found: Dict[str, object] = {}
    refused: Dict[str, str] = {}
    layers, why = _layers(base)
    probe: Dict[str, nn.Module] = {}
    if layers is None:
        refused["layers"] = why
        for role in BLOCK_ROLES + ("entry",):
            refused[role] = f"no blocks: {why}"
    else:
        ml = base.get_submodule(layers)
        f, r, probe = _merge([(join(layers, str(i)), b) for i, b in enumerate(ml)], hidden)
        found.update(f)
        refused.update(r)
        for role, v in f.items():  # every role path in every block
            missing = [(i, p) for p in _paths(role, v) for i, b in enumerate(ml)
                       if not isinstance(get_submodule(b, p), nn.Module)]
            if missing:
                refused[role] = f"{missing[0][1]!r} is not in every block (not in block {missing[0][0]})"
                found.pop(role)
    outer = [n for n, m in base.named_modules() if n and is_norm_like(m) and _spans(m, hidden)
             and not _under(n, [layers])] if layers is not None else []
    found["outer_norms"] = tuple(outer)
    streams = _streams(model)
    if streams is not None:
        refused["entry"] = streams
    elif layers is not None:
        found["entry"] = _entry(model, base, outer, layers)
    outside = [(n, m) for n, m in model.named_modules() if prefix and n and not _under(n, [prefix])]
    found["head_norms"] = tuple(n for n, m in outside if is_norm_like(m) and _spans(m, hidden))
    found["head_acts"] = tuple(n for n, m in outside if is_activation_like(n, m) and not list(m.children()))
    found["base_acts"] = tuple(n for n, m in base.named_modules() if layers is not None and n and not _under(n, [layers])
                               and is_activation_like(n, m) and not list(m.children()))
    probe.update({n: base.get_submodule(n) for n in outer})
    probe.update({n: model.get_submodule(n) for n in found["head_norms"]})
    kinds = {}
    for n, m in probe.items():
        kinds[n] = _norm_kind(m, hidden)
    bad = [n for n, k in kinds.items() if k is None]
    if bad:
        refused["norm"] = (f"{bad[0]!r} ({type(probe[bad[0]]).__name__}) is norm-like but computes no layer / RMS norm "
                           "over the hidden size that could be recognised")
    elif len(set(kinds.values())) > 1:
        refused["norm"] = "the norms are of several kinds: " + ", ".join(f"{n} {k}" for n, k in kinds.items())
    elif not kinds:
        refused["norm"] = f"no blocks: {why}" if layers is None else "no norm over the hidden size was found"
    else:
        found["norm"], found["offset"] = next(iter(kinds.values()))
    seen = observed_positions(model)
    found["positions"] = seen[0] if seen is not None else (
        "padding_idx" if padding_idx_embeddings(model) is not None else "mask")
    vision, why = _vision(model, base)
    if why:
        refused["vision"] = why
    found["vision"] = vision
    if (found.get("mlp") or (None,))[0] == "moe":
        refused["moe_block"] = ("the routing rule needs the library's sparse-block forward, known only for the mapped "
                                f"mixture-of-experts models {sorted(k for k, a in ARCHITECTURES.items() if a.moe_block)}")
    fields = {k: found.get(k) for k in ("layers", "norm", "layer_norms", "outer_norms", "mlp", "attention", "entry")}
    fields["layers"] = layers
    fields.update({k: v for k, v in found.items() if k not in fields})
    for k in ("layer_norms", "outer_norms", "qk_norms", "head_norms", "head_acts", "base_acts"):
        fields[k] = fields.get(k) or ()
    return Arch(**fields, refusals=tuple(refused.items()))


def arch_of(model: nn.Module, generic: bool = False) -> Optional[Arch]:
    """The entry every method reads: the table's for a mapped ``model_type``; for another,
    the discovered one when the caller opted in with ``generic=True``; else None. One
    stack of a mapped encoder–decoder type (BartForCausalLM) reads its decoder's entry."""
    entry = ARCHITECTURES.get(model_type(model)) or one_stack(model, model_type(model))
    if entry is None and generic:
        return discover(model)
    return entry


def require(arch: Arch, role: str, model: nn.Module, what: str) -> None:
    """Raise ValueError naming ``role`` and the reason when ``arch`` declares a refusal of it."""
    why = arch.refusal(role)
    if why is not None:
        raise ValueError(
            f"{what}: needs the {role!r} role, which structural discovery (generic=True) could not find on "
            f"{type(model).__name__} (model_type {model_type(model)!r}, not in the architecture table): {why}"
        )
