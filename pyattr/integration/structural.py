"""Norms of unknown classes, recognised by what they compute, for ``generic=True``.

A model without a rule map may carry its own norm class (Cohere's bias-free
``CohereLayerNorm``, OLMo's parameter-free ``OlmoLayerNorm``). Its forward cannot be
replaced by pyattr's fused LN-rule op without risking other bits, so the rule is placed
*beside* the native forward instead:

    y = native(x).detach() + (s(x) − s(x).detach())

where ``s`` is the norm with its scale held constant (``(x − mean)/σ·w`` or ``x/r·w``).
The value is ``native(x) + 0``: the native output, bit for bit (a ``-0.0`` may become
``+0.0``, which ``torch.equal`` counts as equal); the gradient is ``s``'s, the LN-rule's
(RelP, arXiv 2508.21258, and AttnLRP, ICML 2024, Prop. 3.2: the normalising scale is a
constant). The kind of norm and its effective weight are read off the module's outputs
on probe inputs, not off its class name (:func:`pyattr.architectures.forms.classify_norm`,
which structural discovery reads too).
"""

from __future__ import annotations

import torch

from pyattr.architectures.forms import _eps, _normalised, classify_norm  # noqa: F401 - the probe lives with discovery


def structural_norm_forward(kind: str, weight_spec, eps: float):
    """The make_forward of a norm recognised by :func:`classify_norm`: its own forward's
    value, the LN-rule's gradient (see the module docstring).

    ``weight_spec`` is ``(weight, offset)``: the module's own weight (kept differentiable:
    its native gradient), or the fitted scale of a parameter-free norm (a constant). The
    normalising scale is read off the native output per row, ``c = ⟨y − b, t⟩ / ⟨t, t⟩``
    with ``t = n(x)·w`` (held constant): exactly the norm's own (an L2 norm's x/‖x‖ as
    much as an RMS norm's x/rms, whatever its epsilon or reduction), so that
    ``Σ x·∂ = Σ (y − b)·dy``: conservation under the LN-rule. Saves ``x``."""
    own, offset = weight_spec
    fitted = isinstance(own, torch.Tensor) and not isinstance(own, torch.nn.Parameter)

    def make(module, state):
        native = state.native

        def forward(x, *args, **kwargs):
            y = native(x, *args, **kwargs)
            acc = torch.promote_types(x.dtype, torch.float32)  # float32 at least, float64 kept
            x32 = x.to(acc)
            if kind == "layer_norm":
                c = x32 - x32.mean(-1, keepdim=True)
                s = c * torch.rsqrt(c.detach().pow(2).mean(-1, keepdim=True) + eps)
            else:
                s = x32 * torch.rsqrt(x32.detach().pow(2).mean(-1, keepdim=True) + eps)
            if own is not None:  # the own weight not detached: it keeps its native gradient n(x)·dy
                s = s * ((own.detach() if fitted else own).to(device=s.device, dtype=acc) + offset)
            bias = getattr(module, "bias", None)
            b = bias.to(acc) if isinstance(bias, torch.Tensor) and bias.shape == s.shape[-1:] else None
            if isinstance(y, torch.Tensor) and y.shape == s.shape:
                t = s.detach()
                num = ((y.detach().to(acc) - (0 if b is None else b.detach())) * t).sum(-1, keepdim=True)
                den = t.pow(2).sum(-1, keepdim=True)
                s = s * torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)),
                                    torch.ones_like(den))
            if b is not None:
                s = s + b
            s = s.to(y.dtype)
            return y.detach() + (s - s.detach())

        return forward

    return make
