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
  and activations, the position-id convention.

Every role it cannot find is left None and declared in ``Arch.refusals`` with the reason
(a fused q/k/v projection whose split cannot be read from the graph, an MoE block whose
routing needs the library's form, several stacks of blocks, …); a method that needs it
refuses with that reason instead of guessing. Roles only the rule planner reads
(``head_forward``, ``unruled_heads``) are not looked for: ``generic=True`` rule installation
keeps its own structural planning (:mod:`pyattr.integration.generic`), on the same finders.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from pyattr.activations import _kind_of_module
from pyattr.architectures.forms import (
    GENERIC_GATED_FORM,
    body_matches,
    classify_norm,
    flat_body,
)
from pyattr.architectures.paths import base_prefix, get_submodule, join, model_type
from pyattr.architectures.table import (
    ARCHITECTURES,
    FUSED_GATED_FORMS,
    Arch,
    FusedGatedForm,
)

QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q_lin", "k_lin", "v_lin"))
FUSED_QKV = ("qkv_proj", "Wqkv", "c_attn", "query_key_value", "qkv")
ACT_NAMES = ("act", "act_fn", "activation_fn", "activation")
ACT_CLASS = re.compile(r"(?i)(gelu|silu|swish|relu|tanh|sigmoid|activation)$")
_O_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "out_lin", "Wo", "wo")
_DOWN_NAMES = ("down_proj", "fc2", "c_proj", "dense_4h_to_h", "lin2", "Wo", "wo", "w2", "fc_out")
# Hugging Face eager attention: ``return attn_output, attn_weights``
_CORE_RETURN = re.compile(r"return\(?\w+,\w*(weights|probs)\)?")
# the block roles (Arch fields relative to a block)
BLOCK_ROLES = ("layer_norms", "attention", "qk_norms", "heads", "attention_out", "attention_core", "mlp", "mlp_out",
               "neurons", "fused_mlp")


# --------------------------------------------------------------------------- finders (the planner reads them too)


def qkv_names(mod: nn.Module) -> Optional[Tuple[str, str, str]]:
    """The names of ``mod``'s separate q/k/v projections, or None."""
    return next((n for n in QKV_NAMES if all(isinstance(getattr(mod, a, None), nn.Module) for a in n)), None)


def fused_qkv(mod: nn.Module) -> Optional[str]:
    """The name of ``mod``'s one q|k|v projection, or None."""
    return next((f for f in FUSED_QKV if isinstance(getattr(mod, f, None), nn.Module)), None)


def is_norm_like(mod: nn.Module) -> bool:
    cls = type(mod).__name__
    return isinstance(mod, nn.LayerNorm) or cls.endswith("Norm") or "LayerNorm" in cls or cls.endswith("RMSNorm")


def is_activation_like(name: str, mod: nn.Module) -> bool:
    """A recognised activation kind, or a module named or classed like one."""
    return _kind_of_module(mod) is not None or name.rsplit(".", 1)[-1] in ACT_NAMES or bool(
        ACT_CLASS.search(type(mod).__name__))


def generic_gated_names(mod: nn.Module) -> Optional[Tuple[str, str, str, str]]:
    """(gate, up, down, act) when the module's whole forward is ``down(act(gate(x)) * up(x))``
    under any attribute names."""
    m = body_matches(type(mod).forward, GENERIC_GATED_FORM)
    if m is None:
        return None
    names = (m["gate"], m["up"], m["down"], m["act"])
    return names if all(isinstance(getattr(mod, n, None), nn.Module) for n in names) else None


def fused_gated_form(mod: nn.Module) -> Optional[FusedGatedForm]:
    """The fused gated MLP form (one projection for gate | up) of ``mod``'s forward, or None."""
    for form in FUSED_GATED_FORMS:
        if body_matches(type(mod).forward, form.pattern) is not None and all(
                isinstance(getattr(mod, n, None), nn.Module) for n in (form.proj, form.act, form.down)):
            return form
    return None


def multiplies(parent: Optional[nn.Module], act: str) -> bool:
    """The parent's forward multiplies the output of ``self.<act>(...)`` by something: a
    gate the Half-rule would need, in a form not recognised."""
    body = flat_body(type(parent).forward) if isinstance(parent, nn.Module) else None
    if body is None:
        return False
    return any(f"self.{act}(" in st and "*" in st for st in body.split(";"))


