"""Weight-quantized linear layers inside a rule scope: found in one place, given an input
gradient where their own backward has none, and refused where pyattr cannot vouch for one.

Relevance is a backward pass, so every linear layer between the target and the input
embeddings must pass a gradient to its input. How the quantized layers users load
through transformers do:

* torchao (``TorchAoConfig`` or ``torchao.quantization.quantize_``): the weight of an
  ``nn.Linear`` becomes a tensor subclass (``Int8Tensor``, ``IntxUnpackedToInt8Tensor``,
  ``Float8Tensor``…). Its own autograd is not enough: the dynamic-activation configs
  round the input to integers without a gradient, so the layer's output does not depend
  on its input in the graph and relevance through it would silently be 0; and the weight
  is no tensor a plain matmul takes (``dy @ W`` in the output head's sparse backward fails
  with ``aten.mm`` not implemented). In a scope every such layer runs
  :class:`QuantizedLinearFunction`: its forward is the layer's own (bit-identical), its
  backward ``dx = dy · W`` with ``W = weight.dequantize()``, the weight the forward
  multiplies by. For weight-only schemes that is the exact input gradient (what torchao's
  own autograd gives where it has one).
* bitsandbytes (``BitsAndBytesConfig``): ``Linear4bit`` and ``Linear8bitLt`` carry their
  own input gradient (``dy · dequantize(W)``), which runs on CPU with a bitsandbytes that
  has its CPU backend (checked with 0.50.2); they are left as they are.
* Anything else (GPTQ, AWQ, HQQ, quanto, FP8 checkpoints…, or a layer holding integer
  weights that is neither of the above) is refused with
  :class:`UnsupportedQuantizationError` before anything is patched: pyattr has no
  gradient for it that it has checked.

Schemes that also round the layer's *input* (torchao's dynamic-activation configs,
bitsandbytes' LLM.int8 8-bit layers) get the straight-through gradient ``dy · W`` (what
bitsandbytes' own backward computes): the rounding of the activations is then absorbed in
the conservation delta instead of in relevance.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

import torch
from torch import nn

from pyattr.integration.errors import RelevanceRuleConflictError, RelevanceRuleUnsupportedError
from pyattr.integration.install import (
    MISSING,
    forward_slot,
    read_slot,
    restore_forward,
    slot_forward,
    state_of,
    write_rule_forward,
)

#: ``quantization_config.quant_method`` values whose layers pyattr handles
SUPPORTED_METHODS = ("torchao", "bitsandbytes")

_MARK = "_pyattr_quantized"


class UnsupportedQuantizationError(RelevanceRuleUnsupportedError, NotImplementedError):
    """A quantized layer whose input gradient pyattr cannot compute or vouch for. Raised by
    :func:`quantized_linears` (and so by :func:`pyattr.use_relevance_rules` and every
    method) before anything is patched, or in the backward when a torchao weight cannot be
    dequantized on its device. Both a ``RelevanceRuleUnsupportedError`` and a
    ``NotImplementedError``."""


@dataclass(frozen=True)
class QuantizedLinear:
    """One quantized linear layer of a model.

    Attributes:
        path (str): dotted module path.
        module (nn.Module): the layer.
        method (str): ``"torchao"`` or ``"bitsandbytes"``.
        scheme (str): the weight's tensor subclass (torchao, e.g. ``"Int8Tensor"``) or the
            layer class (bitsandbytes, ``"Linear4bit"`` / ``"Linear8bitLt"``).
        activation_quantized (bool): the forward also rounds the layer's input (torchao
            dynamic-activation configs, LLM.int8); its gradient is then straight-through.
        patched (bool): pyattr runs the layer through :class:`QuantizedLinearFunction`
            in a scope (torchao); False where the layer's own backward is used.
    """

    path: str
    module: nn.Module
    method: str
    scheme: str
    activation_quantized: bool
    patched: bool

    def describe(self) -> str:
        act = ", activations quantized too" if self.activation_quantized else ""
        return f"{self.method} {self.scheme}{act}"


def quant_method(model: nn.Module) -> Optional[str]:
    """``quantization_config.quant_method`` of a transformers model (its ``hf_quantizer``
    or ``config``), as a plain string; None for a model loaded without quantization."""
    qc = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    if qc is None:
        qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if qc is None:
        return None
    m = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return None if m is None else str(getattr(m, "value", m))


def _from(cls: type, package: str) -> bool:
    return any(c.__module__.split(".")[0] == package for c in cls.__mro__ if c is not object)


def _names(cls: type, package: str) -> set:
    return {c.__name__ for c in cls.__mro__ if c.__module__.split(".")[0] == package}


def _is_plain_linear_forward(module: nn.Module) -> bool:
    fn = read_slot(module, forward_slot(module))
    fn = type(module).forward if fn is MISSING else getattr(fn, "__func__", fn)
    return fn is nn.Linear.forward and type(module).forward is nn.Linear.forward


def _integer_weight(module: nn.Module) -> Optional[str]:
    """The name of a tensor attribute holding integer (packed) weights, if any: a known
    name, or in a linear-like module any 2-D integer parameter or buffer of its own
    (HQQ's ``W_q``, Marlin's ``B``…)."""
    for name in ("qweight", "weight", "weight_packed", "w_q"):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex()):
            return name
    if "Linear" in type(module).__name__ or isinstance(getattr(module, "in_features", None), int):
        own = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
        return next((n for n, t in own if t.dim() >= 2 and not (t.is_floating_point() or t.is_complex())
                     and t.dtype != torch.bool), None)
    return None


def _pytorch_quantized(module: nn.Module) -> bool:
    """A module of PyTorch's own quantization (``torch.ao.quantization``: ``quantize_dynamic``,
    ``convert``), or one holding a quantized tensor: packed weights and kernels without an
    input gradient."""
    where = type(module).__module__
    if where.startswith(("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized")):
        return True
    own = (*module.parameters(recurse=False), *module.buffers(recurse=False))
    return any(t.is_quantized for t in own)


def _unsupported(path: str, module: nn.Module, why: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"{path!r} ({module._get_name()}) {why}; pyattr computes relevance through weight-quantized linear "
        f"layers of {' and '.join(SUPPORTED_METHODS)} only (torchao: an nn.Linear whose weight is a torchao "
        "tensor subclass; bitsandbytes: Linear4bit, Linear8bitLt). Load the model with TorchAoConfig, "
        "BitsAndBytesConfig, or unquantized"
    )


def quantized_linears(model: nn.Module) -> Dict[str, QuantizedLinear]:
    """Every quantized linear layer of ``model``, found structurally, by dotted path.

    torchao: an ``nn.Linear`` whose ``weight`` is a torchao tensor subclass (embeddings
    quantized by torchao are left out: relevance is read at their output and never
    differentiates through them). bitsandbytes: ``Linear4bit`` (and its ``LinearNF4`` /
    ``LinearFP4``) and ``Linear8bitLt`` modules. A wrapper that shows a found layer's
    weight as its own (peft's LoRA layers, ``weight`` a property) is not another layer.

    Raises:
        UnsupportedQuantizationError: the model's ``quantization_config.quant_method`` is
            neither ``"torchao"`` nor ``"bitsandbytes"``; a module holds integer weights
            (``qweight``, an integer ``weight``) without being one of the layers above; a
            torchao-quantized ``nn.Linear`` whose forward is not ``nn.Linear.forward``
            (a subclass or an instance patch: its backward would not be ``dy · W``).
    """
    method = quant_method(model)
    if method is not None and method not in SUPPORTED_METHODS:
        raise UnsupportedQuantizationError(
            f"{type(model).__name__} is quantized with quant_method={method!r} (its quantization_config); "
            f"pyattr computes relevance through weight-quantized linear layers of {' and '.join(SUPPORTED_METHODS)} "
            "only, and has no checked input gradient for these layers. Load the model with TorchAoConfig, "
            "BitsAndBytesConfig, or unquantized"
        )
    found: Dict[str, QuantizedLinear] = {}
    known = set()  # ids of the weights of the layers found: a wrapper's view of them (peft's LoRA) is no other layer
    modules = list(model.named_modules())
    refused: Dict[str, UnsupportedQuantizationError] = {}  # the first in model order is raised
    for path, mod in modules:
        if _pytorch_quantized(mod):
            raise _unsupported(path, mod, "is a PyTorch-quantized module (torch.ao.quantization: packed weights, a "
                                          "kernel without an input gradient)")
    for path, mod in reversed(modules):  # every module after its children
        cls = type(mod)
        w = getattr(mod, "weight", None)
        if _from(cls, "bitsandbytes"):
            names = _names(cls, "bitsandbytes")
            if "Linear4bit" in names:
                found[path] = QuantizedLinear(path, mod, "bitsandbytes", "Linear4bit", False, False)
            elif "Linear8bitLt" in names:
                found[path] = QuantizedLinear(path, mod, "bitsandbytes", "Linear8bitLt", True, False)
            elif isinstance(mod, nn.Linear) or "Linear" in cls.__name__:
                refused[path] = _unsupported(path, mod, "is a bitsandbytes layer other than Linear4bit / Linear8bitLt")
            known.add(id(w))
            continue
        if isinstance(mod, nn.Embedding) or (w is not None and id(w) in known):
            continue
        if isinstance(w, torch.Tensor) and _from(type(w), "torchao"):
            if not isinstance(mod, nn.Linear):
                refused[path] = _unsupported(path, mod, f"holds a torchao {type(w).__name__} weight but is not an "
                                                        "nn.Linear")
                continue
            if not isinstance(mod.__dict__.get(_MARK), _Patch) and state_of(mod) is not None:
                refused[path] = _unsupported(
                    path, mod, "was quantized inside an open use_relevance_rules scope: a rule forward already stands "
                               "in for its own, and its input gradient cannot be placed under it. Quantize the model "
                               "before entering the scope")
                continue
            if not _is_plain_linear_forward(mod) and not isinstance(mod.__dict__.get(_MARK), _Patch):
                refused[path] = _unsupported(path, mod, f"holds a torchao {type(w).__name__} weight but its forward "
                                                        "is not nn.Linear.forward, so its input gradient is not dy · W")
                continue
            act = getattr(w, "act_quant_kwargs", None) is not None or \
                getattr(w, "activation_quantization", None) is not None
            found[path] = QuantizedLinear(path, mod, "torchao", type(w).__name__, act, True)
            known.add(id(w))
            continue
        name = _integer_weight(mod)
        if name is not None:
            t = getattr(mod, name)
            refused[path] = _unsupported(path, mod, f"holds integer weights ({name}: {t.dtype}, a quantization "
                                                    f"pyattr does not know{'' if method is None else f', {method}'})")
    first = next((refused[path] for path, _ in modules if path in refused), None)
    if first is not None:
        raise first
    return {path: found[path] for path, _ in modules if path in found}


def dequantized_weight(layer: QuantizedLinear, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weight a torchao layer's forward multiplies by, ``Tensor[out, in]`` in the
    weight's nominal dtype (``weight.dequantize()``); ``weight``: the one a forward call
    used (default: the layer's weight now; under accelerate's offload that is a ``meta``
    placeholder between calls).

    Raises:
        UnsupportedQuantizationError: the weight cannot be dequantized on its device.
    """
    w = layer.module.weight if weight is None else weight
    if w.device.type == "meta":
        raise UnsupportedQuantizationError(
            f"{layer.path!r}: the torchao {type(w).__name__} weight is on the meta device (offloaded), so its "
            "input gradient cannot be computed; run the model with its weights loaded")
    try:
        return w.dequantize()
    except Exception as e:  # any failure of the subclass: say which layer
        raise UnsupportedQuantizationError(
            f"{layer.path!r}: the torchao {type(w).__name__} weight cannot be dequantized on {w.device} "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); relevance needs the dequantized weight "
            "for the layer's input gradient. Run the model where this torchao layout has kernels, or "
            "quantize with Int8WeightOnlyConfig / IntxWeightOnlyConfig"
        ) from e


