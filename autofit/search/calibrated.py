"""Every trial teaches the estimate: the search's side of `autofit.calibration`.

`Calibrator` keeps the study's calibration current. After each finished real trial it refits the
corrections on every measured trial of the study (all workers' alike; the prior is this machine's
stored calibration, or the napkin), re-prunes and re-ranks every candidate with it
(`Candidates.recalibrate`), and names the next candidate: the untried one with the highest
expected improvement over the best measured one (`Calibrator.next_candidate`). The calibrated
speed is taken as log-normal with the calibration's own uncertainty for that candidate (its
parameters' posterior covariance seen through the candidate's terms, and the error the fitted
terms leave), so a candidate like those measured is known well and one unlike them may surprise;
times the chance its calibrated peak stays under the headroom line. When no candidate is expected
to gain `MIN_GAIN`, the search has learnt what it can and stops.

Each trial records the calibrated estimate made before it ran (user attr `calibrated`), so the
plan can judge the calibration only on trials it had not seen.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import optuna

from autofit.calibration import (
    NAPKIN,
    SPEED_NOISE,
    Calibration,
    Observation,
    calibration_to_dict,
    fit_calibration,
    median_abs,
)
from autofit.calibration import store as cal_store
from autofit.config import Config
from autofit.plan import Candidate
from autofit.request import PlanRequest
from autofit.search import study as st
from autofit.search.candidates import DISTINCT, Candidates, rebuild_trials
from autofit.search.verify import under_line

CALIBRATION_ATTR = "calibration"  # the study's user attr: the calibration it ended with
# The search stops early only after this many trials measured: fewer cannot tell the
# calibration's own error (its leave-one-out band) ...
MIN_TRIALS_TO_STOP = 3
# ... and then when no untried candidate is expected to beat the best measured one by this share.
MIN_GAIN = 0.005
SQRT2 = math.sqrt(2.0)
_erf = np.vectorize(math.erf, otypes=[float])


def _phi(x: np.ndarray) -> np.ndarray:
    """The standard normal's distribution function."""
    return 0.5 * (1.0 + _erf(x / SQRT2))


