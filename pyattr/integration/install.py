"""Instance-level forward patches with per-(module, kind) reference counts.

A patch sets ``module.forward`` on the instance (never the class), remembers what was
there, and is undone when the last scope holding any rule kind on that module exits.
On a module carrying an accelerate hook (``cpu_offload``, ``dispatch_model``,
``from_pretrained(device_map=...)``) the patch takes the place of ``_old_forward``
instead: accelerate's ``forward`` wrapper must keep running around the rule forward,
because its ``pre_forward`` is what brings offloaded weights in from the CPU or the disk
(bypassing it leaves ``weight`` on the ``meta`` device).
The state lives on the instance itself (``module._pyattr_rules``), so two models, or
two modules of one class, never share it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from pyattr._module_forward import nnsight_controller
from pyattr.integration.errors import RelevanceRuleConflictError
from pyattr.integration.output_check import Output, takes_rule_gradient

_STATE = "_pyattr_rules"
#: the kind of the gated MLP's memory mount (pyattr.integration.gated_memory): a patch
#: that is not a rule (the fused gated op with the ordinary gradient)
GATED_MEMORY = "gated_memory"
# open scopes running functional rules (pyattr.integration.functional); while any is open a
# rule forward counts its depth, so that those rules leave what pyattr's own forwards compute
FUNCTIONAL_SCOPES = [0]
_rule_forward = threading.local()


def in_rule_forward() -> bool:
    """True while a rule forward pyattr installed is running (in this thread)."""
    return getattr(_rule_forward, "depth", 0) > 0
MISSING = object()  # an instance attribute that was absent


#: the slot of a module nnsight instrumented: its instance forward is nnsight's
#: ``Controller``, which calls ``state.body(module, *args)`` (the class's forward) inside
#: a trace and out of it; the rule forward goes there, so ``.input`` / ``.output`` and
#: ``.grad`` in a trace see the module as it runs under the rules
NNSIGHT = "nnsight body"


def forward_slot(module: nn.Module) -> str:
    """Where the module's own forward is called from: nnsight's controller body
    (:data:`NNSIGHT`) on a module nnsight wraps, ``_old_forward`` under an accelerate hook
    (its wrapper calls ``module._old_forward`` at each call), else ``forward``."""
    if nnsight_controller(module) is not None:
        return NNSIGHT
    if "_old_forward" in module.__dict__ and hasattr(module, "_hf_hook"):
        return "_old_forward"
    return "forward"


class _Body:
    """A rule forward where nnsight's controller calls the body: ``body(module, *args)``."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, module, *args, **kwargs):
        return self.fn(*args, **kwargs)


def read_slot(module: nn.Module, slot: str):
    """What ``slot`` holds (``MISSING`` when the instance has nothing there); a rule forward
    in nnsight's body reads as the rule forward itself."""
    if slot == NNSIGHT:
        ctrl = nnsight_controller(module)
        body = ctrl.state.body if ctrl is not None else MISSING
        return body.fn if isinstance(body, _Body) else body
    return module.__dict__.get(slot, MISSING)


def _raw_slot(module: nn.Module, slot: str):
    """What ``slot`` holds as it is (nnsight's body object itself), for putting it back."""
    if slot == NNSIGHT:
        ctrl = nnsight_controller(module)
        return ctrl.state.body if ctrl is not None else MISSING
    return module.__dict__.get(slot, MISSING)


def _set_raw_slot(module: nn.Module, slot: str, value) -> None:
    if slot == NNSIGHT:
        ctrl = nnsight_controller(module)
        if ctrl is not None and value is not MISSING:
            ctrl.state.body = value
    elif value is MISSING:
        module.__dict__.pop(slot, None)
    else:
        module.__dict__[slot] = value


def write_rule_forward(module: nn.Module, slot: str, fn: Callable) -> None:
    if slot == NNSIGHT:
        nnsight_controller(module).state.body = _Body(fn)
    else:
        module.__dict__[slot] = fn


def slot_forward(module: nn.Module, slot: str) -> Callable:
    """The callable the slot runs now, taking the forward's own arguments."""
    if slot == NNSIGHT:
        return functools.partial(nnsight_controller(module).state.body, module)
    return getattr(module, slot)


