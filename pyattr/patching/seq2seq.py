"""Patching on encoder–decoder models (:func:`pyattr.patching.attribution_patching` and
:func:`pyattr.patching.activation_patching` with ``decoder_input_ids=``): nodes on both
stacks and the decoder's cross-attention, the metric read on the decoder side.

Node types: the one-stack names (``"residual"``, ``"attention"``, ``"heads"``, ``"mlp"``,
``"neurons"``) on each stack, and ``"cross_attention"`` (the output of each decoder block's
cross-attention, before the residual add) and ``"cross_heads"`` (each head's slice of the
cross-attention's output projection input). A bare name gives both stacks' nodes; a
prefixed one (``"encoder.mlp"``, ``"decoder.heads"``) one stack's. The result's keys are
prefixed: ``result["encoder.residual"]`` is ``(batch, layer, source position)``,
``result["decoder.cross_heads"]`` ``(batch, layer, target position, head)``.

Clean and corrupt line up position by position: the same source length and mask, the same
decoder inputs' length and mask (the decoder's inputs of the corrupt run default to the
clean run's). Methods: ``"relp"`` and ``"atp"`` (estimates from one forward of each and one
backward), and exact patching (``activation_patching``): each node's corrupt activation in
a copy of the clean run, copies batched, against an unpatched forward of as many copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

import pyattr.architectures as A
import pyattr.methods._core as core
import pyattr.methods.seq2seq_inputs as SI
import pyattr.methods.seq2seq_targets as ST
import pyattr.targets as T
from pyattr.methods._core.forward import evaluate_targets, leaf
from pyattr.patching.nodes import NODES, Site, width_slice
from pyattr.patching.result import PatchingResult

SEQ2SEQ_NODES = NODES + ("cross_attention", "cross_heads")
SIDES = ("encoder", "decoder")
#: methods patching runs on encoder–decoder models
SEQ2SEQ_METHODS = ("relp", "atp")


def check_nodes(nodes) -> List[str]:
    """Prefixed node names (``"encoder.residual"``, …), in the order asked for."""
    if isinstance(nodes, str):
        nodes = [nodes]
    if not isinstance(nodes, (list, tuple)) or not nodes:
        raise ValueError(f"nodes must be one of {SEQ2SEQ_NODES} (or one prefixed with 'encoder.' / 'decoder.') or a "
                         f"non-empty list of them, got {nodes!r}")
    out: List[str] = []
    for n in nodes:
        side, _, base = n.rpartition(".") if isinstance(n, str) else ("", "", n)
        if base not in SEQ2SEQ_NODES or side not in ("",) + SIDES:
            raise ValueError(f"nodes: unknown node type {n!r}; expected one of {SEQ2SEQ_NODES}, optionally prefixed "
                             "with 'encoder.' or 'decoder.'")
        if side == "encoder" and base.startswith("cross_"):
            raise ValueError(f"nodes: {n!r}: the encoder has no cross-attention; 'decoder.{base}'")
        for s in ((side,) if side else SIDES):
            name = f"{s}.{base}"
            if not (s == "encoder" and base.startswith("cross_")) and name not in out:
                out.append(name)
    return out


def _heads(model: nn.Module, side: str, attention: nn.Module) -> int:
    """The number of heads of an attention module: as the module holds it (``n_heads``,
    ``num_heads``, its config's ``num_attention_heads``), else the model's config for that
    stack (T5Gemma's per-stack configs, T5Gemma 2's text config)."""
    own = [getattr(attention, k, None) for k in ("n_heads", "num_heads", "num_attention_heads")]
    own.append(getattr(getattr(attention, "config", None), "num_attention_heads", None))
    cfg = getattr(model, "config", None)
    sub = getattr(cfg, side, None)
    configs = (sub, getattr(sub, "text_config", None), cfg)
    found = own + [getattr(c, k, None) for c in configs for k in (f"{side}_attention_heads", "num_heads",
                                                                   "num_attention_heads")]
    n = next((v for v in found if isinstance(v, int) and v > 0), None)
    if n is None:
        raise ValueError(f"nodes: 'heads' needs the {side}'s number of heads, and neither its attention module nor "
                         f"{type(model).__name__}'s config names it")
    return n


def sites(model: nn.Module, names: Sequence[str]) -> List[Tuple[str, Site]]:
    """``(node name, Site)`` for every block of the node's stack, in order."""
    spec = A.SEQ2SEQ[A.model_type(model)]
    prefix = A.base_prefix(model)
    out = []
    for name in names:
        side, base = name.split(".")
        arch = spec.encoder if side == "encoder" else spec.decoder
        if base == "neurons" and arch.neurons is None:
            raise ValueError(f"nodes: {name!r}: no neuron site in the map of {type(model).__name__}")
        blocks = A.get_submodule(model, A.join(prefix, arch.layers))
        if arch.streams is not None:
            raise ValueError(
                f"nodes: {name!r}: {type(model).__name__}'s {side} blocks run {arch.streams} predicting streams after "
                "the tokens' (every block's states hold 1 + config."
                f"{arch.streams} streams of the target's length), so its nodes are not one per decoder position; "
                "patch the encoder's nodes ('encoder.<node>')")
        if base.startswith("cross_") and spec.cross_attention is None:
            raise ValueError(f"nodes: {name!r}: {type(model).__name__}'s decoder attends to the encoder in its "
                             "self-attention (one softmax over both); patch 'decoder.attention' / 'decoder.heads'")
        cross = spec.cross_attention[1].rsplit(".", 1)[0] if spec.cross_attention else ""  # its module in a block
        out_proj = arch.heads.rsplit(".", 1)[1]                    # its output projection's name
        rel = {"attention": (arch.attention_out, "output"), "mlp": (arch.mlp_out, "output"),
               "heads": (arch.heads, "input"), "neurons": arch.neurons,
               "cross_attention": (cross, "output"), "cross_heads": (f"{cross}.{out_proj}", "input")}
        for i in range(len(blocks)):
            block = A.join(prefix, f"{arch.layers}.{i}")
            path, where = (block, "input") if base == "residual" else (f"{block}.{rel[base][0]}", rel[base][1])
            mod = A.get_submodule(model, path)
            if mod is None:
                raise ValueError(f"nodes: {name!r}: {type(model).__name__} has no module {path!r}")
            heads = _heads(model, side, A.get_submodule(model, path.rsplit(".", 1)[0])) \
                if base in ("heads", "cross_heads") else 0
            out.append((name, Site(base.replace("cross_", ""), i, path, mod, where, heads)))
    return out


def prepare(model, clean, corrupt, attention_mask, corrupt_attention_mask, decoder_input_ids,
            corrupt_decoder_input_ids, decoder_attention_mask, caller, tokenizer=None):
    """The clean and corrupt kwargs (source, decoder inputs, masks), checked to line up."""
    kc, dec, dmask, _ = SI.prepare(model, clean, attention_mask, decoder_input_ids, decoder_attention_mask, caller,
                                   tokenizer)
    # the corrupt run reads the clean run's decoder inputs unless it is given its own (the
    # argument, or decoder_input_ids / labels in its inputs mapping)
    own = hasattr(corrupt, "keys") and any(k in corrupt for k in ("decoder_input_ids", "labels"))
    if corrupt_decoder_input_ids is not None:
        dx, dmx = corrupt_decoder_input_ids, decoder_attention_mask
    elif own:
        dx, dmx = None, None
    else:
        dx, dmx = dec, dmask
    kx, dec_x, dmask_x, _ = SI.prepare(model, corrupt, corrupt_attention_mask, dx, dmx, caller, tokenizer)
    for what, a, b in (("source (input_ids)", kc["input_ids"], kx["input_ids"]), ("decoder_input_ids", dec, dec_x)):
        if a.shape != b.shape:
            raise ValueError(f"clean and corrupt: their {what} differ in shape, {tuple(a.shape)} and "
                             f"{tuple(b.shape)}; on an encoder–decoder model patching lines them up position by "
                             "position (no alignment): give inputs of one length")
    for what, a, b in (("attention_mask", kc.get("attention_mask"), kx.get("attention_mask")),
                       ("decoder_attention_mask", dmask, dmask_x)):
        if (a is None) != (b is None) or (a is not None and not torch.equal(a.bool(), b.bool())):
            raise ValueError(f"clean and corrupt: their {what} differ; patching lines them up position by position, "
                             "so the real tokens must sit at the same positions")
    return kc, kx, dec, dmask


def _valid(kwargs, dec, dmask, side: str) -> torch.Tensor:
    if side == "encoder":
        m = kwargs.get("attention_mask")
        return m.bool() if m is not None else torch.ones_like(kwargs["input_ids"], dtype=torch.bool)
    return dmask.bool() if dmask is not None else torch.ones_like(dec, dtype=torch.bool)


@dataclass(frozen=True)
class Call:
    """What every forward of one patching call shares, found once: the stacks' entries (the
    encoder's checked to hold one position per source token), the stack the metric reads,
    the caller's name for messages."""
    enc_entry: nn.Module
    dec_entry: nn.Module
    side: str
    caller: str


def _run(model, kwargs, dec, dmask, tgts, flat, record: bool, call: Call, patch=None):
    """The metric (Tensor[batch]) and, with ``record``, every site's activation (in the
    graph); ``patch(i)``: a tap body for site ``i`` (or None). The metric is read on the
    stack its targets read (``dec`` and ``dmask``: the decoder's inputs of this call)."""
    acts: List[Optional[torch.Tensor]] = [None] * len(flat)

    def fn_for(i):
        body = patch(i) if patch is not None else None

        def fn(t):
            new = body(t) if body is not None else None
            if new is None and record and flat[i][1].where == "input" and t.requires_grad:
                new = t.view_as(t)  # the node as its module receives it (see pairs._recording)
            if record:
                acts[i] = t if new is None else new
            return new
        return fn

    one = SI.one_per_token(None, kwargs["input_ids"].shape[1], model, call.caller)
    with core.tap(call.enc_entry, "input", one, once=True), \
            core.taps([(s.module, s.where) for _, s in flat], fn_for), ST.recording(model, tgts, store := {}):
        out = model(**kwargs)
    read = {**kwargs, "decoder_input_ids": dec, "decoder_attention_mask": dmask}
    value, _, fixed = evaluate_targets(tgts, ST.forward(call.side, out, read, store), False)
    if value.dim() != 1 or value.shape[0] != dec.shape[0]:
        raise ValueError(f"metric must give one value per row, shape ({dec.shape[0]},), got shape {tuple(value.shape)}")
    return value, acts, fixed


def _reduce(prod: torch.Tensor, site: Site) -> torch.Tensor:
    if site.node == "neurons":
        return prod
    if site.node == "heads":
        b, s, w = prod.shape
        return prod.view(b, s, site.heads, w // site.heads).sum(-1)
    return prod.sum(-1)


def _dims(name: str) -> Tuple[str, ...]:
    """The one-stack dimension names: an ``"encoder.*"`` node's positions are the source's,
    a ``"decoder.*"`` node's the decoder inputs'."""
    base = name.split(".")[1]
    extra = ("head",) if base in ("heads", "cross_heads") else ("neuron",) if base == "neurons" else ()
    return ("batch", "layer", "position") + extra


def _stack(flat, name, per_site, batch) -> torch.Tensor:
    return torch.stack([per_site[i] for i, (n, _) in enumerate(flat) if n == name], 1)


def estimate(model, kc, kx, dec, dmask, tgts, names, method: str, rules, call: Call) -> PatchingResult:
    """``"relp"`` / ``"atp"``: ``(a_corrupt − a_clean) · ∂metric/∂a`` at the clean run,
    the gradient under ``rules`` for ``"relp"``, plain for ``"atp"``."""
    flat = sites(model, names)
    caller, enc_entry, dec_entry = call.caller, call.enc_entry, call.dec_entry
    with core.attribution_pass(model, rules, False, caller) as cov:
        # the stacks' entries made leaves, so every site downstream is in the graph
        with core.tap(enc_entry, "input", leaf, once=True), core.tap(dec_entry, "input", leaf, once=True):
            value, acts_c, fixed = _run(model, kc, dec, dmask, tgts, flat, True, call)
        missing = [flat[i][1].path for i, a in enumerate(acts_c) if a is None]
        if missing:
            raise ValueError(f"{caller}(): the node {missing[0]!r} was not reached during the forward pass")
        grads = torch.autograd.grad(value, acts_c, torch.ones_like(value), allow_unused=True)
        value = value.detach()
        with torch.no_grad():
            value_x, acts_x, _ = _run(model, kx, kx["decoder_input_ids"], dmask, fixed, flat, True, call)
    per_site = []
    for i, (name, s) in enumerate(flat):
        diff = acts_x[i].detach().float() - acts_c[i].detach().float()
        est = torch.zeros_like(diff) if grads[i] is None else diff * grads[i].float()
        est = _reduce(est, s)
        keep = _valid(kc, dec, dmask, name.split(".")[0]).to(est.device)
        per_site.append(torch.where(keep.view(*keep.shape, *([1] * (est.dim() - 2))), est, torch.zeros_like(est)))
    effects = {n: _stack(flat, n, per_site, dec.shape[0]) for n in names}
    return PatchingResult(effects=effects, dims={n: _dims(n) for n in names}, clean_metric=value.double(),
                          corrupt_metric=value_x.double(), method=method,
                          rules=rules if method == "relp" else None, coverage=cov if method == "relp" else None)


def _copies(kwargs, row: int, n: int) -> dict:
    return {k: (v[row:row + 1].expand(n, *v.shape[1:]) if isinstance(v, torch.Tensor) and v.dim() >= 1 else v)
            for k, v in kwargs.items()}


def _check_copies(model, reference: torch.Tensor, clean_value: float, row: int, n: int) -> None:
    """Exact patching runs each row as copies of itself: a metric that reads other rows of
    its batch (a callable centred on the batch mean) gives other numbers there, refused."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tol = max(1e-4, 16 * torch.finfo(dtype).eps) * max(1.0, abs(clean_value))
    if not bool(torch.isfinite(reference).all()) or float((reference.double() - clean_value).abs().max()) > tol:
        raise ValueError(
            f"metric: on {n} copies of clean row {row} it gives {reference[:3].tolist()}…, but {clean_value} on the "
            "batch; activation patching runs each row as copies of itself, so a callable metric must compute each "
            "row from that row alone. For per-row ids use a pyattr.targets target (Logit(ids), LogitDiff(a, b)), "
            "which follows the rows")


def exact(model, kc, kx, dec, dmask, tgts, names, batch_size: int, call: Call) -> PatchingResult:
    """Each node's effect: the metric of a copy of the clean row with that node's
    activation (at one position, one head or neuron) taken from the corrupt run, minus
    the metric of an unpatched copy in a forward of as many copies (so identical clean and
    corrupt give exactly 0)."""
    flat = sites(model, names)
    batch = dec.shape[0]
    with torch.no_grad(), core.inference_state(model):
        value, acts_c, fixed = _run(model, kc, dec, dmask, tgts, flat, True, call)
        value_x, _, _ = _run(model, kx, kx["decoder_input_ids"], dmask, fixed, flat, False, call)
        widths = [a.shape[-1] for a in acts_c]
        del acts_c
        out: Dict[int, torch.Tensor] = {}
        for i, (name, s) in enumerate(flat):
            units = s.heads if s.node == "heads" else widths[i] if s.node == "neurons" else 0
            seq = kc["input_ids"].shape[1] if name.startswith("encoder") else dec.shape[1]
            out[i] = torch.zeros((batch, seq) + ((units,) if units else ()), dtype=torch.float64)
        for row in range(batch):
            jobs = []
            for i, (name, s) in enumerate(flat):
                valid = _valid(kc, dec, dmask, name.split(".")[0])[row]
                units = out[i].shape[2] if out[i].dim() == 3 else 0
                for p in valid.nonzero().flatten().tolist():
                    jobs += [(i, p, u) for u in (range(units) if units else [-1])]
            cache: Dict[int, tuple] = {}
            for start in range(0, len(jobs), batch_size):
                chunk = jobs[start:start + batch_size]
                n = len(chunk)
                if n not in cache:
                    kc_n, kx_n = _copies(kc, row, n), _copies(kx, row, n)
                    tg = [t.rows(torch.full((n,), row), batch) for t in fixed]
                    ref, _, _ = _run(model, kc_n, kc_n["decoder_input_ids"], kc_n.get("decoder_attention_mask"), tg,
                                     flat, False, call)
                    _check_copies(model, ref, float(value[row]), row, n)
                    _, src, _ = _run(model, kx_n, kx_n["decoder_input_ids"], kx_n.get("decoder_attention_mask"), tg,
                                     flat, True, call)
                    cache[n] = (ref, src, kc_n, tg)
                ref, src, kc_n, tg = cache[n]
                by_site: Dict[int, List[Tuple[int, int, int]]] = {}
                for j, (i, p, u) in enumerate(chunk):
                    by_site.setdefault(i, []).append((j, p, u))

                def patch(i, by_site=by_site, src=src):
                    if i not in by_site:
                        return None

                    def fn(t):
                        new = t.clone()
                        for j, p, u in by_site[i]:
                            w = width_slice(flat[i][1], t.shape[-1], u)
                            new[j, p, w] = src[i][j, p, w].to(t.dtype)
                        return new
                    return fn

                vals, _, _ = _run(model, kc_n, kc_n["decoder_input_ids"], kc_n.get("decoder_attention_mask"), tg,
                                  flat, False, call, patch)
                eff = (vals.double() - ref.double()).cpu()
                for j, (i, p, u) in enumerate(chunk):
                    out[i][(row, p) + ((u,) if u >= 0 else ())] = eff[j]
    per_site = [out[i] for i in range(len(flat))]
    effects = {n: _stack(flat, n, per_site, batch).float() for n in names}
    return PatchingResult(effects=effects, dims={n: _dims(n) for n in names}, clean_metric=value.double(),
                          corrupt_metric=value_x.double(), method="exact")


def patching(model, clean, corrupt, metric, nodes, method: str, caller: str, *, rules=None, sum_positions=False,
             alignment=None, attention_mask=None, corrupt_attention_mask=None, decoder_input_ids=None,
             corrupt_decoder_input_ids=None, decoder_attention_mask=None, tokenizer=None,
             batch_size: Optional[int] = None, unsupported: Sequence[Tuple[str, object]] = ()) -> PatchingResult:
    """The encoder–decoder path of ``caller`` (``method`` ``"exact"`` for activation
    patching; ``rules``: the estimate's, resolved by the caller); ``unsupported``: the
    caller's other arguments, refused by name where set."""
    from pyattr.methods._core.stacks import is_encoder_decoder

    if not is_encoder_decoder(model):
        raise ValueError(f"decoder_input_ids / corrupt_decoder_input_ids / decoder_attention_mask: "
                         f"{type(model).__name__} is not an encoder–decoder model (config.is_encoder_decoder is "
                         "false)")
    if method != "exact" and method not in SEQ2SEQ_METHODS:
        raise ValueError(f"method: on an encoder–decoder model {caller} runs {list(SEQ2SEQ_METHODS)} (and "
                         f"activation_patching exactly), not {method!r} yet")
    for name, value in (("alignment", alignment),) + tuple(unsupported):
        if value is not None:
            raise ValueError(f"{name}: not supported on encoder–decoder models yet (clean and corrupt line up "
                             "position by position on each stack)")
    if not isinstance(sum_positions, bool):
        raise TypeError(f"sum_positions must be a bool, got {sum_positions!r}")
    if sum_positions and method == "exact":
        raise ValueError("sum_positions: activation patching on an encoder–decoder model patches one position at a "
                         "time; sum_positions=True is supported by attribution_patching's estimates")
    names = check_nodes(nodes)
    if metric is None:
        raise ValueError("metric is required: a callable(output) -> Tensor[batch] or a pyattr.targets target")
    kc, kx, dec, dmask = prepare(model, clean, corrupt, attention_mask, corrupt_attention_mask, decoder_input_ids,
                                 corrupt_decoder_input_ids, decoder_attention_mask, caller, tokenizer)
    from pyattr.methods.seq2seq import _words_to_ids

    tgts, several = T.normalize(_words_to_ids(metric, tokenizer), dec.shape[0])
    if several:
        raise ValueError("metric must be one target (one value per row), not k targets")
    # one stack's targets (refused before any forward); the encoder's entry, found once
    call = Call(*SI.entries(model, caller)[1], ST.side_of(model, tgts, caller), caller)
    from pyattr.methods._core.text import token_strings

    if method == "exact":
        res = exact(model, kc, kx, dec, dmask, tgts, names, core.check_count("batch_size", batch_size) or 32, call)
    else:
        res = estimate(model, kc, kx, dec, dmask, tgts, names, method, rules, call)
    if sum_positions:
        res.effects = {n: e.sum(2) for n, e in res.effects.items()}
        res.dims = {n: d[:2] + d[3:] for n, d in res.dims.items()}
    if tokenizer is not None:  # as the one-stack results write them (" Paris")
        res.tokens = token_strings(tokenizer, kc["input_ids"].cpu(), kc.get("attention_mask"))
        res.decoder_tokens = token_strings(tokenizer, dec.cpu(), None if dmask is None else dmask.cpu())
    return res
