"""What the search may try: every candidate of the space with its estimate, split into the ones a
trial may spend time on and the ones the estimate rules out, and the Optuna parameters over them.

A candidate is ruled out when its estimated peak is above the headroom line (usable memory x
(1 - margin)) by more than `autofit.plan.PRUNE_TOLERANCE`: it could not be the winner even if the
estimate were off by that much. Candidates between the line and line x (1 + tolerance) may run:
the measurement decides (`autofit.plan.search_prune_reason`).

With a calibration (`autofit.calibration`: a stored one of this machine, or one fitted on the
study's trials) the candidates are judged by their calibrated estimates instead, with the
calibration's measured error as the band: `Candidates.recalibrate` re-prunes and re-ranks every
candidate after each trial, so one ruled out early can come back.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution

from autofit.calibration import NAPKIN, Calibration, memory_terms, time_terms
from autofit.config import KNOBS, Config
from autofit.errors import ConfigError
from autofit.plan import Candidate, PruneReason, estimate_all, search_prune_reason
from autofit.plan.prune import allowed_bytes
from autofit.plan.rank import complexity, speed_bucket
from autofit.request import PlanRequest
from autofit.rules import derive_grad_accum
from autofit.search import study as st
from autofit.trials.budget import TrialTime, trial_time
from autofit.trials.result import TrialResult

# Two candidates whose estimated speed and peak are both within this of each other are the same
# to the napkin: seeding the study with both would spend a trial learning nothing new.
DISTINCT = 0.02


class Setting(PlanRequest):
    """What a search is for: its request, and the headroom line derived from it."""

    @classmethod
    def from_request(cls, request: PlanRequest) -> Setting:
        return cls(**{f.name: getattr(request, f.name) for f in fields(request)})

    @property
    def allowed_bytes(self) -> float:
        """The headroom line: the winner's measured peak must stay at or below it."""
        return allowed_bytes(self)