class RuleState:
    """Per-module record: active kinds with their counts and settings, and the original forward."""

    def __init__(self, module: nn.Module, path: str, make_forward: Callable = None, check_output: bool = True,
                 verify: Optional[Callable] = None):
        self.path = path
        self.make_forward = make_forward
        self.check_output = check_output
        # a rebuilt forward's check against the module's own, run on the first call of the
        # scope (the state lives as long as the outermost scope holding the module)
        self.verify = verify
        self.counts: Dict[str, int] = {}
        self.values: Dict[str, object] = {}
        self.slot = forward_slot(module)
        self.saved_forward = read_slot(module, self.slot)
        self.native: Callable = slot_forward(module, self.slot)
        self.hook = None
        self.patched: Optional[Callable] = None
        # per thread (a no_grad forward in another thread runs between a call and its check):
        # the id of the output the rule forward returned and what the check keeps of it
        self.expected: Dict[threading.Thread, tuple] = {}
        # a gated MLP's rebuilt forward that its first-call check found differing from the
        # module's own, under the memory mount alone (pyattr.integration.forwards.lenient)
        self.mismatch: Optional[Exception] = None
        # that check put off for this call (the module's own forward runs it)
        self.deferred = False
        # the threads whose scopes hold the rules (thread -> references; the object, not its
        # ident, which a later thread may reuse): the module is shared by every thread, its
        # rules are not (:func:`_other_thread`)
        self.threads: Dict[threading.Thread, int] = {}

    def __deepcopy__(self, memo):
        what = ("it runs through pyattr's fused gated op (the memory mount of rules that leave the gated rules off)"
                if set(self.counts) == {GATED_MEMORY} else "relevance rules are installed on it")
        raise RelevanceRuleConflictError(
            f"cannot copy {self.path!r} while {what}: the copy would "
            "keep the rule patch bound to the original module. Copy the model outside the "
            "use_relevance_rules scope."
        )

    def __reduce__(self):
        raise RelevanceRuleConflictError(
            f"cannot pickle {self.path!r} while relevance rules are installed on it; "
            "save the model outside the use_relevance_rules scope"
        )

    def expected_id(self) -> Optional[int]:
        """The id of the output this thread's last rule forward returned, not yet checked."""
        got = self.expected.get(threading.current_thread())
        return None if got is None else got[0]

    def replace_expected(self, out) -> None:
        """pyattr's own replacement of the output (a method's tap): the check takes it."""
        self.expected[threading.current_thread()] = (id(out), None)

    def active(self, kind: str) -> bool:
        return self.counts.get(kind, 0) > 0

    def value(self, kind: str):
        return self.values.get(kind)


def state_of(module: nn.Module) -> Optional[RuleState]:
    return module.__dict__.get(_STATE)


class ScopeHook:
    """A hook pyattr registers for a scope: calls ``fn``. Pickling it, with the module or the
    model that holds it, raises :class:`RelevanceRuleConflictError` naming ``what`` (a local
    function there failed with pickle's own message about the function); ``copy.deepcopy``
    keeps it, as it keeps a function, so a copy is refused by the rule's state instead."""

    def __init__(self, fn: Callable, what: str):
        self.fn = fn
        self.what = what

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise RelevanceRuleConflictError(
            f"cannot pickle {self.what} while relevance rules are installed on it; save the model outside "
            "the use_relevance_rules scope"
        )


def _output_check(state: RuleState):
    def hook(module, args, output):
        if torch.compiler.is_compiling():  # object identity is not traced; eager checks it
            return
        expected, old = state.expected.pop(threading.current_thread(), (None, None))
        if expected is None or id(output) == expected:
            return
        if old is not None and takes_rule_gradient(output, old):
            return  # a copy or a function of the rule's output (Captum's layer hooks), or a new leaf
        raise RelevanceRuleConflictError(
            f"a forward hook on {state.path!r} replaced the output of a module that carries a "
            "relevance rule with a value that is not a function of that output alone (with constants and "
            "parameters): its gradient could reach the model's inputs around the rule's backward, which would "
            "silently not apply. Return the output, a function of it (a clone, a scaled or steered copy) or a new "
            "leaf, or hook another module."
        )

    return ScopeHook(hook, repr(state.path))


