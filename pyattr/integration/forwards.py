"""The rule forwards the planner mounts: norms, activations, gated and fused gated MLPs, MoE
routers and experts, heads and the attention q/k/v scalings, each a factory of the
replacement ``forward`` of one module instance."""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

import pyattr._function as _function
import pyattr.architectures as A
from pyattr._module_forward import forward_name, forward_of, nnsight_controller, nnsight_tracing
from pyattr.activations import Activation, forward_fn, phi
from pyattr.integration.errors import (
    RelevanceRuleConflictError,
    RelevanceRuleUnsupportedError,
)
from pyattr.integration.gated_memory import MLPParts, native_instead
from pyattr.integration.install import (
    has_hooks,
    per_column_scale,
)
from pyattr.ops.gated import gated_activation
from pyattr.ops.layer_norm import layer_norm
from pyattr.ops.rms_norm import rms_norm
from pyattr.rules.identity import apply_identity_rule
from pyattr.rules.scale import scale_gradient


@dataclass
class Step:
    module: nn.Module
    path: str
    kind: str
    value: Any
    make_forward: Callable
    check_output: bool
    # rebuilt forwards (the module's own is bypassed): checked against it once per scope
    verify: Optional[Callable] = None


#: set on a module (a count) while one of pyattr's own methods taps its input or output
TAPPED = "_pyattr_tapped"


def bypass_message(path: str, act: str = "act_fn", module: Optional[nn.Module] = None) -> str:
    if module is not None and module.__dict__.get(TAPPED):
        return (
            f"{path + '.' + act!r}: the method reads or replaces this module's output (its layer or node "
            f"argument), but under the gated-activation rule act(gate)·up runs as one op and {act} never "
            f"runs; name the MLP ({path!r}) or its projections instead, or switch off activation and "
            "multiplicative_gate"
        )
    return (
        f"{path + '.' + act!r} has hooks, but the gated-activation rule computes act(gate)·up "
        "in one op and would bypass them; remove the hooks or switch off activation and "
        "multiplicative_gate"
    )


#: module -> the states (:func:`_checked_on`) its rebuilt forwards were checked on: a check
#: holds across scopes while nothing it ran on changed (on a 1B model the two-row forwards
#: of the 16 MLPs cost 0.2 s, per call, when they ran in every scope)
_VERIFIED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _checked_on(module: nn.Module, rule: tuple, x: torch.Tensor) -> tuple:
    """What a check's verdict depends on: the rule forward (its kind and setting), each
    submodule, the forward it runs now (a forward replaced on an instance, pyattr's own
    seen through) and its other public attributes (a plain value as it is, an activation
    function or any other object by identity), each parameter and buffer (the object, its
    storage, dtype, device, shape, whether it requires grad) and the input's dtype, device
    and gradient mode."""
    def attrs(m):
        return tuple((k, v if isinstance(v, (bool, int, float, str, type(None))) else id(v))
                     for k, v in vars(m).items() if not k.startswith("_") and k != "forward")

    def fn(m):  # by identity and code: a closure over the module kept here would keep it alive
        f = forward_of(m)
        return id(f), getattr(f, "__code__", None) or getattr(getattr(f, "__func__", None), "__code__", None)

    mods = tuple((id(m), type(m), fn(m), attrs(m)) for m in module.modules())
    tensors = tuple((id(t), t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.requires_grad)
                    for t in (*module.parameters(), *module.buffers()))
    return (rule, mods, tensors, x.dtype, x.device, x.requires_grad and torch.is_grad_enabled())


