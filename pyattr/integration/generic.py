"""``generic=True``: structural rule installation for architectures without a rule map.

The planner reads the module graph instead of a map: attention by its q/k/v projections,
norms by what they compute (:mod:`.structural`), gated MLPs by the form of their forward,
activations by kind or name; whatever it cannot place is reported with the reason.

It finds these with the finders of structural discovery
(:mod:`pyattr.architectures.discover`), whose :class:`~pyattr.architectures.Arch` entry is
what the methods read for the same model (entry point, layer shorthands, patching nodes
and heads, AtP*'s attention core). The planner keeps its own walk over every module
because an entry cannot say everything it places: norms of unknown classes mounted beside
their own forward, gated MLPs under any attribute names, attention and activations
outside the blocks, and what it leaves native, each with its reason.
"""

from __future__ import annotations

import torch
from torch import nn

import pyattr.architectures as A
from pyattr.activations import _kind_of_module
from pyattr.architectures.blocks import (
    ACT_CLASS,
    ACT_NAMES,
    fused_gated_form,
    fused_qkv,
    generic_gated_names,
    is_norm_like,
    is_qk_norm,
    multiplies,
    plain_layer_norm,
    qkv_names,
)
from pyattr.config import RelevanceRules
from pyattr.integration.errors import RelevanceRuleUnsupportedError
from pyattr.integration.forwards import ATTN_SCALES, fused_projection_forward
from pyattr.integration.fused_qkv import THROUGH, column_roles, projections, role_pattern, value_columns
from pyattr.integration.gated_plan import plan_gated_fused, plan_gated_named
from pyattr.integration.moe_plan import plan_generic_moe
from pyattr.integration.planner import Planner
from pyattr.integration.structural import _eps, classify_norm, structural_norm_forward


