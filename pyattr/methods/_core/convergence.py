"""Integrated gradients' completeness check (Sundararajan et al. 2017, §2.2): the
attributions must add up to ``f(x) − f(x₀)``; where they miss it by more than a tolerance
the path integral has not converged, and the result warns. One check for every stack."""

from __future__ import annotations

import torch


class ConvergenceWarning(UserWarning):
    """:func:`integrated_gradients`: the attributions do not add up to ``f(x) − f(x₀)``
    (the convergence delta is large against it): the path integral has not converged."""


#: the share of ``f(x) − f(x₀)`` a convergence delta may reach before the result warns
CONVERGENCE_TOLERANCE = 0.05


def baseline_hint(model, baseline) -> str:
    """What to add to the warning about the baseline: a zero embedding is ill-conditioned on
    RMS-norm models (the norm's gradient near 0 grows as 1/|x|), said only where it holds."""
    zero = baseline is None or (isinstance(baseline, str) and baseline == "zeros")
    # T5's layer norm is an RMS norm under its own name
    rms = any("RMSNorm" in type(m).__name__ or type(m).__name__.endswith("T5LayerNorm") for m in model.modules())
    return " (a zero embedding is ill-conditioned on RMSNorm models)" if zero and rms else ""


def warn_unconverged(delta: torch.Tensor, change: torch.Tensor, n_steps: int, hint: str = "") -> None:
    """Warn (:class:`ConvergenceWarning`) where a row's ``|delta|`` exceeds
    :data:`CONVERGENCE_TOLERANCE` of ``|f(x) − f(x₀)|`` (Sundararajan et al. 2017, §2.2:
    completeness is the check that the integral was approximated well enough)."""
    import warnings

    ratio = delta.abs() / change.abs().clamp(min=1e-12)
    bad = (ratio > CONVERGENCE_TOLERANCE) & torch.isfinite(ratio)
    if not bool(bad.any()):
        return
    r = int(torch.nonzero(bad)[0])
    from pyattr.integration.plan_check import _caller_level

    warnings.warn(ConvergenceWarning(
        f"integrated_gradients: the attributions miss f(x) - f(baseline) by {float(delta[r]):+.3g} against "
        f"{float(change[r]):+.3g} ({float(ratio[r]):.0%}; row {r}, {int(bad.sum())} of {bad.numel()} rows over "
        f"{CONVERGENCE_TOLERANCE:.0%}) with n_steps={n_steps}: the path integral has not converged; raise n_steps, "
        f"or start from a baseline nearer the input{hint}"),
        stacklevel=_caller_level())
