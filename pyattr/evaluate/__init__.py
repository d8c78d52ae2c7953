"""Is an explanation faithful? Perturbation curves and ABPC.

    pyattr.evaluate.perturbation_curve(model, inputs, relevance, target, order="morf")
    pyattr.evaluate.abpc(model, inputs, relevance, target)   # AUC(LeRF) − AUC(MoRF), (batch,)
"""

from pyattr.evaluate.perturbation import (  # noqa: F401
    ORDERS, PERTURBATIONS, PerturbationCurve, abpc, area, perturbation_curve, plot_curves,
)
