"""The plan's data: `Candidate` (a config, its estimate, its trial) and `Plan` (the winner and the
evidence)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from autofit.arch import structure_of
from autofit.config import Config
from autofit.estimate import Estimate
from autofit.export import export_plan
from autofit.hardware import Hardware
from autofit.models import ModelSpec
from autofit.plan.explain import mesh_comparison, tally
from autofit.plan.prune import allowed_bytes, request_usable_bytes
from autofit.request import PlanRequest
from autofit.space import Space
from autofit.trials.result import TrialResult


@dataclass(slots=True)  # a space makes a few hundred thousand: no __dict__ each
class Candidate:
    """One configuration with its napkin estimate and, if it ran, its measured trial."""

    config: Config
    estimate: Estimate
    trial: TrialResult | None = None  # the measured run, when a trial ran
    verified: bool = False  # re-run with more steps and still fit
    number: int | None = None  # the Optuna trial number of `trial` (progress lines show it too)
    # the calibrated estimate (peak_bytes, tokens_per_s, step_time_s) made before the trial ran
    calibrated: dict[str, float] | None = None

    @property
    def measured(self) -> bool:
        return self.trial is not None and self.trial.measured

    @property
    def tokens_per_s(self) -> float:
        """Measured where a trial ran, else estimated; the whole run's, every GPU together."""
        if self.measured and self.trial.tokens_per_s is not None:
            return float(self.trial.tokens_per_s)
        return self.estimate.tokens_per_s

    @property
    def peak_bytes(self) -> int:
        if self.measured and self.trial.peak_bytes is not None:
            return int(self.trial.peak_bytes)
        return self.estimate.peak_bytes

    @property
    def step_time_s(self) -> float:
        if self.measured and self.trial.step_time_s is not None:
            return float(self.trial.step_time_s)
        return self.estimate.step_time_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "label": self.config.short(),
            "measured": self.measured,
            "verified": self.verified,
            "tokens_per_s": self.tokens_per_s,
            "peak_bytes": self.peak_bytes,
            "step_time_s": self.step_time_s,
            "estimate": {
                "peak_bytes": self.estimate.peak_bytes,
                "peak_allocated_bytes": self.estimate.peak_allocated_bytes,
                "allocator_slack_bytes": self.estimate.allocator_slack_bytes,
                "outside_allocator": {
                    k: v for k, v in self.estimate.overhead.items() if k != "allocator"
                },
                "device_bytes": self.estimate.device_bytes,
                "tokens_per_s": self.estimate.tokens_per_s,
                "step_time_s": self.estimate.step_time_s,
                "breakdown": self.estimate.breakdown,
                # of the positions a step computes, the share that is padding (0 without data)
                "padding_share": self.estimate.padding_share,
            },
            "calibrated": dict(self.calibrated) if self.calibrated is not None else None,
            "trial": self.trial.to_dict() if self.trial is not None else None,
            "trial_number": self.number,
        }


_T = TypeVar("_T")


class _OfRequest(Generic[_T]):
    """A `Plan` attribute that is its request's, read through: `plan.model` is
    `plan.request.model` (read-only)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, plan: Plan | None, owner: type | None = None) -> _T:
        if plan is None:  # the class's attribute: the descriptor itself
            return self  # type: ignore[return-value]
        return getattr(plan.request, self.name)

    def __set__(self, plan: Plan, value: Any) -> None:
        raise AttributeError(f"a plan's {self.name} is its request's (`plan.request`)")


@dataclass
class Plan:
    """The outcome of planning: `best`, the evidence, and what was pruned and why."""

    request: PlanRequest  # what the plan is for: model, hardware, space, seq_len, batch, margin
    best: Candidate | None
    ranked: list[Candidate]  # candidates that fit, best first
    trials: list[Candidate] = field(default_factory=list)  # candidates that ran a trial
    pruned: Counter[str] = field(default_factory=Counter)  # PruneReason or a space rule
    considered: int = 0
    reason: str = ""
    advice: str = ""  # when nothing fits: what bound hardest and what would help
    storage: str | None = None
    study_name: str | None = None
    run_dir: str | None = None
    # how measurements corrected the napkin (`autofit.search.calibrated.summary`); None: not used
    calibration: dict[str, Any] | None = None
    # a search's candidates the estimate says fit that no trial measured (it stopped first: its
    # time or trial budget, or nothing untried was expected to gain), fastest first
    untried: list[Candidate] = field(default_factory=list)

    # what the plan is for, read through to its request
    model = _OfRequest[ModelSpec]()
    hardware = _OfRequest[Hardware]()
    space = _OfRequest[Space]()
    seq_len = _OfRequest[int]()
    global_batch = _OfRequest[int | None]()
    margin = _OfRequest[float]()
    device = _OfRequest[str]()

    @property
    def capacity_bytes(self) -> int:
        return self.hardware.capacity_bytes

    @property
    def usable_bytes(self) -> float:
        """What a config's reserved peak may reach per GPU: the capacity less what lies outside
        the allocator (`prune.request_usable_bytes`); the one capacity the plan's report names."""
        return request_usable_bytes(self.request)

    @property
    def allowed_bytes(self) -> float:
        """The headroom line: a measured winner's peak must stay at or below it."""
        return allowed_bytes(self.request)

    @property
    def searched(self) -> bool:
        """A search's plan (a study with trials), not an estimate-only one."""
        return self.study_name is not None or bool(self.trials)

    def tally(self) -> list[tuple[str, int, list[tuple[str, int]]]]:
        """Where each of the `considered` combinations went, as (what, how many, [(reason, how
        many)]); every combination is in exactly one row (`explain.tally`)."""
        return tally(self)

    def mesh_comparison(self) -> dict[str, Any] | None:
        """Past one node: the best HSDP config against the best flat FSDP one
        (`explain.mesh_comparison`); None on one node."""
        return mesh_comparison(self.ranked, self.hardware)

    def export(self, format: str, path: str | Path) -> list[Path]:
        """Write the winner as `autofit` YAML, an `accelerate` FSDP2 config or `trainer` JSON."""
        return export_plan(self, format, path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "n_params": structure_of(self.model).n_params,
            "hardware": self.hardware.to_dict(),
            "space": self.space.name,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "margin": self.margin,
            "device": self.device,
            "capacity_bytes": self.capacity_bytes,
            "usable_bytes": self.usable_bytes,
            "best": self.best.to_dict() if self.best else None,
            "reason": self.reason,
            "advice": self.advice,
            "considered": self.considered,
            "fitting": len(self.ranked),
            "pruned": dict(self.pruned),
            "tally": {what: n for what, n, _ in self.tally()},
            "hsdp_vs_fsdp": self.mesh_comparison(),
            "ranked": [c.to_dict() for c in self.ranked[:20]],
            "trials": [c.to_dict() for c in self.trials],
            "storage": self.storage,
            "study": self.study_name,
            "run_dir": self.run_dir,
            "calibration": self.calibration,
            "untried": {
                "count": len(self.untried),
                "fastest": [c.to_dict() for c in self.untried[:5]],
            },
            # the data's lengths summarised; the histogram itself is the run folder's lengths.json
            "lengths": None
            if (hist := self.request.lengths) is None
            else hist.summary_json(self.seq_len),
        }