class QuantizedLinearFunction(torch.autograd.Function):
    """A torchao-quantized ``nn.Linear``: the layer's own forward, and the input gradient
    of ``y = x · Wᵀ + b`` with ``W`` the dequantized weight.

    Forward: ``run(x)``, the layer's native forward, so the output is bit-identical.
    Backward: ``dx = dy · W`` computed in ``dy``'s dtype and returned in ``x``'s;
    ``db = Σ dy`` over every dimension but the last, when the bias requires grad. ``W``
    is dequantized in the backward and dropped after it: nothing is saved but a reference
    to the quantized weight the forward used. Differentiable again (``create_graph``) and batched (``is_grads_batched``)."""

    @staticmethod
    def forward(ctx, x, bias, run: Callable, weight: Callable):
        ctx.weight = weight
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return run(x)

    @staticmethod
    def backward(ctx, dy):
        dx = db = None
        if ctx.needs_input_grad[0]:
            w = ctx.weight()
            dx = torch.matmul(dy, w.to(dy.dtype)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0).to(ctx.bias_dtype)
        return dx, db, None, None


class _Patch:
    """The record of one patched layer: nested scopes count, the outermost restores."""

    def __init__(self, slot: str, saved, patched: Callable):
        self.slot, self.saved, self.patched, self.count = slot, saved, patched, 1

    def __deepcopy__(self, memo):
        raise RelevanceRuleConflictError(
            "cannot copy a model while a relevance-rule scope has its quantized layers patched; copy it outside "
            "the use_relevance_rules scope")

    def __reduce__(self):
        raise RelevanceRuleConflictError(
            "cannot pickle a model while a relevance-rule scope has its quantized layers patched; save it "
            "outside the use_relevance_rules scope")