@dataclass
class Candidates:
    setting: Setting
    all: dict[Config, Candidate]  # every valid candidate with its napkin estimate
    trialable: list[Candidate]  # may cost a trial, ranked best first by (calibrated) estimate
    predicted_fit: list[Candidate]  # trialable and estimated under the headroom line, ranked
    pruned: dict[Config, PruneReason]  # ruled out by the estimate, with the reason
    counts: Counter[str]  # skipped without a trial, by reason (rules of the space included)
    considered: int
    names: list[str] = field(default_factory=list)  # knobs that vary: the Optuna params
    fixed: dict[str, Any] = field(default_factory=dict)
    distributions: dict[str, CategoricalDistribution] = field(default_factory=dict)
    rules: Counter[str] = field(default_factory=Counter)  # skipped by the space's rules
    calibration: Calibration = NAPKIN  # what the estimates are corrected by
    _peaks: Any = None  # calibrated peak of each of `all` (in its order)
    _speeds: Any = None  # calibrated tokens/s
    _steps: Any = None  # calibrated step time
    _index: dict[Config, int] = field(default_factory=dict)
    _arrays: Any = None  # the napkin's terms, made once (`_terms`)
    _trialable_at: Any = None  # where each of `trialable` is in `all`
    _peak_sd: Any = None  # the log-sd of each calibrated peak, and of each calibrated speed
    _speed_sd: Any = None

    def params(self, cfg: Config) -> dict[str, Any]:
        return {name: getattr(cfg, name) for name in self.names}

    def config(self, params: dict[str, Any]) -> Config | None:
        """The candidate the sampler's params name, or None (a rule broken, not in the space)."""
        values = {**self.fixed, **params}
        if self.setting.global_batch:
            ga = derive_grad_accum(
                self.setting.global_batch, values["micro_batch"], self.setting.hardware.n_gpus
            )
            if ga is None:
                return None
            values["grad_accum"] = ga
        try:
            cfg = Config(**values)
        except ConfigError:
            return None
        return cfg if cfg in self.all else None

    def overshoot(self, cand: Candidate) -> float:
        """(Calibrated) estimated peak over the headroom line, as a fraction (> 0: above it)."""
        return self.peak(cand.config) / self.setting.allowed_bytes - 1

    def peak(self, cfg: Config) -> float:
        """The calibrated estimate of `cfg`'s peak (the napkin's without a calibration)."""
        return float(self._peaks[self._index[cfg]])

    def tokens_per_s(self, cfg: Config) -> float:
        return float(self._speeds[self._index[cfg]])

    def calibrated(self, cfg: Config) -> dict[str, Any]:
        """The calibrated estimate of `cfg` as a trial records it (`calibrated`)."""
        i = self._index[cfg]
        return {
            "peak_bytes": float(self._peaks[i]),
            "tokens_per_s": float(self._speeds[i]),
            "step_time_s": float(self._steps[i]),
            "source": self.calibration.source,  # none: nothing measured yet, the napkin's
            "n_trials": self.calibration.n_trials,
        }

    def recalibrate(self, calibration: Calibration) -> None:
        """Judge every candidate by `calibration`: its calibrated peak against the headroom line
        with the calibration's measured error as the band (the napkin's `PRUNE_TOLERANCE`
        without one), ranked by calibrated tokens/s. A calibrating search also gets how sure
        each calibrated number is (`trialable_arrays`)."""
        s = self.setting
        self.calibration = cal = calibration
        order = list(self.all.values())
        if not self._index:
            self._index = {c.config: i for i, c in enumerate(order)}
        if cal.is_napkin:
            peaks = np.array([c.estimate.peak_bytes for c in order], dtype=float)
            steps = np.array([c.estimate.step_time_s for c in order], dtype=float)
            speeds = np.array([c.estimate.tokens_per_s for c in order], dtype=float)
            band = None
        else:
            mem, tim, ga, tokens = self._terms()
            peaks = cal.peaks(mem)
            steps = cal.step_times(tim, ga)
            speeds = tokens / steps
            band = cal.memory_band
        if s.calibration != "off":
            mem, tim, ga, _ = self._terms()
            self._peak_sd, self._speed_sd = cal.spreads(mem, tim, ga)
        self._peaks, self._steps, self._speeds = peaks, steps, speeds
        self.pruned, self.trialable, self.predicted_fit = {}, [], []
        self.counts = Counter(self.rules)
        allowed = s.allowed_bytes
        for i, cand in enumerate(order):
            peak = float(peaks[i])
            reason = search_prune_reason(
                cand.estimate, s.margin, s.hardware, allowed, peak=peak, band=band
            )
            if reason and s.prune:
                self.pruned[cand.config] = reason
                self.counts[reason] += 1
                continue
            self.trialable.append(cand)
            if peak <= allowed and not reason:
                self.predicted_fit.append(cand)
        self.trialable.sort(key=self.rank_key)
        self.predicted_fit.sort(key=self.rank_key)
        self._trialable_at = np.array([self._index[c.config] for c in self.trialable], dtype=int)

    def _terms(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The napkin's terms of every candidate (in `all`'s order), made once: memory, time,
        micro-steps per step, tokens per step."""
        if self._arrays is None:
            order = list(self.all.values())
            mem = np.array([memory_terms(c.estimate) for c in order], dtype=float)
            tim = np.array([time_terms(c.estimate) for c in order], dtype=float)
            ga = np.array([c.config.grad_accum for c in order], dtype=float)
            tokens = np.array([c.estimate.tokens_per_s * c.estimate.step_time_s for c in order])
            n = len(order)
            self._arrays = (mem.reshape(n, -1), tim.reshape(n, -1), ga, tokens)
        return self._arrays

    def trialable_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Calibrated tokens/s, peak, and the log-sd of each, of `trialable` in its order."""
        at = self._trialable_at
        return self._speeds[at], self._peaks[at], self._speed_sd[at], self._peak_sd[at]

    def trial_time(self, cand: Candidate, steps: int) -> TrialTime:
        """What a trial of `cand` with `steps` measured steps should take (one warm-up, as
        `autofit.trials.run_trial` runs it; on the data's lengths one more), its step time the
        calibrated estimate's (its own estimate's for a config outside the space, which a
        resumed study may hold): its limit and its slow mark (`autofit.trials.budget`)."""
        s, cfg = self.setting, cand.config
        i = self._index.get(cfg)
        step = float(self._steps[i]) if i is not None else cand.estimate.step_time_s
        return trial_time(s.model, cfg, step, steps, device=s.device, data=s.lengths is not None)

    def rank_key(self, cand: Candidate) -> tuple[int, int, float]:
        """`autofit.plan.rank_key` on the calibrated estimate: fastest first (ties within 0.5%),
        then the plainest, then the lower peak."""
        i = self._index[cand.config]
        return (-speed_bucket(self._speeds[i]), complexity(cand.config), self._peaks[i])