def acquire(
    module: nn.Module,
    path: str,
    kind: str,
    value,
    make_forward: Callable[[nn.Module, RuleState], Callable],
    check_output: bool,
    verify: Optional[Callable] = None,
) -> None:
    """Add one reference to rule ``kind`` (with setting ``value``) on ``module``.

    The first reference on a module installs ``make_forward(module, state)`` as its
    forward. A second scope asking for the same kind with another setting raises
    :class:`RelevanceRuleConflictError`.
    """
    state = state_of(module)
    if state is not None and _other_thread(state) and not getattr(_local, "recomputing", 0):
        raise RelevanceRuleConflictError(
            f"{path!r} carries relevance rules from a use_relevance_rules scope open in another thread; a "
            f"scope here would run with them. {ONE_THREAD}")
    if state is None:
        state = RuleState(module, path, make_forward, check_output, verify)
        fwd = make_forward(module, state)

        def patched(*args, **kwargs):
            if _unbound_recomputation():
                # an activation-checkpoint recomputation, during a backward, of a forward
                # that ran without rules: it must run as it did then
                return state.native(*args, **kwargs)
            if not torch.compiler.is_compiling() and torch.is_grad_enabled() and _other_thread(state) \
                    and not _in_backward():  # (the thread is not traced: compiled code runs in its caller's)
                raise RelevanceRuleConflictError(
                    f"{state.path!r} runs in a thread that opened no use_relevance_rules scope on it, while a scope "
                    f"in another thread holds relevance rules on it; its gradient would silently carry that "
                    f"scope's rules. {ONE_THREAD}")
            if state.verify is not None and not torch.compiler.is_compiling() \
                    and state.verify(module, state, fwd, args, kwargs):
                state.verify = None  # checked: once per scope
            if FUNCTIONAL_SCOPES[0]:  # a generic scope's functional rules stay out of a rule forward
                _rule_forward.depth = getattr(_rule_forward, "depth", 0) + 1
                try:
                    out = fwd(*args, **kwargs)
                finally:
                    _rule_forward.depth -= 1
            else:
                out = fwd(*args, **kwargs)
            if check_output and not torch.compiler.is_compiling():
                state.expected[threading.current_thread()] = (id(out), Output(out))
                # keep the check last, after hooks registered inside the scope too
                if state.hook is not None:
                    hooks = module._forward_hooks
                    if state.hook.id in hooks and next(reversed(hooks), None) != state.hook.id:
                        hooks.move_to_end(state.hook.id)
            return out

        module.__dict__[_STATE] = state
        write_rule_forward(module, state.slot, patched)
        state.patched = patched
        if check_output:
            # Appended last: hooks registered before the scope run first, so one that
            # returns a replacement output is seen here.
            state.hook = module.register_forward_hook(_output_check(state))
    if kind in state.counts:
        if state.values[kind] != value:
            raise RelevanceRuleConflictError(
                f"{path!r} already carries the {kind} rule with setting {state.values[kind]!r}; "
                f"a nested scope asked for {value!r}"
            )
        state.counts[kind] += 1
    else:
        state.counts[kind] = 1
        state.values[kind] = value
    hold(state.threads)


ONE_THREAD = ("Rules are set on the model's modules, which every thread shares: use the model from one thread "
               "while a scope is open on it, or give each thread its own copy of the model.")


def hold(holders: Dict[threading.Thread, int], me: Optional[threading.Thread] = None) -> threading.Thread:
    """One more scope of this thread (or ``me``) in ``holders`` (thread → scopes); returns it.
    Keyed by the thread object: a later thread may reuse an ended one's ident."""
    me = threading.current_thread() if me is None else me
    holders[me] = holders.get(me, 0) + 1
    return me


def unhold(holders: Dict[threading.Thread, int], me: Optional[threading.Thread] = None) -> None:
    """One scope fewer: this thread's (or ``me``'s), else, for a scope left from another thread
    than the one that opened it, any holder's."""
    me = threading.current_thread() if me is None else me
    holder = me if me in holders else next(iter(holders), None)
    if holder is not None:
        holders[holder] -= 1
        if holders[holder] <= 0:
            del holders[holder]


def _other_thread(state: RuleState) -> bool:
    """Whether the rules on the module are held by scopes of other threads only."""
    return bool(state.threads) and threading.current_thread() not in state.threads


def release(module: nn.Module, kind: str) -> None:
    """Drop one reference; restore the module when none is left."""
    state = state_of(module)
    if state is None or kind not in state.counts:
        return
    unhold(state.threads)
    state.counts[kind] -= 1
    if state.counts[kind] == 0:
        del state.counts[kind]
        del state.values[kind]
    if state.counts:
        return
    _unpatch(module, state)


def _where_patched(module: nn.Module, state: RuleState) -> str:
    """The attribute holding the rule forward now. accelerate may have moved it while the
    scope was open: ``add_hook_to_module`` (``cpu_offload``, ``dispatch_model``) keeps the
    forward it finds as ``_old_forward``; ``remove_hook_from_module`` puts ``_old_forward``
    back as ``forward``. The original goes back where the rule forward is, so the hooks
    accelerate added or removed in between stay as accelerate left them."""
    for slot in (state.slot, "_old_forward", "forward"):
        if state.patched is not None and read_slot(module, slot) is state.patched:
            return slot
    return state.slot


def holds_patch(module: nn.Module, state: RuleState) -> bool:
    """Whether the module still runs pyattr's rule forward (a forward set on the instance
    inside the scope replaces it; nnsight wrapping the model inside the scope keeps it, in
    its controller's body)."""
    return any(state.patched is not None and read_slot(module, slot) is state.patched
               for slot in (state.slot, "_old_forward", "forward")) or _nnsight_wraps(module, state.patched)