def plan_generic(model: nn.Module, rules: RelevanceRules) -> Planner:
    """Structural discovery for a model without a rule map, used only when asked for.

    - attention: a module with q/k/v projections (``q_proj``/``k_proj``/``v_proj``,
      ``query``/``key``/``value`` or ``q_lin``/``k_lin``/``v_lin``); a fused q|k|v
      projection is reported, not guessed at;
    - norms: ``nn.LayerNorm`` (spanning the hidden size, or any width outside attention:
      ELECTRA's embedding-size norms) and ``*RMSNorm`` spanning the hidden size, and any
      other norm-like class recognised by what it computes (:mod:`.structural`); inside an
      attention module, a norm of the q or k path (by its name,
      :func:`~pyattr.architectures.blocks.is_qk_norm`) gets the q/k-norm treatment (the
      LN-rule under AttnLRP, else native), any other (a post-LN over the residual stream, a
      norm of the values or of the attention output) the LN-rule as a residual norm;
    - gated MLPs: a forward ``down(act(gate(x)) * up(x))`` under any attribute names;
    - activations: recognised kinds anywhere, and activation modules of unknown kind
      (``act``, ``act_fn``, ``activation_fn``, ``activation``) under the Identity-rule's
      general form φ(x) = act(x)/x.

    Whatever norm-like or activation-like module it cannot classify is listed in the
    coverage report's ``skipped`` with the reason."""
    pl = Planner(model, rules, "generic")
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    modules = dict(model.named_modules())
    attention = []
    for name, mod in modules.items():
        names = qkv_names(mod)
        if names:
            attention.append((name, names))
    inside_attention = [n for n, _ in attention]
    gated, fused = {}, {}
    moe = [n for n, m in modules.items() if n and isinstance(getattr(m, "experts", None), nn.Module)]
    # a sparse block whose router and experts have a known form gets the routing and gated
    # rules (its shared expert, if any, is found below as any gated MLP); any other is left
    # native with the reason, and the plan check refuses the model
    native_moe, placed = {}, set()
    for name in moe:
        why, ids = plan_generic_moe(pl, name, modules[name])
        placed |= ids
        if why is not None:
            native_moe[name] = why
    for name, mod in modules.items():
        if not name or id(mod) in placed or any(name == b or name.startswith(b + ".") for b in native_moe):
            continue
        names = generic_gated_names(mod)
        if names:
            gated[name] = names
            pl.mounted.add(id(modules[A.join(name, names[3])]))
            continue
        form = fused_gated_form(mod)
        if form is not None:
            fused[name] = form
            pl.mounted.add(id(getattr(mod, form.act)))
    for name, why in native_moe.items():
        pl.native.append(modules[name])
        for sub, m in modules.items():
            if sub == name or sub.startswith(name + "."):
                pl.mounted.add(id(m))
        pl.cov._skip(name, f"generic: mixture-of-experts block whose router or experts have no form the rules can be "
                           f"placed on ({why[:160]}): left native, relevance is not conserved through it")
    for name, (q, k, v) in attention:
        mod = modules[name]
        for proj in (q, k, v):
            why = projection_problem(getattr(mod, proj))
            if why is not None and rules.attention:
                raise RelevanceRuleUnsupportedError(
                    f"generic: {A.join(name, proj)!r} ({type(getattr(mod, proj)).__name__}) {why}: the attention rule "
                    "scales the gradient of a q/k/v projection's output tensor, so no attention rule can be placed on "
                    f"{name!r}")
        pl.attention(name, ("separate", q, k, v))
        qk = [A.join(name, n) for n in ("q_norm", "k_norm") if isinstance(getattr(mod, n, None), nn.Module)]
        qk = [p for p in qk if type(modules[p]).__name__.endswith("RMSNorm")
              and isinstance(getattr(modules[p], "weight", None), torch.Tensor)]
        if qk:
            pl.qk_norms(qk, "rms_norm", 1.0 if "Gemma" in type(modules[qk[0]]).__name__ else 0.0)
    for name, mod in modules.items():
        if not name or id(mod) in pl.mounted:
            continue
        if name in gated:
            plan_gated_named(pl, name, gated[name])
            continue
        if name in fused:
            plan_gated_fused(pl, name, fused[name])
            continue
        if is_norm_like(mod):
            inside = any(name.startswith(a + ".") for a in inside_attention)
            if inside and is_qk_norm(name) and rules.attention != "attnlrp":
                # on the q/k path: under the AH-rule no gradient reaches it (and with the
                # attention rule off the softmax's native gradient is the caller's choice)
                pl.mounted.add(id(mod))
                pl.cov._skip(name, "norm inside attention (a q/k norm), not a residual-stream norm: left native")
                continue
            # any other norm inside attention (ALBERT's post-LN, DiffLlama's group norm,
            # BitNet's attn_sub_norm, Gemma 4's v_norm) lies on the path relevance takes:
            # the LN-rule, as a residual norm (and a q/k norm under AttnLRP)
            cls = type(mod).__name__
            w = getattr(mod, "weight", None)
            spans = isinstance(w, torch.Tensor) and w.dim() == 1 and (hidden is None or w.shape[0] == hidden)
            if plain_layer_norm(mod):  # any width: ELECTRA's and ALBERT's embedding-size norms, per-head norms
                pl.norm(name, "layer_norm", 0.0)
            else:
                # probed, whatever the class name says: an RMSNorm may compute x/r·(1 + w)
                found = classify_norm(mod, hidden)  # at its own width, else the hidden size
                if found is not None and found[0] == "rms_norm" and spans and found[1][0] is w:
                    pl.norm(name, "rms_norm", found[1][1])
                    continue
                if found is None:
                    pl.mounted.add(id(mod))
                    pl.cov._skip(name, f"generic: {cls} is norm-like but computes no layer / RMS norm over "
                                       "the hidden size that could be recognised: left native")
                else:
                    pl.structural_norm(name, mod, found[0], found[1], _eps(mod), structural_norm_forward)
            continue
        kind = _kind_of_module(mod)
        leaf = name.rsplit(".", 1)[-1]
        act_like = leaf in ACT_NAMES or bool(ACT_CLASS.search(type(mod).__name__))
        bare = not list(mod.children()) and (not list(mod.parameters()) or _elementwise(mod))
        if kind is not None or (act_like and bare):
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            if multiplies(modules.get(parent), leaf):
                pl.mounted.add(id(mod))
                pl.cov._skip(parent, f"generic: multiplies its activation {leaf!r} by another tensor in a form pyattr "
                                     "does not recognise (no Half-rule): left native, relevance is not conserved "
                                     "through it")
                continue
            pl.activation(name, parent)
        elif act_like:
            pl.mounted.add(id(mod))
            pl.cov._skip(name, f"generic: activation-like module with parameters or submodules ({type(mod).__name__}), "
                               "no known form: left native")
        qkv = fused_qkv(mod)  # an nn.Linear or GPT-2's Conv1D
        if qkv and name not in dict(attention):
            _fused_attention(pl, name, mod, qkv)
        if "Attention" in type(mod).__name__ and name not in dict(attention) and not any(
                name.startswith(a + ".") or a.startswith(name + ".") for a in inside_attention) and not qkv:
            _observed_attention(pl, name, mod)
    pl.skip_lookalikes()
    return pl