def _no_dispatch_modes():
    """The dispatch modes active now (selective checkpointing's cache) set aside for the block,
    where this torch can (its private ``_disable_current_modes``); else nothing changes."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:
        return contextlib.nullcontext()
    return _disable_current_modes()


def _is_fake(x: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return bool(is_fake(x))


def verify_rebuilt(path: str, rule: tuple = ()):
    """The check of a rebuilt forward (a gated MLP's, a head's: pyattr computes what the
    module's own forward would, through the rule ops): on the first call of the scope, the
    rebuilt forward and the module's own (whatever it is now: a forward replaced on the
    instance included) run on the first and last rows of that call's input, and must agree
    bit for bit, else :class:`RelevanceRuleUnsupportedError`. Rows, not the whole input:
    both forwards are row-wise (a plain gated MLP, a head: checked on their source), so two
    rows show a different form, activation or weight at the cost of two rows; hooks of the
    module's submodules are held back meanwhile (a capture records no extra call). A check
    that passed is kept for the module (``rule``: the rule forward's kind and setting) and
    not repeated in later scopes while nothing it ran on changed (:func:`_checked_on`).
    Returns True once checked, False when the call has no rows to check (the next call is)."""
    def verify(module, state, fwd, args, kwargs) -> bool:
        x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.numel() == 0 or not x.is_floating_point():
            return False
        if x.is_meta or _is_fake(x):  # a shape-only run (meta, a fake-tensor trace) has no values to compare
            return False
        key = _checked_on(module, rule, x)
        seen = _VERIFIED.setdefault(module, set())
        if key in seen:
            return True
        # The two rows run as the call itself does (grad mode, an input that requires grad
        # where the call's does): a module may take another path without gradient, and
        # bitsandbytes' Linear4bit even repacks its weight for CPU inference for good. What
        # they save goes to a hook of their own: an activation checkpoint counts what the
        # forward saves, and its recomputation runs no check.
        # Under torch.func's transforms (which take no saved-tensor hooks) the rows run without
        # gradient, where nothing is saved.
        # Outside any dispatch mode too: selective activation checkpointing's records every op
        # the forward runs, and its recomputation runs no check.
        transformed = torch._C._are_functorch_transforms_active()
        with contextlib.nullcontext() if transformed else torch.autograd.graph.saved_tensors_hooks(_keep, _keep), \
                _submodule_hooks_held(module), torch.no_grad() if transformed else contextlib.nullcontext(), \
                _no_dispatch_modes():
            with torch.no_grad():
                rows = x.detach().reshape(-1, x.shape[-1])
                xs = rows[sorted({0, rows.shape[0] - 1})]
            if x.requires_grad and torch.is_grad_enabled():
                xs.requires_grad_()
            if args:
                want, have = state.native(xs, *args[1:], **kwargs), fwd(xs, *args[1:], **kwargs)
            else:
                key = next(k for k, v in kwargs.items() if v is x)
                want, have = state.native(**{**kwargs, key: xs}), fwd(**{**kwargs, key: xs})
        want, have = _first_tensor(want), _first_tensor(have)
        want, have = (t.detach() if isinstance(t, torch.Tensor) else t for t in (want, have))
        same = (isinstance(want, torch.Tensor) and isinstance(have, torch.Tensor) and want.shape == have.shape
                and want.dtype == have.dtype and bool(((want == have) | (want.isnan() & have.isnan())).all()))
        if not same:
            diff = ""
            if isinstance(want, torch.Tensor) and isinstance(have, torch.Tensor) and want.shape == have.shape:
                diff = f" (max |difference| {float((want.double() - have.double()).abs().max()):.3g} on two rows)"
            raise RelevanceRuleUnsupportedError(
                f"{path!r}: the forward pyattr rebuilt to carry the rules does not compute what "
                f"{forward_name(module)} computes{diff}; the rules would change the model's output. Restore the "
                "module's own forward, or switch off the rules placed on it")
        seen.add(key)
        return True

    return verify


def _keep(t):
    return t


def _first_tensor(out):
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return out


@contextlib.contextmanager
def _submodule_hooks_held(module: nn.Module):
    """The forward hooks of ``module``'s submodules emptied for the block (a check's extra
    calls must not reach a capture or a user's hook), then put back as they were; so are
    nnsight's controllers (its ``.input`` / ``.output`` / ``.grad`` in a trace would bind to
    the check's calls): each submodule runs the body its controller runs, directly."""
    held, parked = [], []
    for m in module.modules():
        if m is module:
            continue
        for name in ("_forward_hooks", "_forward_pre_hooks"):
            hooks = getattr(m, name, None)
            if hooks:
                held.append((hooks, dict(hooks)))
                hooks.clear()
        ctrl = nnsight_controller(m)
        if ctrl is not None:
            parked.append((m, ctrl))
            m.__dict__["forward"] = functools.partial(ctrl.state.body, m)
    try:
        yield
    finally:
        for hooks, saved in held:
            hooks.update(saved)
        for m, ctrl in parked:
            m.__dict__["forward"] = ctrl


def norm_eps(module: nn.Module, path: str) -> float:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, (int, float)) and not isinstance(eps, bool):
            return float(eps)
    raise RelevanceRuleUnsupportedError(f"{path!r}: norm module has no numeric eps / variance_epsilon")


def rms_forward(offset: float, eps: float):
    def make(module, state):
        native = state.native

        def forward(x):
            return rms_norm(x, module.weight, eps, offset, _native=native)

        return forward

    return make


