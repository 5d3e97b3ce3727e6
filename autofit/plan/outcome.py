"""How a trial's outcome reads against the headroom line."""

from __future__ import annotations

from enum import StrEnum

from autofit.trials.result import TrialResult


class Outcome(StrEnum):
    """How a trial reads: its status, or `OVER_LINE` for a run that measured its steps but peaked
    above the headroom line (it cannot be the winner). `SLOW`: stopped after a measured step far
    past its estimate; what it measured still ranks it."""

    OK = "ok"
    SLOW = "slow"
    OVER_LINE = "over line"
    OOM = "oom"
    TIMEOUT = "timeout"
    ERROR = "error"


def trial_status(result: TrialResult | None, allowed_bytes: float) -> Outcome:
    """What a trial's outcome reads as against the headroom line `allowed_bytes`."""
    if result is None:
        return Outcome.ERROR
    try:
        status = Outcome(result.status)
    except ValueError:
        status = Outcome.ERROR
    over = result.peak_bytes is not None and result.peak_bytes > allowed_bytes
    if result.measured and over:
        return Outcome.OVER_LINE
    return status
