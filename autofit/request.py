"""What a plan is asked for, in one shape.

`PlanRequest` holds every input of a plan, resolved: the model, the hardware and the space (not
their names), the fixed settings, how many real trials the search may spend (`budget`) and where
its study lives (`study`). Plain nested dataclasses, as torchtitan's `JobConfig`:

- `autofit.plan(...)` checks its keyword arguments and builds one (`PlanRequest.of`);
- the search reads it (its `Setting` is the request plus the headroom line) and stores
  `to_dict()` in its study;
- `autofit export` and a resumed search read it back with `from_dict`, which also reads the
  metadata of studies written before this type existed (the same keys, fewer of them).

Torch-free: it holds only plain data types.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from autofit.checks import MAX_SEQ_LEN, SEARCH_TIMEOUT_S
from autofit.config import MAX_COUNT
from autofit.data import LengthHistogram
from autofit.errors import AutofitError
from autofit.hardware import Hardware
from autofit.models import ModelSpec, spec_from_dict
from autofit.space import Space

# The headroom a winner keeps below usable memory unless `margin` says otherwise.
DEFAULT_MARGIN = 0.05
DEFAULT_TRIALS = 20  # real trials a search spends unless told otherwise
# How a plan uses measurements to correct the napkin (`PlanRequest.calibration`).
CALIBRATION_MODES = ("auto", "study", "off")


@dataclass(frozen=True)
class SearchBudget:
    """What the search may spend on real trials."""

    trials: int = DEFAULT_TRIALS  # real trials, all workers together
    timeout: float | None = SEARCH_TIMEOUT_S  # seconds of trials (--search-timeout; None: no limit)
    # seconds one trial may run (--trial-timeout); None: each trial's own limit from its
    # estimate, at most `TRIAL_TIMEOUT_S` (`autofit.trials.budget.trial_limit`)
    trial_timeout: float | None = None
    steps: int = 3  # measured steps per trial (--steps)
    gpu_memory: int | None = None  # bytes each trial is held to (None: the whole GPU)


@dataclass(frozen=True)
class StudyPlace:
    """Where the search's study and its run folder live (None: the defaults named for the
    request, `autofit-runs/<study>/study.db`)."""

    storage: str | None = None  # an Optuna RDB URL
    name: str | None = None  # the study's name
    run_dir: str | None = None  # plan.json, plan.yaml and trials.png are written here


@dataclass(frozen=True)
class PlanRequest:
    """Every input of a plan. Its own fields say what the plan is for; `budget` and `study` say
    how the search runs and where it keeps its evidence."""

    model: ModelSpec
    hardware: Hardware
    space: Space
    seq_len: int
    global_batch: int | None = None
    margin: float = DEFAULT_MARGIN
    device: str = "cuda"
    prune: bool = True  # False: trials may run candidates the estimate rules out
    # auto: start from this machine's stored calibration, fit the study's trials, store the fit;
    # study: fit the study's trials only (nothing read or written); off: the napkin alone
    calibration: str = "auto"
    budget: SearchBudget = field(default_factory=SearchBudget)
    study: StudyPlace = field(default_factory=StudyPlace)
    # the data's sequence lengths: the plan then searches `batching`, fits the longest
    # micro-batch and ranks by useful tokens/s (None: every sequence is `seq_len` tokens)
    lengths: LengthHistogram | None = None

    @classmethod
    def of(
        cls,
        model: ModelSpec,
        hardware: Hardware,
        space: Space,
        *,
        seq_len: int | None = None,
        global_batch: int | None = None,
        margin: float = DEFAULT_MARGIN,
        device: str = "cuda",
        prune: bool = True,
        calibration: str = "auto",
        trials: int = DEFAULT_TRIALS,
        timeout: float | None = SEARCH_TIMEOUT_S,
        trial_timeout: float | None = None,
        steps: int = 3,
        gpu_memory: int | None = None,
        storage: str | None = None,
        study: str | None = None,
        run_dir: str | Path | None = None,
        lengths: LengthHistogram | None = None,
    ) -> PlanRequest:
        """A request from the flat keyword arguments of `autofit.plan` (and the search's
        callers); `seq_len` defaults to the space's."""
        return cls(
            model=model,
            hardware=hardware,
            space=space,
            seq_len=seq_len or space.seq_len,
            global_batch=global_batch,
            margin=margin,
            device=device,
            prune=prune,
            calibration=calibration,
            budget=SearchBudget(trials, timeout, trial_timeout, steps, gpu_memory),
            study=StudyPlace(storage, study, str(run_dir) if run_dir is not None else None),
            lengths=lengths,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: what a study stores as its metadata."""
        return {
            "model": self.model.to_dict(),
            "hardware": self.hardware.to_dict(),
            "space": self.space.to_dict(),
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "margin": self.margin,
            "device": self.device,
            "prune": self.prune,
            "calibration": self.calibration,
            "budget": _plain(self.budget),
            "study": _plain(self.study),
            "lengths": self.lengths.to_dict() if self.lengths is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanRequest:
        """The inverse of `to_dict`. Keys it does not know are ignored, and the sections that
        studies written by earlier versions lack (`prune`, `budget`, `study`) take defaults."""
        return cls(
            model=spec_from_dict(data["model"]),
            hardware=Hardware.from_dict(data["hardware"]),
            space=Space.from_dict(data["space"]),
            seq_len=data["seq_len"],
            global_batch=data.get("global_batch"),
            margin=data.get("margin", DEFAULT_MARGIN),
            device=data.get("device", "cuda"),
            prune=data.get("prune", True),
            calibration=data.get("calibration", "auto"),
            budget=_section(SearchBudget, data.get("budget")),
            study=_section(StudyPlace, data.get("study")),
            lengths=LengthHistogram.from_dict(data["lengths"]) if data.get("lengths") else None,
        )


def check_plan_numbers(
    margin: float, trials: int, seq_len: int | None, global_batch: int | None
) -> None:
    """A plan's numbers, each within what it can mean (NaN is in no range)."""
    if not 0 <= margin < 1:
        raise AutofitError(
            f"--margin must be a fraction between 0 and 1 (0.05 = 5%); got {margin}."
        )
    if trials < 0:
        raise AutofitError(f"--trials must be 0 or more; got {trials}.")
    if seq_len is not None and not 1 <= seq_len <= MAX_SEQ_LEN:
        raise AutofitError(
            f"--seq-len must be a whole number of tokens from 1 to {MAX_SEQ_LEN:,}; got {seq_len}."
        )
    if global_batch is not None and not 1 <= global_batch <= MAX_COUNT**2:
        raise AutofitError(  # past micro_batch x grad_accum at their largest, per GPU
            f"--global-batch must be a whole number of sequences from 1 to {MAX_COUNT**2:,}; "
            f"got {global_batch}."
        )


def check_calibration(mode: str) -> None:
    if mode not in CALIBRATION_MODES:
        raise AutofitError(
            f"--calibration must be one of {', '.join(CALIBRATION_MODES)} (auto: start from this "
            "machine's stored calibration and update it; study: calibrate on this study's trials "
            f"alone; off: the napkin alone); got {mode!r}."
        )


def _plain(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in fields(section)}


def _section(cls: Any, data: dict[str, Any] | None) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in (data or {}).items() if k in names})