def _elementwise(mod: nn.Module) -> bool:
    """An activation with parameters of its own (xIELU's learned α) that acts element by
    element: each of a few entries of a probe moved alone moves its own output only. Its
    parameters are constants of the Identity-rule's φ = act(x)/x."""
    p = next(iter(mod.parameters()), None)
    if p is None or p.device.type == "meta" or not p.is_floating_point():
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, generator=g, dtype=torch.float64).to(p.dtype).to(p.device)
    try:
        with torch.no_grad():
            y = mod(x)
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                return False
            for j in (0, 5, 11):
                x2 = x.clone()
                x2[0, j] += 1.0
                moved = (mod(x2) != y)
                if not bool(moved[0, j]) or int(moved.sum()) != 1:
                    return False
    except Exception:  # noqa: BLE001 - not a module of one tensor
        return False
    return True


def _observed_attention(pl: Planner, name: str, mod: nn.Module) -> None:
    """Attention without separate q/k/v projections by name (multi-head latent attention's
    low-rank chains): the attention rule on each projection's columns by the roles observed
    on the module (:func:`~pyattr.integration.fused_qkv.column_roles`), or its pattern left
    unfrozen with the reason."""
    if not pl.rules.attention:
        pl.cov._skip(name, "attention rule off")
        return
    roles, why = column_roles(pl.model, mod) if projections(mod) else (None, "no projection children")
    if roles is None:
        pl.cov._skip(name, f"generic: attention without recognisable q/k/v projections, whose roles could not be "
                           f"observed ({why[:160]}): its pattern is not frozen (no attention rule)")
        return
    mode = pl.rules.attention
    for proj, r in roles.items():
        if bool((r == THROUGH).all()):
            continue  # the first step of a low-rank chain: its columns are read by the next projection
        path = A.join(name, proj)
        pl.add("attention", path, getattr(mod, proj), (mode, "observed"),
               fused_projection_forward(role_pattern(ATTN_SCALES[mode], r)))
        pl.freeze(path)


def _fused_attention(pl: Planner, name: str, mod: nn.Module, qkv: str) -> None:
    """A fused q|k|v projection: the attention rule by the value columns observed on the
    module (:mod:`pyattr.integration.fused_qkv`), or left native with the reason."""
    path = A.join(name, qkv)
    if not pl.rules.attention:
        pl.cov._skip(path, "attention rule off")
        return
    values, why = value_columns(pl.model, mod, qkv)
    if values is None:
        pl.cov._skip(path, f"generic: fused q/k/v projection whose split could not be observed ({why[:160]}): left "
                           "native")
        return
    mode = pl.rules.attention
    pl.add("attention", path, getattr(mod, qkv), (mode, "qkv"),
           fused_projection_forward(role_pattern(ATTN_SCALES[mode], values)))
    pl.freeze(path)


def projection_problem(mod: nn.Module):
    """Why ``mod`` is not a q/k/v projection the attention rule can wrap (a map returning one
    tensor of the input's leading shape), or None. A plain ``nn.Linear`` is one; any other
    module is run once on two random rows of its ``in_features`` (I-BERT's QuantLinear
    returns ``(output, scaling_factor)``)."""
    if isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward:
        return None
    width = getattr(mod, "in_features", None)
    w = getattr(mod, "weight", None)
    if not isinstance(width, int) and isinstance(w, torch.Tensor) and w.dim() == 2:
        width = int(w.shape[1])
    p = next(iter(mod.parameters()), None)
    if not isinstance(width, int) or p is None or p.device.type == "meta" or not p.is_floating_point():
        return None  # nothing to probe it with: the rule's own check reads its output
    try:
        with torch.no_grad():
            out = mod(torch.zeros(2, width, dtype=p.dtype, device=p.device))
    except Exception as e:  # noqa: BLE001 - a projection that does not take one tensor
        return f"does not map one tensor of width {width} ({type(e).__name__}: {e})"
    if not isinstance(out, torch.Tensor):
        return f"returns a {type(out).__name__}, not a tensor (not a plain linear map)"
    if out.shape[:-1] != (2,):
        return f"maps a ({2}, {width}) input to {tuple(out.shape)}"
    return None
