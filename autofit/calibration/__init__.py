"""Calibration: the napkin as the prior, measured trials as the correction.

The napkin (`autofit.estimate`) predicts a peak as a sum of named memory terms and a step time as a
sum of named time terms. A calibration multiplies each term by a factor and adds a constant:

    peak = sum_k f_k x memory_term_k + c_mem            (bytes)
    step = sum_k g_k x time_term_k   + c_time x micro-steps (seconds)

`fit_calibration` finds the factors that explain the measured trials of a study (OOMs as lower
bounds on memory), as a maximum a-posteriori fit: log-factors with a Laplace prior at the prior
calibration (the napkin's 1.0, or a stored calibration of this machine; a Gaussian prior on the
constants), measurement residuals on a log scale with a Cauchy loss (a trial that went strange is
down-weighted, not believed), solved by damped Gauss-Newton. Two trials move the factors sensibly
(the prior holds what they cannot tell apart); twenty pin them down.

A calibration also carries its own measured error: the leave-one-out relative error of its
predictions over the trials it was fitted on (`memory_band`, `speed_band`). The search prunes with
that band instead of the napkin's stated error (`autofit.estimate.MEMORY_ERROR`).

A correction has to pay for itself: for memory and for speed apart, the fit's error on the
study's own trials, each predicted by a fit that did not see it (leave-one-out: the prior never
saw them either), is held against the prior's error on the same trials, in the measure the plan
reports (median |error| of the peak, of tokens/s). A side whose fit does not do better keeps the
prior's factors, and its band is the prior's error measured on those trials (`SideCheck`: what
was kept and why, which the plan prints).

Pure arithmetic on numpy; no torch.

The rooms: `terms` (what a peak and a step time are made of), `model` (the calibration and its
observations), `records` (their plain-data form, pydantic), `fit` (the solver and its
leave-one-out judgement).
"""

from autofit.calibration.fit import MIN_BAND, fit_calibration, median_abs
from autofit.calibration.model import (
    NAPKIN,
    SPEED_NOISE,
    Calibration,
    Observation,
    SideCheck,
)
from autofit.calibration.records import calibration_from_dict, calibration_to_dict
from autofit.calibration.terms import (
    MEMORY_TERMS,
    OFFLOADED_TERMS,
    PEAK_TERMS,
    SHARE_TERMS,
    SPEED_TERMS,
    TIME_FACTOR_TERMS,
    memory_terms,
    time_terms,
)
from autofit.estimate import MEMORY_ERROR

__all__ = [
    "MEMORY_ERROR",
    "MEMORY_TERMS",
    "MIN_BAND",
    "NAPKIN",
    "OFFLOADED_TERMS",
    "PEAK_TERMS",
    "SHARE_TERMS",
    "SPEED_NOISE",
    "SPEED_TERMS",
    "TIME_FACTOR_TERMS",
    "Calibration",
    "Observation",
    "SideCheck",
    "calibration_from_dict",
    "calibration_to_dict",
    "fit_calibration",
    "median_abs",
    "memory_terms",
    "time_terms",
]