def layer_norm_forward(eps: float):
    def make(module, state):
        native = state.native

        def forward(x):
            return layer_norm(x, module.weight, module.bias, eps, _native=native)

        return forward

    return make


def activation_forward(kind: str):
    def make(module, state):
        # in-place modules (nn.ReLU(inplace=True)) run out of place, as the saved input
        # must survive; otherwise the module's own forward, without its __call__
        inplace = kind != "custom" and getattr(module, "inplace", False)
        act = Activation(kind, forward_fn(module, kind) if inplace else state.native)

        def forward(x):
            return apply_identity_rule(x, act)

        return forward

    return make


_GATED_NAMES = ("gate_proj", "up_proj", "down_proj", "act_fn")


@_function.second_order_checked
class _IdentityOfOutput(torch.autograd.Function):
    """``a`` (an activation's output, as its module computed it from ``g``) carrying the
    Identity-rule to ``g``: ``dg = φ·dy`` with ``φ = a/g`` (where ``g = 0``, the activation's
    own φ(0), :func:`pyattr.activations.phi`: ½, a ReLU's 0), and ``dy`` itself to ``a``
    (whose own graph starts from a detached copy of ``g``)."""

    @staticmethod
    def forward(ctx, g, a, act):
        ctx.save_for_backward(g, a)
        ctx.act = act
        return a.view_as(a)

    @staticmethod
    def backward(ctx, dy):
        g, a = ctx.saved_tensors
        zero = g == 0
        at_zero = phi(torch.zeros((), dtype=torch.float32 if g.dtype != torch.float64 else g.dtype), ctx.act)
        phi_ = torch.where(zero, at_zero.to(a.dtype), a / torch.where(zero, torch.ones_like(g), g))
        return dy * phi_, dy, None


def _gated_in_trace(act_mod, act: Activation, g, u, identity: bool, half: bool):
    """``act(g)·u`` under the Identity- and Half-rules with the activation module called
    through its nnsight controller: a trace's ``.input`` / ``.output`` / ``.grad`` of the
    activation see its real call, and an edit of its output is what the rules act on (the
    Identity-rule of what it computes). Forward values are the module's own, bit for bit."""
    if identity:
        a = _IdentityOfOutput.apply(g, act_mod(g.detach().requires_grad_(g.requires_grad)), act)
    else:
        a = act_mod(g)
    if half:
        return scale_gradient(a, 0.5) * scale_gradient(u, 0.5)
    return a * u


def gated_forward(kind: str, path: str, names=_GATED_NAMES):
    """``down(act(gate(x)) * up(x))`` through the fused gated op; ``names`` are the MLP's
    (gate, up, down, act) attributes."""
    def make(mlp, state):
        gate, up, down, act_mod = parts = tuple(getattr(mlp, n) for n in names)
        # The module's own forward (bit-identical values) without its __call__: the
        # activation's hooks would be bypassed, which is checked at install and at each call.
        act = Activation(kind, forward_fn(act_mod, kind) if kind != "custom" else act_mod.forward)
        held = MLPParts(mlp, dict(zip(names, parts)), names[3])

        def forward(x):
            identity, half = state.active("activation"), state.active("multiplicative_gate")
            if native_instead(state, held, identity or half):
                return state.native(x)
            if has_hooks(act_mod):
                raise RelevanceRuleConflictError(bypass_message(path, names[3], act_mod))
            if nnsight_tracing(act_mod):  # the fused op would bypass the trace's view of act
                return down(_gated_in_trace(act_mod, act, gate(x), up(x), identity, half))
            return down(gated_activation(gate(x), up(x), act, identity=identity, half=half))

        return forward

    return make


FusedGatedForm = A.FusedGatedForm  # the forms live in the architecture table


def gated_fused_forward(kind: str, path: str, form: FusedGatedForm):
    """``down(drop(act(a)·b))`` with ``a, b = proj(x).chunk(2)`` through the fused op.
    The product is commutative in floating point (Phi-3 writes ``b * act(a)``), so the
    values are bit-identical."""
    def make(mlp, state):
        act_mod = getattr(mlp, form.act)
        act = Activation(kind, forward_fn(act_mod, kind) if kind != "custom" else act_mod.forward)
        proj, down = getattr(mlp, form.proj), getattr(mlp, form.down)
        drop = getattr(mlp, form.drop) if form.drop else None
        names = (form.proj, form.down, form.act) + ((form.drop,) if form.drop else ())
        held = MLPParts(mlp, {n: getattr(mlp, n) for n in names}, form.act)

        def forward(x):
            identity, half = state.active("activation"), state.active("multiplicative_gate")
            if native_instead(state, held, identity or half):
                return state.native(x)
            if has_hooks(act_mod):
                raise RelevanceRuleConflictError(bypass_message(path, form.act, act_mod))
            a, b = proj(x).chunk(2, dim=-1)
            if nnsight_tracing(act_mod):  # the fused op would bypass the trace's view of act
                h = _gated_in_trace(act_mod, act, a, b, identity, half)
            else:
                h = gated_activation(a, b, act, identity=identity, half=half)
            return down(h if drop is None else drop(h))

        return forward

    return make


