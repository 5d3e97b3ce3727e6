"""What the search may try: every candidate of the space with its estimate, split into the ones a
trial may spend time on and the ones the estimate rules out, and the Optuna parameters over them.

A candidate is ruled out when its estimated peak is above the headroom line (usable memory x
(1 - margin)) by more than `autofit.plan.PRUNE_TOLERANCE`: it could not be the winner even if the
estimate were off by that much. Candidates between the line and line x (1 + tolerance) may run:
the measurement decides (`autofit.plan.search_prune_reason`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from optuna.distributions import CategoricalDistribution

from autofit.config import KNOBS, Config, derive_grad_accum
from autofit.errors import ConfigError
from autofit.plan import Candidate, PruneReason, estimate_all, rank_key, search_prune_reason
from autofit.plan.prune import allowed_bytes
from autofit.request import PlanRequest

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
    all: dict[Config, Candidate]
    trialable: list[Candidate]  # may cost a trial, ranked best first by estimate
    predicted_fit: list[Candidate]  # trialable and estimated under the headroom line, ranked
    pruned: dict[Config, PruneReason]  # ruled out by the estimate, with the reason
    counts: Counter[str]  # skipped without a trial, by reason (rules of the space included)
    considered: int
    names: list[str] = field(default_factory=list)  # knobs that vary: the Optuna params
    fixed: dict[str, Any] = field(default_factory=dict)
    distributions: dict[str, CategoricalDistribution] = field(default_factory=dict)

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
        """Estimated peak over the headroom line, as a fraction (> 0 means above it)."""
        return cand.estimate.peak_bytes / self.setting.allowed_bytes - 1


def enumerate_candidates(setting: Setting) -> Candidates:
    s = setting
    all_cands, counts, considered = estimate_all(s)
    every: dict[Config, Candidate] = {}
    trialable: list[Candidate] = []
    predicted: list[Candidate] = []
    pruned: dict[Config, PruneReason] = {}
    for cand in all_cands:
        cfg = cand.config
        every[cfg] = cand
        reason = search_prune_reason(cand.estimate, s.margin, s.hardware, s.allowed_bytes)
        if reason and s.prune:
            pruned[cfg] = reason
            counts[reason] += 1
            continue
        trialable.append(cand)
        if cand.estimate.peak_bytes <= s.allowed_bytes and not reason:
            predicted.append(cand)
    trialable.sort(key=rank_key)
    predicted.sort(key=rank_key)
    cands = Candidates(
        setting=s,
        all=every,
        trialable=trialable,
        predicted_fit=predicted,
        pruned=pruned,
        counts=counts,
        considered=considered,
    )
    _make_params(cands)
    return cands


def _make_params(cands: Candidates) -> None:
    """One categorical Optuna param per knob that varies among the trialable candidates (TPE
    models knobs separately, which a single 'candidate' param would hide from it)."""
    s = cands.setting
    pool = cands.trialable or list(cands.all.values())
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
