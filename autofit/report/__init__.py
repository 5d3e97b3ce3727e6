"""What people read: rich tables for the CLI (`tables`), the live progress of a search (`live`),
the picture of its trials (`plot`) and the run folder (`run_folder`). Sizes are printed by
`autofit.units.fmt_size`, the one place that picks a unit. JSON output does not come through here.
"""

from autofit.report.data import lengths_line
from autofit.report.one_config import estimate_report, trial_report
from autofit.report.tables import (
    calibration_report,
    hardware_table,
    models_table,
    pairs_table,
    plan_report,
    plan_table,
    presets_table,
    pruned_lines,
    sweep_line,
    trials_table,
)

__all__ = [
    "calibration_report",
    "estimate_report",
    "hardware_table",
    "lengths_line",
    "models_table",
    "pairs_table",
    "plan_report",
    "plan_table",
    "presets_table",
    "pruned_lines",
    "sweep_line",
    "trial_report",
    "trials_table",
]