def enumerate_candidates(setting: Setting, calibration: Calibration = NAPKIN) -> Candidates:
    """Every candidate of the setting's space with its napkin estimate, judged by `calibration`
    (default: the napkin itself)."""
    all_cands, rules, considered = estimate_all(setting)
    cands = Candidates(
        setting=setting,
        all={c.config: c for c in all_cands},
        trialable=[],
        predicted_fit=[],
        pruned={},
        counts=Counter(),
        considered=considered,
        rules=rules,
    )
    cands.recalibrate(calibration)
    _make_params(cands)
    return cands


def _make_params(cands: Candidates) -> None:
    """One categorical Optuna param per knob that varies among the trialable candidates (TPE
    models knobs separately, which a single 'candidate' param would hide from it)."""
    s = cands.setting
    # A calibrating search may bring back any candidate the napkin ruled out: all are params.
    calibrating = s.calibration != "off"
    pool = list(cands.all.values()) if calibrating else cands.trialable or list(cands.all.values())
    for name in KNOBS:
        if name == "seq_len" or (name == "grad_accum" and s.global_batch):
            continue
        seen = {getattr(c.config, name) for c in pool}
        order = list(s.space.knobs.get(name, ())) + sorted(seen - set(s.space.knobs[name]))
        choices = tuple(v for v in order if v in seen)
        if len(choices) > 1:
            cands.names.append(name)
            cands.distributions[name] = CategoricalDistribution(choices)
        elif choices:
            cands.fixed[name] = choices[0]
    cands.fixed["seq_len"] = s.seq_len
    cands.fixed.update(s.space.settings)  # the LoRA settings: every candidate carries them


def distinct_seeds(ranked: list[Candidate], n: int) -> list[Candidate]:
    """The `n` best candidates that the napkin can tell apart (speed or peak differ by > 2%)."""
    kept: list[Candidate] = []
    for c in ranked:
        if len(kept) >= n:
            break
        same = any(
            abs(c.estimate.tokens_per_s / max(k.estimate.tokens_per_s, 1e-9) - 1) < DISTINCT
            and abs(c.estimate.peak_bytes / max(k.estimate.peak_bytes, 1) - 1) < DISTINCT
            for k in kept
        )
        if not same:
            kept.append(c)
    return kept


def n_seeds(trials: int) -> int:
    """How many of the napkin's best to enqueue: about half the budget, 1 to 8."""
    return max(1, min(trials, 8, trials // 2 + 1))


def rebuild_trials(study: optuna.Study, cands: Candidates) -> list[Candidate]:
    """A Candidate per finished real trial, in trial order (estimates recomputed: pure math)."""

    s = cands.setting
    out: list[Candidate] = []
    for t in st.real_trials(study):
        if not st.finished(t):
            continue
        cfg = Config.from_dict(t.user_attrs["config"])
        cand = cands.all.get(cfg)
        if cand is None:
            from autofit.estimate import estimate

            cand = Candidate(cfg, estimate(s.model, s.hardware, cfg, device=s.device,
                                           lengths=s.lengths))  # fmt: skip
        result = TrialResult.from_dict(t.user_attrs["result"])
        out.append(
            Candidate(cfg, cand.estimate, result, number=t.number,
                      calibrated=t.user_attrs.get(st.CALIBRATED))
        )  # fmt: skip
    return out