def padding_idx_embeddings(model: nn.Module) -> Optional[nn.Module]:
    """The embeddings module that numbers positions from ``padding_idx + 1`` (RoBERTa's
    ``create_position_ids_from_input_ids``), found by what it does."""
    for m in model.modules():
        if callable(getattr(m, "create_position_ids_from_input_ids", None)) and isinstance(
                getattr(m, "padding_idx", None), int):
            return m
    return None


def _io(mod: nn.Module) -> Optional[Tuple[int, int]]:
    """(in, out) widths of a linear-like module (``nn.Linear``, GPT-2's ``Conv1D``)."""
    if isinstance(mod, nn.Linear):
        return mod.in_features, mod.out_features
    w, nf = getattr(mod, "weight", None), getattr(mod, "nf", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and isinstance(nf, int):
        return int(w.shape[0]), nf
    return None


def _spans(mod: nn.Module, hidden: Optional[int]) -> bool:
    """A norm over the hidden size (by its weight or normalized_shape; a parameter-free one
    without either counts)."""
    if hidden is None:
        return True
    shape = getattr(mod, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and len(shape) == 1:
        return int(shape[0]) == hidden
    if isinstance(shape, int):
        return shape == hidden
    w = getattr(mod, "weight", None)
    return not isinstance(w, torch.Tensor) or (w.dim() == 1 and w.shape[0] == hidden)


def _hidden(model: nn.Module) -> Optional[int]:
    h = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(h, int):
        return h
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    h = getattr(emb, "embedding_dim", None)
    return h if isinstance(h, int) else None


def _under(name: str, roots) -> bool:
    return any(r is not None and (name == r or name.startswith(r + ".")) for r in roots)


# --------------------------------------------------------------------------- blocks


def _layers(base: nn.Module) -> Tuple[Optional[str], str]:
    """(path of the blocks' ModuleList, "") or (None, why not)."""
    found: List[str] = []
    for name, mod in base.named_modules():
        if not isinstance(mod, nn.ModuleList) or not len(mod) or _under(name, found):
            continue
        first = mod[0]
        if any(qkv_names(m) or fused_qkv(m) or "Attention" in type(m).__name__ for m in first.modules()):
            found.append(name)
    if not found:
        return None, f"no nn.ModuleList of blocks with an attention module in {type(base).__name__}"
    if len(found) > 1:
        return None, (f"{len(found)} stacks of blocks ({', '.join(map(repr, found))}): an encoder-decoder or several "
                      "towers, and which one carries the residual stream cannot be read from the module graph")
    return found[0], ""


def _attention(mods: Dict[str, nn.Module], hidden, found, refused) -> Optional[str]:
    """The attention roles of one block; returns the attention module's path."""
    attn = []
    for n, m in mods.items():
        if n and not _under(n, [a for a, _ in attn]) and (qkv_names(m) or fused_qkv(m)):
            attn.append((n, qkv_names(m) or fused_qkv(m)))
    if len(attn) != 1:
        why = ("no attention module with q/k/v projections (" + ", ".join("/".join(n) for n in QKV_NAMES) + ") or "
               "a fused q|k|v projection (" + ", ".join(FUSED_QKV) + ")") if not attn else (
            f"{len(attn)} attention modules in a block ({', '.join(repr(a) for a, _ in attn)}): cross-attention or "
            "several attentions, which the roles (one attention per block) do not describe")
        for r in ("attention", "heads", "attention_out", "attention_core"):
            refused[r] = why
        return None
    path, names = attn[0]
    mod = mods[path]
    if isinstance(names, tuple):
        found["attention"] = ("separate",) + tuple(join(path, n) for n in names)
    else:
        refused["attention"] = (f"fused q|k|v projection {join(path, names)!r}: how it splits into q, k and v (thirds, "
                                "per head, or GQA widths) cannot be read from the module graph, so no attention rule "
                                "is placed on it")
    found["qk_norms"] = tuple(n for n, m in mods.items() if n.startswith(path + ".") and is_norm_like(m))
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    inside = [join(path, o) for o in _O_NAMES]
    # BERT: q/k/v in attention.self, the projection in attention.output.dense
    beside = [join(parent, c, o) for c in dict(mods[parent].named_children()) if join(parent, c) != path
              for o in _O_NAMES] if parent else []
    inside, beside = ([p for p in ps if p in mods and _io(mods[p]) is not None] for ps in (inside, beside))
    heads = [p for p in (inside or beside) if hidden is None or _io(mods[p])[1] == hidden]
    if len(heads) != 1:
        why = (f"no single output projection ({', '.join(_O_NAMES)}) of width {hidden} in or beside the attention "
               f"module {path!r}" + (f" (candidates: {', '.join(heads)})" if heads else ""))
        refused["heads"] = refused["attention_out"] = why
    else:
        found["heads"] = heads[0]
        found["attention_out"] = path if heads[0].startswith(path + ".") else heads[0]
    body = flat_body(type(mod).forward)
    last = body.split(";")[-1] if body else ""
    if _CORE_RETURN.fullmatch(last):
        found["attention_core"] = path
    else:
        refused["attention_core"] = (f"{type(mod).__name__}.forward does not return (output, attention "
                                     "probabilities) as Hugging Face eager attention does; AtP* recomputes them")
    return path


def _mlp(mods: Dict[str, nn.Module], attn: Optional[str], hidden, found, refused) -> None:
    """The MLP roles of one block."""
    moe = [n for n, m in mods.items() if n and not _under(n, [attn]) and isinstance(getattr(m, "experts", None), nn.Module)]
    if moe:
        path = moe[0]
        found["mlp"], found["mlp_out"] = ("moe", path), path
        refused["neurons"] = (f"mixture-of-experts block {path!r}: its MLP hidden units belong to each expert (rows of "
                              "3-D weights), not to a position, so there is no 'neurons' layer; use 'mlp' or dotted paths")
        return
    gated, act = [], []
    for n, m in mods.items():
        if not n or _under(n, [attn] + [g for g, *_ in gated]):
            continue
        form = fused_gated_form(m)
        names = None if form else generic_gated_names(m)
        if form or names:
            gated.append((n, form, names))
        elif is_activation_like(n, m) and not list(m.children()):
            act.append(n)
    if len(gated) + (len(act) if not gated else 0) != 1:
        why = "no MLP found: no gated forward down(act(gate(x)) * up(x)), fused gated form or activation module outside " \
              "attention" if not (gated or act) else \
            f"several MLP candidates in a block ({', '.join(repr(g[0]) for g in gated) or ', '.join(map(repr, act))})"
        refused["mlp"] = refused["mlp_out"] = refused["neurons"] = why
        return
    if gated:
        path, form, names = gated[0]
        # a "gated" MLP found by its form may name its projections otherwise than the table's
        # gate_proj / up_proj / down_proj / act_fn: ``neurons`` names its down projection
        found["mlp"] = ("gated_fused", path) if form else ("gated", path)
        if form:
            found["fused_mlp"] = form
        found["mlp_out"], found["neurons"] = path, (join(path, form.down if form else names[2]), "input")
        return
    path = act[0]
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    if multiplies(mods[parent], path.rsplit(".", 1)[-1]):
        refused["mlp"] = (f"{parent!r} multiplies its activation by another tensor in a form pyattr does not recognise "
                          "(no Half-rule)")
    else:
        found["mlp"] = ("act", path)
    down = _down([(n, _io(m)) for n, m in mods.items() if n and not _under(n, [attn]) and _io(m) is not None],
                 parent, hidden)
    if down is None:
        refused["mlp_out"] = refused["neurons"] = f"the down projection of the MLP around {path!r} cannot be told apart"
        return
    if parent and down.startswith(parent + "."):
        found["mlp_out"], found["neurons"] = parent, (down, "input")
    elif parent:  # BERT's post-norm layout: the activation's module, then a dense projection beside it
        found["mlp_out"], found["neurons"] = down, (parent, "output")
    else:  # OPT: fc1, the activation and fc2 are the block's own children
        found["mlp_out"], found["neurons"] = down, (down, "input")


def _down(lins: List[Tuple[str, Tuple[int, int]]], parent: str, hidden: Optional[int]) -> Optional[str]:
    """The MLP's down projection: back to the hidden width from another, inside the
    activation's module first, then beside it; by name where the widths do not tell."""
    io = dict(lins)
    for pool in ([n for n in io if n.startswith(parent + ".")], [n for n in io if not n.startswith(parent + ".")]):
        outs = [n for n in pool if hidden is None or io[n][1] == hidden]
        cand = [n for n in outs if hidden is not None and io[n][0] != hidden]
        if len(cand) != 1:
            cand = [n for n in outs if n.rsplit(".", 1)[-1] in _DOWN_NAMES]
        if len(cand) == 1:
            return cand[0]
    return None


def _block(block: nn.Module, hidden: Optional[int]) -> Tuple[Dict[str, object], Dict[str, str]]:
    mods = dict(block.named_modules())
    found: Dict[str, object] = {}
    refused: Dict[str, str] = {}
    attn = _attention(mods, hidden, found, refused)
    found["layer_norms"] = tuple(n for n, m in mods.items() if n and is_norm_like(m) and not _under(n, [attn])
                                 and _spans(m, hidden))
    _mlp(mods, attn, hidden, found, refused)
    return found, refused


def _merge(blocks: List[Tuple[str, nn.Module]], hidden) -> Tuple[Dict[str, object], Dict[str, str], Dict[str, nn.Module]]:
    """The block roles over every block (analysed once per distinct module layout): equal
    in all, or refused; layer norms are their union (ModernBERT's first block has an
    nn.Identity where the others have a norm); a block with experts makes the MLP an MoE."""
    seen, results = {}, []
    for path, b in blocks:
        sig = tuple((n, type(m)) for n, m in b.named_modules())
        if sig not in seen:
            seen[sig] = _block(b, hidden)
            results.append((path, seen[sig]))
    found: Dict[str, object] = {}
    refused: Dict[str, str] = {}
    norms = max((f["layer_norms"] for _, (f, _) in results), key=len)
    norms += tuple(n for _, (f, _) in results for n in f["layer_norms"] if n not in norms)
    found["layer_norms"] = tuple(dict.fromkeys(norms))
    probe = {}  # one instance of each norm, by its path
    for n in found["layer_norms"]:
        path, b = next((p, b) for p, b in blocks if is_norm_like(get_submodule(b, n) or nn.Identity()))
        probe[join(path, n)] = b.get_submodule(n)
    for role in BLOCK_ROLES[1:]:
        why = next((r[role] for _, (_, r) in results if role in r), None)
        values = {repr(f.get(role)) for _, (f, _) in results}
        if why is not None:
            refused[role] = why
        elif len(values) > 1:
            refused[role] = f"the blocks differ in it: {' / '.join(sorted(values))}"
        elif results[0][1][0].get(role) is not None:
            found[role] = results[0][1][0][role]
    moe = [(f["mlp"], r["neurons"]) for _, (f, r) in results if (f.get("mlp") or (None,))[0] == "moe"]
    if moe and all(f.get("mlp_out") == moe[0][0][1] for _, (f, _) in results):
        # Qwen2-MoE's layers without experts are gated MLPs at the same path
        found["mlp"], found["mlp_out"], refused["neurons"] = moe[0][0], moe[0][0][1], moe[0][1]
        for role in ("mlp", "mlp_out", "fused_mlp"):
            refused.pop(role, None)
        found.pop("neurons", None)
        found.pop("fused_mlp", None)
    return found, refused, probe


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
    if isinstance(mod, nn.LayerNorm) and len(mod.normalized_shape) == 1:
        return "layer_norm", 0.0
    got = classify_norm(mod, hidden) if isinstance(hidden, int) else None
    return None if got is None else (got[0], float(got[1][1]))


def _entry(model: nn.Module, base: nn.Module, outer: List[str], layers: str) -> Tuple[str, str]:
    """Where the residual stream enters the blocks: the embedding norm's input (an outer
    norm registered before the blocks, beside the input embeddings or named as an
    embedding / pre-blocks norm: BERT's ``embeddings.LayerNorm``, CLIP's ``pre_layrnorm``),
    else the first block's input. OPT registers its final norm before its blocks: not one."""
    order = {n: i for i, (n, _) in enumerate(base.named_modules())}
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_path = next((n for n, m in base.named_modules() if emb is not None and m is emb), None)
    home = emb_path.rsplit(".", 1)[0] if emb_path and "." in emb_path else None
    if home is not None and _under(layers, [home]):
        home = None
    for n in outer:
        leaf = n.rsplit(".", 1)[-1].lower()
        if order[n] < order[layers] and (_under(n, [home]) or "emb" in n.lower() or leaf.startswith("pre")):
            return n, "input"
    return join(layers, "0"), "hidden_states"


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
    if layers is not None:
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
    found["positions"] = "padding_idx" if padding_idx_embeddings(model) is not None else "mask"
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
    the discovered one when the caller opted in with ``generic=True``; else None."""
    entry = ARCHITECTURES.get(model_type(model))
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
