"""The block roles of structural discovery (:mod:`pyattr.architectures.discover`): the
stack of blocks, and in each block the attention parts (q/k/v projections, output
projection, attention contribution and core, q/k norms), the residual-stream norms and the
MLP parts (kind, contribution, hidden units), merged over every block; each role it cannot
find is returned with the reason. The finders here (q/k/v projections, gated forms,
norm- and activation-like modules) are shared with the ``generic=True`` rule planner
(:mod:`pyattr.integration.generic`)."""

from __future__ import annotations

import inspect
import re
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from pyattr._module_forward import forward_of
from pyattr.activations import _kind_of_module
from pyattr.architectures.forms import (
    GENERIC_GATED_FORM,
    body_matches,
    flat_body,
)
from pyattr.architectures.paths import get_submodule, input_embeddings, join
from pyattr.architectures.table import (
    FUSED_GATED_FORMS,
    FusedGatedForm,
)

#: examples of the q/k/v names :func:`qkv_names` reads (any name with those stems is read)
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


# a child of an attention module that projects its queries, keys or values, read off the
# module graph by its name: the stem (q / query, k / key, v / value) with an optional ``W``
# before it and a projection suffix after it — q_proj (Llama), query (BERT), q_lin
# (DistilBERT), q (MPNet, T5), query_proj (DeBERTa), Wq (CTRL), q_head (Funnel)
_QKV_PART = {part: re.compile(rf"(?i)^(?:w_?)?(?:{stems})(?:_?(?:proj|lin|linear|head|layer))?$")
             for part, stems in (("q", "q|query"), ("k", "k|key"), ("v", "v|value"))}


def qkv_candidates(mod: nn.Module) -> Dict[str, List[str]]:
    """For each of q, k and v, the children with parameters whose name has that stem."""
    return {part: [n for n, c in mod.named_children() if _QKV_PART[part].match(n) and next(c.parameters(), None) is not None]
            for part in "qkv"}


def qkv_names(mod: nn.Module) -> Optional[Tuple[str, str, str]]:
    """The names of ``mod``'s separate q/k/v projections, or None: for each of q, k and v
    exactly one child with parameters whose name has that stem (:data:`_QKV_PART`)."""
    found = qkv_candidates(mod)
    if any(len(v) != 1 for v in found.values()):
        return None
    return tuple(found[p][0] for p in "qkv")


def fused_qkv(mod: nn.Module) -> Optional[str]:
    """The name of ``mod``'s one q|k|v projection, or None."""
    return next((f for f in FUSED_QKV if isinstance(getattr(mod, f, None), nn.Module)), None)


# a norm on the query or key path (per head or over the projection's width), by its name:
# q_norm / k_norm (Qwen3, OLMo 2), query_norm / key_norm, q_layernorm / k_layernorm
# (Persimmon), q_ln / k_ln, norm_q / norm_k, q_a_layernorm (MLA's query down-projection)
QK_NORM = re.compile(r"(?i)^(?:(?:q|k|query|key)(?:_a)?_?(?:norm|layernorm|layer_norm|ln|rmsnorm)|(?:norm|ln)_?(?:q|k))$")


def is_qk_norm(name: str) -> bool:
    """``name`` (a module path) names a norm of the query or key path (:data:`QK_NORM`):
    any other norm inside an attention module (ALBERT's post-LN over the residual stream,
    DiffLlama's group norm and BitNet's ``attn_sub_norm`` on the attention output, Gemma 4's
    ``v_norm`` on the values) lies on the path relevance takes and needs the LN-rule."""
    return bool(QK_NORM.match(name.rsplit(".", 1)[-1]))