def _linear_forward(layer: QuantizedLinear, native: Callable) -> Callable:
    mod = layer.module

    def forward(*args, **kwargs):
        # nn.Linear.forward(input): positional or by name
        x = args[0] if len(args) == 1 and not kwargs else kwargs["input"] if not args and list(kwargs) == ["input"] \
            else None
        bias = mod.bias
        needs = torch.is_grad_enabled() and isinstance(x, torch.Tensor) and (
            x.requires_grad or (bias is not None and bias.requires_grad))
        if not needs:
            return native(*args, **kwargs)
        # the weight this call multiplies by (under accelerate's offload, the one loaded for
        # the call: the layer holds a meta placeholder again by the time of the backward)
        w = mod.weight
        return QuantizedLinearFunction.apply(x, bias, native, lambda: dequantized_weight(layer, w))

    return forward


@contextlib.contextmanager
def quantized_input_gradients(model: nn.Module) -> Iterator[Dict[str, QuantizedLinear]]:
    """For the ``with`` block, give every torchao-quantized linear layer of ``model`` an
    input gradient (:class:`QuantizedLinearFunction`); yields :func:`quantized_linears`.

    Patches the instance's forward (``_old_forward`` under an accelerate hook), before any
    rule is installed on top of it; nested scopes count, the outermost one restores the
    layer's own forward on exit, exceptions included.

    bitsandbytes' ``Linear4bit`` layers keep the weight layout their backward needs
    (:func:`bitsandbytes_kept_for_gradients`).

    Raises:
        UnsupportedQuantizationError: see :func:`quantized_linears` and
            :func:`bitsandbytes_kept_for_gradients`; raised before anything is patched.
    """
    layers = quantized_linears(model)
    done = []
    kept = bitsandbytes_kept_for_gradients(model, layers)
    kept.__enter__()
    try:
        for layer in layers.values():
            if not layer.patched:
                continue
            mod = layer.module
            rec = mod.__dict__.get(_MARK)
            if isinstance(rec, _Patch):
                rec.count += 1
            else:
                slot = forward_slot(mod)
                fwd = _linear_forward(layer, slot_forward(mod, slot))
                rec = _Patch(slot, read_slot(mod, slot), fwd)
                write_rule_forward(mod, slot, fwd)
                mod.__dict__[_MARK] = rec
            done.append(mod)
        yield layers
    finally:
        for mod in reversed(done):
            _release(mod)
        kept.__exit__(None, None, None)