def expected_gains(median: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """E[max(0, T - best)] for each T log-normal with `median` and log-sd `sd` (the mean of T
    when nothing was measured yet, best = 0)."""
    with np.errstate(over="ignore"):  # a spread past ~26 (log) is an endless mean: inf
        mean = median * np.exp(sd * sd / 2)
    if best <= 0:
        return mean
    d2 = np.log(median / best) / sd
    return mean * _phi(d2 + sd) - best * _phi(d2)


def stored_prior(request: PlanRequest) -> Calibration:
    """What a search starts from: this machine's stored calibration under `calibration: auto`,
    else the napkin."""
    return cal_store.for_request(request) or NAPKIN


class Calibrator:
    """The calibration of one study, refitted as its trials finish."""

    def __init__(self, cands: Candidates, prior: Calibration) -> None:
        self.cands = cands
        self.prior = prior
        self.on = cands.setting.calibration != "off"
        self.fitted_on = -1  # how many finished trials the current calibration saw

    def observations(self, study: optuna.Study) -> list[tuple[str, Observation]]:
        """Each finished real trial of the study that measured something, with its id."""
        out = []
        for c in rebuild_trials(study, self.cands):
            obs = Observation.of(c.estimate, c.trial)
            if obs.informative:
                out.append((f"{study.study_name}#{c.number}", obs))
        return out

    def refresh(self, study: optuna.Study) -> bool:
        """Refit when trials finished since the last fit; True when the calibration changed."""
        if not self.on:
            return False
        obs = self.observations(study)
        if len(obs) == self.fitted_on:
            return False
        self.fitted_on = len(obs)
        self.cands.recalibrate(fit_calibration((o for _, o in obs), self.prior))
        return True

    def record(self, trial: optuna.Trial, cfg: Config) -> None:
        """Store the calibrated estimate of the trial's config, made before it runs."""
        if self.on:
            trial.set_user_attr(st.CALIBRATED, self.cands.calibrated(cfg))

    def next_candidate(self, taken: set[str], measured: list[Candidate]) -> Candidate | None:
        """While no trial has measured a speed: the (calibrated) estimate's fastest untried
        candidate under the headroom line, in the plan's own order (`Candidates.predicted_fit`).
        Before any measurement the only spread there is, is the estimate's stated error, the
        same for every candidate: an expected gain would rank by that spread, not by speed.

        Then: the untried candidate with the highest expected improvement over the best measured
        one under the headroom line: its calibrated tokens/s taken as log-normal with the
        calibration's uncertainty for it (a candidate unlike the measured ones is less certain:
        it may be much faster, and it teaches more; one the calibrated estimate cannot tell from
        a measured one, within `DISTINCT`, is as fast as that one measured), times the chance
        its peak stays under the line. None when nothing is left, or (after
        `MIN_TRIALS_TO_STOP` measured trials) when none is expected to gain `MIN_GAIN`."""
        c = self.cands
        s = c.setting
        if not any(m.trial is not None and m.trial.tokens_per_s for m in measured):
            for cand in c.predicted_fit:
                if st.config_key(cand.config) not in taken:
                    return cand
        ok = [m for m in measured if under_line(s, m.trial) and m.trial.tokens_per_s]
        best = max((m.trial.tokens_per_s for m in ok), default=0.0)
        sure = sum(1 for m in measured if m.measured) >= MIN_TRIALS_TO_STOP
        speed, peak, speed_sd, peak_sd = c.trialable_arrays()
        median, speed_sd = speed.copy(), speed_sd.copy()
        for m in ok:  # what the napkin cannot tell from a measured candidate runs as it did
            same = (np.abs(speed / c.tokens_per_s(m.config) - 1) < DISTINCT) & (
                np.abs(peak / c.peak(m.config) - 1) < DISTINCT
            )
            median[same] = m.trial.tokens_per_s * speed[same] / c.tokens_per_s(m.config)
            speed_sd[same] = SPEED_NOISE
        gain = expected_gains(median, speed_sd, best)
        fits = _phi(np.log(s.allowed_bytes / peak) / peak_sd)
        score = gain * fits
        for i in np.argsort(-score, kind="stable"):  # ties: the ranked order (plainest first)
            if sure and score[i] < MIN_GAIN * best:
                return None
            cand = c.trialable[i]
            if st.config_key(cand.config) not in taken:
                return cand
        return None

    def store(self, study: optuna.Study) -> tuple[Any, Calibration] | None:
        """Add the study's measured trials to this machine's stored calibration (`auto` only)."""
        if self.cands.setting.calibration != "auto":
            return None
        obs = self.observations(study)
        if not obs:
            return None
        s = self.cands.setting
        return cal_store.save(s.hardware, s.device, obs)


def summary(cands: Candidates, trials: list[Candidate]) -> dict[str, Any]:
    """The plan's `calibration`: its source, the fitted factors, and the median |error| of the
    napkin and of the calibrated estimate over the measured trials (each calibrated estimate made
    before its trial ran, from at least one measurement: a trial it had not seen). Where there
    are calibrated estimates, the napkin's median is over the same trials, so the two compare."""
    cal = cands.calibration
    # per side: (napkin's error, calibrated error or None) of each measured trial
    pairs: dict[str, list[tuple[float, float | None]]] = {"memory": [], "speed": []}
    for c in trials:
        r = c.trial
        if r is None or not r.measured:
            continue
        # a calibrated estimate made before anything was measured is the napkin's: not counted
        calibrated = c.calibrated if c.calibrated and c.calibrated.get("source") != "none" else {}
        if r.peak_bytes:
            ours = calibrated["peak_bytes"] / r.peak_bytes - 1 if calibrated else None
            pairs["memory"].append((c.estimate.peak_bytes / r.peak_bytes - 1, ours))
        if r.tokens_per_s:
            ours = calibrated["tokens_per_s"] / r.tokens_per_s - 1 if calibrated else None
            pairs["speed"].append((c.estimate.tokens_per_s / r.tokens_per_s - 1, ours))
    errors: dict[str, float | None] = {}
    for side, rows in pairs.items():
        judged = [(napkin, ours) for napkin, ours in rows if ours is not None]
        errors[f"napkin_{side}_error"] = median_abs(n for n, _ in judged or rows)
        errors[f"calibrated_{side}_error"] = median_abs(o for _, o in judged if o is not None)
    return {"mode": cands.setting.calibration, **calibration_to_dict(cal), **errors}