def is_norm_like(mod: nn.Module) -> bool:
    """An ``nn.LayerNorm``, a class named ``…Norm``, or a leaf class with "LayerNorm" in its
    name (``LayerNorm1P``); not a container named after its model (RoBERTa-PreLayerNorm's
    ``RobertaPreLayerNormEmbeddings`` and ``…Layer`` hold the norms, they are not ones)."""
    cls = type(mod).__name__
    return isinstance(mod, nn.LayerNorm) or cls.endswith("Norm") or (
        "LayerNorm" in cls and not list(mod.children()))


def plain_layer_norm(mod: nn.Module) -> bool:
    """An ``nn.LayerNorm`` over the last dimension computing ``nn.LayerNorm.forward`` (a
    subclass with its own forward, such as Nemotron's ``(1 + w)`` LayerNorm1P, is probed
    for what it computes instead)."""
    return isinstance(mod, nn.LayerNorm) and len(mod.normalized_shape) == 1 and \
        forward_of(mod) is nn.LayerNorm.forward


def is_activation_like(name: str, mod: nn.Module) -> bool:
    """A recognised activation kind, or a module named or classed like one."""
    return _kind_of_module(mod) is not None or name.rsplit(".", 1)[-1] in ACT_NAMES or bool(
        ACT_CLASS.search(type(mod).__name__))


def generic_gated_names(mod: nn.Module) -> Optional[Tuple[str, str, str, str]]:
    """(gate, up, down, act) when the module's whole forward is ``down(act(gate(x)) * up(x))``
    under any attribute names."""
    m = body_matches(forward_of(mod), GENERIC_GATED_FORM)
    if m is None:
        return None
    names = (m["gate"], m["up"], m["down"], m["act"])
    return names if all(isinstance(getattr(mod, n, None), nn.Module) for n in names) else None


def fused_gated_form(mod: nn.Module) -> Optional[FusedGatedForm]:
    """The fused gated MLP form (one projection for gate | up) of ``mod``'s forward, or None."""
    for form in FUSED_GATED_FORMS:
        if body_matches(forward_of(mod), form.pattern) is not None and all(
                isinstance(getattr(mod, n, None), nn.Module) for n in (form.proj, form.act, form.down)):
            return form
    return None


def multiplies(parent: Optional[nn.Module], act: str) -> bool:
    """The parent's forward multiplies the output of ``self.<act>(...)`` by something: a
    gate the Half-rule would need, in a form not recognised."""
    body = flat_body(forward_of(parent)) if isinstance(parent, nn.Module) else None
    if body is None:
        return False
    return any(f"self.{act}(" in st and "*" in st for st in body.split(";"))


def adds_residual(mod: nn.Module) -> Optional[str]:
    """Why ``mod``'s output is the residual stream rather than what it adds to it, or None:
    its forward takes the residual as an argument (BLOOM's attention and MLP, MPT's MLP:
    ``dropout_add(out, residual)``) or adds its own input before returning (ALBERT's
    attention: ``LayerNorm(hidden_states + out)``)."""
    fn = forward_of(mod)
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        params = params[1:] if params[:1] == ["self"] else params  # a forward set on the instance has none
    except (TypeError, ValueError):
        return None
    res = next((n for n in params if "residual" in n.lower()), None)
    if res is not None:
        return f"{type(mod).__name__}.forward takes the residual stream ({res!r}) and adds it to what it returns"
    body = flat_body(fn)
    if not body or not params:
        return None
    names = {params[0]}  # the names holding the input: the parameter, and aliases (residual = hidden_states)
    for st in body.split(";"):
        if any(re.search(rf"(?<![\w.]){re.escape(n)}\+|\+=?{re.escape(n)}(?![\w.(\[])", st) for n in names):
            return (f"{type(mod).__name__}.forward adds its input {params[0]!r} (the residual stream) to what it "
                    "returns")
        bound = re.match(r"(\w+)(?::[^=]+)?=(?!=)(.*)", st)
        if bound is not None:
            (names.add if bound[2] in names else names.discard)(bound[1])
            if not names:
                return None
    return None