@contextlib.contextmanager
def bitsandbytes_kept_for_gradients(model: nn.Module, layers: Optional[Dict[str, QuantizedLinear]] = None
                                    ) -> Iterator[None]:
    """For the ``with`` block, bitsandbytes' ``Linear4bit`` layers keep their weight layout
    when called without gradient.

    On a CPU with AVX-512 bf16, bitsandbytes repacks a ``Linear4bit``'s weight for
    inference at its first call without gradient, for good; that layout runs
    ``gemv_4bit``, which has no backward (torch only warns: the input gradient is wrong),
    and bitsandbytes' inverse conversion does not give the weights back (the toy decoder's
    logits moved by 3.0 of 14.9). So the layers' ``support_avx512bf16_for_cpu`` is off
    for the block (pyattr's own calls without gradient: a check, ``generate``), and a
    layer already repacked is refused.

    Raises:
        UnsupportedQuantizationError: a ``Linear4bit`` already holds the inference layout.
    """
    layers = quantized_linears(model) if layers is None else layers
    four = [q for q in layers.values() if q.scheme == "Linear4bit"]
    for q in four:
        state = getattr(getattr(q.module, "weight", None), "quant_state", None)
        if getattr(state, "packing_format_for_cpu", False):
            raise UnsupportedQuantizationError(
                f"{q.path!r} (Linear4bit): bitsandbytes repacked its weight for CPU inference (at the layer's first "
                "call without gradient on a CPU with AVX-512 bf16, for good); that layout's kernel (gemv_4bit) has no "
                "backward and bitsandbytes' own inverse conversion does not restore the weights, so relevance through "
                "it would be wrong. Reload the model and keep its calls without gradient inside pyattr (its "
                "generation_relevance generates without repacking), or set support_avx512bf16_for_cpu = False on its "
                "Linear4bit layers before such calls")
    saved = [(q.module, q.module.__dict__.get("support_avx512bf16_for_cpu", MISSING)) for q in four]
    for mod, _ in saved:
        mod.support_avx512bf16_for_cpu = False
    try:
        yield
    finally:
        for mod, old in saved:
            if old is MISSING:
                mod.__dict__.pop("support_avx512bf16_for_cpu", None)
            else:
                mod.support_avx512bf16_for_cpu = old


def _release(mod: nn.Module) -> None:
    rec = mod.__dict__.get(_MARK)
    if not isinstance(rec, _Patch):
        return
    rec.count -= 1
    if rec.count:
        return
    # accelerate may have moved the forward between ``forward`` and ``_old_forward``
    slot = next((s for s in (rec.slot, "_old_forward", "forward") if read_slot(mod, s) is rec.patched), rec.slot)
    restore_forward(mod, slot, rec.saved)
    mod.__dict__.pop(_MARK, None)