def _nnsight_wraps(module: nn.Module, fn) -> bool:
    """nnsight instrumented the module while ``fn`` was its instance forward: its
    controller's body calls ``fn`` (a closure over it)."""
    ctrl = nnsight_controller(module)
    if ctrl is None or fn is None:
        return False
    return _nnsight_wraps_in(ctrl.state.body, fn)


def _unpatch(module: nn.Module, state: RuleState) -> None:
    """Give ``module`` back its own forward and drop the output check and the state. A
    forward the user set on the instance while the scope was open stays: it is theirs. A
    model nnsight wrapped inside the scope gets its own forward back in the controller's
    body (the rule forward would otherwise outlive the scope there)."""
    if state.hook is not None:
        state.hook.remove()
    if _nnsight_wraps(module, state.patched):
        saved = state.saved_forward
        ctrl = nnsight_controller(module)
        own = type(module).forward if saved is MISSING else (lambda _module, *a, **k: saved(*a, **k))
        for name in ("body", "original"):
            if _nnsight_wraps_in(getattr(ctrl.state, name, None), state.patched):
                setattr(ctrl.state, name, own)
    elif holds_patch(module, state):
        restore_forward(module, _where_patched(module, state), state.saved_forward)
    module.__dict__.pop(_STATE, None)


def _nnsight_wraps_in(body, fn) -> bool:
    return any(getattr(c, "cell_contents", None) is fn for c in (getattr(body, "__closure__", None) or ()))


def restore_forward(module: nn.Module, slot: str, saved) -> None:
    """Put back what ``slot`` of the instance held before a patch: ``saved`` (``MISSING``
    when the instance had none there, so the class's forward shows again)."""
    if slot == NNSIGHT:
        ctrl = nnsight_controller(module)
        if ctrl is not None:
            ctrl.state.body = saved
    elif saved is not MISSING:
        module.__dict__[slot] = saved
    elif slot == "_old_forward":  # the class's forward, where accelerate's wrapper calls it
        module.__dict__[slot] = types.MethodType(type(module).forward, module)
    else:
        module.__dict__.pop(slot, None)


def has_hooks(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or getattr(module, "_backward_pre_hooks", None)
    )


def per_column_scale(out: torch.Tensor, pattern, cache: dict) -> torch.Tensor:
    """Cached per-column gradient scale for a fused q/k/v projection output."""
    key = (out.shape[-1], out.device, out.dtype)
    t = cache.get(key)
    if t is None:
        t = pattern(out.shape[-1]).to(device=out.device, dtype=out.dtype)
        cache[key] = t
    return t


# --- activation-checkpoint recomputation ------------------------------------------------

_local = threading.local()


def _in_backward() -> bool:
    if torch.compiler.is_compiling():  # a traced forward is never a backward's recomputation
        return False
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _unbound_recomputation() -> bool:
    """True while a backward runs a module forward that no pyattr-bound checkpoint asked
    for: the recomputation of a block checkpointed outside any rule scope."""
    return _in_backward() and not getattr(_local, "recomputing", 0)


def snapshot(modules: List[nn.Module]) -> list:
    """The rules active on ``modules`` now: what a recomputation must reinstall."""
    snap = []
    for m in modules:
        st = state_of(m)
        if st is not None and st.counts:
            snap.append((m, st.path, st.make_forward, st.check_output, dict(st.values), st))
    return snap


@contextlib.contextmanager
def recomputing(modules: List[nn.Module], snap: list):
    """Run a checkpointed block's recomputation with exactly the rules of its forward.

    Whatever rule states the modules hold now (another scope's, or none after the scope
    ended) are set aside, the forward-time rules of ``snap`` are installed, and after the
    recomputation the modules get back exactly what they held.
    """
    suspended = []
    for m in modules:
        st = state_of(m)
        if st is None:
            continue
        suspended.append((m, st, _raw_slot(m, st.slot)))
        _unpatch(m, st)
    held = []
    _local.recomputing = getattr(_local, "recomputing", 0) + 1
    try:
        for m, path, make, check, values, forward_state in snap:
            for kind, value in values.items():
                acquire(m, path, kind, value, make, check)
                held.append((m, kind))
            # what the forward's first call found (after this snapshot): the recomputation
            # runs the forward the forward ran
            state_of(m).mismatch = forward_state.mismatch
        yield
    finally:
        _local.recomputing -= 1
        for m, kind in reversed(held):
            release(m, kind)
        for m, st, fwd in reversed(suspended):
            m.__dict__[_STATE] = st
            _set_raw_slot(m, st.slot, fwd)
            if st.hook is not None:
                st.hook = m.register_forward_hook(_output_check(st))
