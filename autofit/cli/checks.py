"""The flags of `autofit plan` that only mean something together: checked before anything runs.

Two flags that contradict each other are refused with one paragraph naming both (`ConfigError`,
exit 2), rather than one silently winning; a flag another makes pointless is named in a
`warning:` paragraph. A flag's own value is checked where the API checks it (`autofit.plan`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from autofit.checks import AutofitWarning, check_search_flags
from autofit.errors import ConfigError
from autofit.request import DEFAULT_TRIALS

DEFAULT_FORMAT = "autofit"
DEFAULT_CALIBRATION = "auto"


def plan_flags(
    *,
    trials: int | None,
    no_trials: bool,
    calibration: str | None,
    no_calibration: bool,
    fmt: str | None,
    export_path: Path | None,
    trial_only: dict[str, Any],
) -> tuple[int, str, str]:
    """(trials, calibration, export format) of `autofit plan`'s flags, each left out as None.
    `trial_only`: the flags that only a search with trials reads (--storage, --study, ...) by
    flag name, None or False where not given. The export target is checked here too."""
    if no_trials and trials is not None and trials > 0:
        raise ConfigError(
            f"--no-trials plans from estimates alone, but --trials {trials} asks for {trials} real "
            "trial(s). Give one of them (--trials 0 is the same as --no-trials)."
        )
    # a negative count is not hidden by --no-trials: `autofit.plan` refuses it
    n_trials = DEFAULT_TRIALS if trials is None else trials
    n_trials = 0 if no_trials and n_trials >= 0 else n_trials
    if no_calibration and calibration not in (None, "off"):
        raise ConfigError(
            f"--no-calibration is --calibration off, but --calibration {calibration} was given "
            "too. Give one of them."
        )
    mode = "off" if no_calibration else calibration or DEFAULT_CALIBRATION
    if fmt is not None and export_path is None:
        raise ConfigError(
            f"--format {fmt} says how --export writes the winner, but no --export PATH was "
            "given, so nothing would be written. Add --export PATH (e.g. --export plan.yaml), or "
            "drop --format."
        )
    fmt = fmt or DEFAULT_FORMAT
    if export_path is not None:
        from autofit.export import check_export_target

        # a typo in the format or an unwritable path fails before any trial runs, not after
        fmt = check_export_target(fmt, export_path)
    check_search_flags(trial_only.get("--search-timeout"), trial_only.get("--node-rank"))
    # given: a value, or a switch turned on (`--node-rank 0` is given, though 0 == False)
    unused = [
        flag for flag, value in trial_only.items() if value is not None and value is not False
    ]
    if n_trials == 0 and unused:
        warnings.warn(
            f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used: "
            f"{'--no-trials' if no_trials else '--trials 0'} plans from estimates alone, with no "
            "study, run folder or trial.",
            AutofitWarning,
            stacklevel=2,
        )
    return n_trials, mode, fmt
