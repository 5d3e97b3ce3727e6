"""A search's run folder: `plan.json` (everything), `plan.yaml` (the `autofit` export, when there is
a winner), `trials.png` (the picture) and, for a plan made for data, `lengths.json` (the length
histogram, `LengthHistogram.to_json`, which `--lengths` reads back). The search itself keeps only
its study there (`study.db` by default); the plan files are written by whoever asked for the plan,
once it is done. Every file is replaced whole (`autofit.files.atomic_write`), never left
half-written."""

from __future__ import annotations

import json
from pathlib import Path

from autofit.files import atomic_write
from autofit.plan import Plan
from autofit.report.plot import plot_trials


def write_run_folder(plan: Plan, folder: str | Path) -> list[Path]:
    """Write the plan's files into `folder`; returns the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "plan.json"]
    atomic_write(written[0], json.dumps(plan.to_dict(), indent=2, default=str) + "\n")
    if plan.request.lengths is not None:
        written.append(folder / "lengths.json")
        atomic_write(written[-1], plan.request.lengths.to_json() + "\n")
    if plan.best is not None:
        written += plan.export("autofit", folder / "plan.yaml")
    picture = plot_trials(plan, folder / "trials.png", plan.allowed_bytes)
    if picture is not None:
        written.append(picture)
    return written