def is_experts_dispatcher(fn) -> bool:
    """``fn`` is transformers' ``use_experts_implementation`` forward (it dispatches to the
    configured implementation, which calls ``self._apply_gate``), not a forward of its own."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.replace("\\", "/").endswith("transformers/integrations/moe.py")


def router_forward():
    """The router's (logits, routing weights, expert indices) with the weights detached:
    the frozen routing rule (the selected experts and the forward are unchanged)."""
    def make(router, state):
        native = state.native

        def forward(*args, **kwargs):
            logits, weights, index = native(*args, **kwargs)
            return logits, weights.detach(), index

        return forward

    return make


def experts_forward(kind: str):
    """The experts' own (dispatched) forward, with their gate ``act(gate)·up`` computed by
    the fused gated_activation op: every non-eager experts implementation of transformers
    calls ``self._apply_gate(gate_up)``, so an instance attribute set for the call takes
    its place. The product is commutative, so the values are bit-identical."""
    def make(experts, state):
        native = state.native
        act = Activation(kind, forward_fn(experts.act_fn, kind) if kind != "custom" else experts.act_fn.forward)

        def apply_gate(gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return gated_activation(gate, up, act, identity=state.active("activation"),
                                    half=state.active("multiplicative_gate"))

        def forward(*args, **kwargs):
            experts.__dict__["_apply_gate"] = apply_gate
            try:
                return native(*args, **kwargs)
            finally:
                experts.__dict__.pop("_apply_gate", None)

        return forward

    return make


def head_forward(act: Activation):
    """RoBERTa's masked-LM head, ``decoder(layer_norm(gelu(dense(x))))``, with the
    Identity-rule on the gelu it calls as a function (the LayerNorm is mounted itself)."""
    def make(head, state):
        def forward(features, **kwargs):
            x = head.dense(features)
            x = apply_identity_rule(x, act)
            x = head.layer_norm(x)
            return head.decoder(x)

        return forward

    return make


def projection_forward(scale: float):
    def make(module, state):
        native = state.native

        def forward(*args, **kwargs):
            out = native(*args, **kwargs)
            if scale == 0.0:
                return out.detach()
            return scale_gradient(out, scale)

        return forward

    return make


def fused_projection_forward(pattern: Callable[[int], torch.Tensor]):
    def make(module, state):
        native = state.native
        cache: dict = {}

        def forward(*args, **kwargs):
            out = native(*args, **kwargs)
            return scale_gradient(out, per_column_scale(out, pattern, cache))

        return forward

    return make


ATTN_SCALES = {"frozen": (0.0, 0.0, 1.0), "attnlrp": (0.25, 0.25, 0.5)}


def concat_pattern(scales):
    def pattern(n: int) -> torch.Tensor:
        if n % 3:
            raise RelevanceRuleUnsupportedError(f"fused q/k/v projection of width {n} is not divisible by 3")
        return torch.tensor(scales, dtype=torch.float32).repeat_interleave(n // 3)

    return pattern


def split_pattern(scales, widths):
    """q | k | v of the given widths (GQA: k and v narrower than q)."""
    def pattern(n: int) -> torch.Tensor:
        if n != sum(widths):
            raise RelevanceRuleUnsupportedError(
                f"fused q/k/v projection of width {n}, expected q {widths[0]} + k {widths[1]} + v {widths[2]}"
            )
        return torch.cat([torch.full((w,), s, dtype=torch.float32) for s, w in zip(scales, widths)])

    return pattern


def per_head_pattern(scales, head_size: int):
    def pattern(n: int) -> torch.Tensor:
        if n % (3 * head_size):
            raise RelevanceRuleUnsupportedError(
                f"fused q/k/v projection of width {n} is not a multiple of 3 × head_size {head_size}"
            )
        one = torch.tensor(scales, dtype=torch.float32).repeat_interleave(head_size)
        return one.repeat(n // (3 * head_size))

    return pattern