def _params(mod: nn.Module) -> Tuple[str, ...]:
    try:
        return tuple(inspect.signature(forward_of(mod)).parameters)
    except (TypeError, ValueError):
        return ()


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
    emb = input_embeddings(model)
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
        amb = next((f"{n!r} has several children named as its {part} projection ({', '.join(map(repr, c))}), which "
                    "is not guessed" for n, m in base.named_modules() for part, c in qkv_candidates(m).items()
                    if len(c) > 1), None)
        return None, f"no nn.ModuleList of blocks with an attention module in {type(base).__name__}" + (
            f" ({amb})" if amb else "")
    if len(found) > 1:
        return None, (f"{len(found)} stacks of blocks ({', '.join(map(repr, found))}): an encoder-decoder or several "
                      "towers, and which one carries the residual stream cannot be read from the module graph")
    owner = base.get_submodule(found[0].rsplit(".", 1)[0]) if "." in found[0] else base
    fn = autograd_function(owner)
    if fn is not None:
        return None, (f"{type(owner).__name__}.forward runs its blocks {found[0]!r} inside the custom autograd Function "
                      f"{fn} (reversible residual layers, as Reformer's: its backward recomputes the blocks and forms "
                      "their gradients itself), so the rules' modified backward never runs there")
    return found[0], ""


def autograd_function(mod: nn.Module) -> Optional[str]:
    """The name of a ``torch.autograd.Function`` that ``mod``'s forward applies (``X.apply(``),
    or None."""
    body = flat_body(forward_of(mod))
    if not body:
        return None
    scope = vars(inspect.getmodule(type(mod)) or object)
    for name in re.findall(r"(?<![\w.])(\w+)\.apply\(", body):
        name = name[len("return"):] if name.startswith("return") and name not in scope else name  # whitespace gone
        obj = scope.get(name)
        if isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
            return name
    return None


def _attention(mods: Dict[str, nn.Module], hidden, found, refused) -> Optional[str]:
    """The attention roles of one block; returns the attention module's path."""
    attn = []
    for n, m in mods.items():
        if n and not _under(n, [a for a, _ in attn]) and (qkv_names(m) or fused_qkv(m)):
            attn.append((n, qkv_names(m) or fused_qkv(m)))
    if len(attn) != 1:
        why = ("no attention module with q/k/v projections (named by stem: " + ", ".join("/".join(n) for n in QKV_NAMES)
               + ", …) or "
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
    found["qk_norms"] = tuple(n for n, m in mods.items() if n.startswith(path + ".") and is_norm_like(m)
                              and is_qk_norm(n))
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
        # the attention module's output is its contribution, unless it adds the residual
        # inside (BLOOM, ALBERT): then the projection's, before the add
        inner = heads[0].startswith(path + ".") and adds_residual(mod) is None
        found["attention_out"] = path if inner else heads[0]
    body = flat_body(forward_of(mod))
    last = body.split(";")[-1] if body else ""
    if "alibi" in _params(mod):
        refused["attention_core"] = (f"{type(mod).__name__}.forward takes an ALiBi bias ('alibi') folded with the "
                                     "batch (batch × heads rows), which AtP*'s per-row recomputation cannot split")
    elif _CORE_RETURN.fullmatch(last):
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
    if parent and down.startswith(parent + ".") and (adds_residual(mods[parent]) or _under(attn or "", [parent])):
        # the activation's module adds the residual inside (BLOOM, MPT) or holds the
        # attention too (ALBERT's layer): the contribution is the down projection's output
        found["mlp_out"], found["neurons"] = down, (down, "input")
    elif parent and down.startswith(parent + "."):
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
    # a norm inside attention that is not a q/k norm (ALBERT's post-LN) is on the residual path
    found["layer_norms"] = tuple(n for n, m in mods.items() if n and is_norm_like(m)
                                 and not (_under(n, [attn]) and is_qk_norm(n)) and _spans(m, hidden))
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
