"""A search's run folder: `plan.json` (everything), `plan.yaml` (the `autofit` export, when there is
a winner), `trials.png` (the picture) and, for a plan made for data, `lengths.json` (the length
histogram, `LengthHistogram.to_json`, which `--lengths` reads back). The search itself keeps only
its study there (`study.db` by default); the plan files are written by whoever asked for the plan,
once it is done.
Every file is replaced whole (`autofit.files.atomic_write`), never left half-written; a file that
cannot be written (a full disk) is a `WriteError` that carries the plan and says what was kept, and
a plan whose study is gone is never replaced (`check_earlier_plan`)."""

from __future__ import annotations

import json
from pathlib import Path

from autofit.checks import sqlite_path
from autofit.errors import AutofitError, WriteError
from autofit.files import atomic_write, read_head
from autofit.plan import Plan
from autofit.report.plot import plot_trials

PLAN_JSON = "plan.json"
MAX_PLAN_JSON = 64 << 20  # bytes of an earlier plan.json read, at most: a plan is far smaller


def write_run_folder(plan: Plan, folder: str | Path) -> list[Path]:
    """Write the plan's files into `folder`; returns the paths written. When one cannot be
    written, `WriteError` (with `.plan`) names it, why, and what was kept."""
    folder = Path(folder)
    written: list[Path] = []
    current = folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
        current = folder / PLAN_JSON
        atomic_write(current, json.dumps(plan.to_dict(), indent=2, default=str) + "\n")
        written.append(current)
        if plan.request.lengths is not None:
            current = folder / "lengths.json"
            atomic_write(current, plan.request.lengths.to_json() + "\n")
            written.append(current)
        if plan.best is not None:
            current = folder / "plan.yaml"
            written += plan.export("autofit", current)
        current = folder / "trials.png"
        picture = plot_trials(plan, current, plan.allowed_bytes)
        if picture is not None:
            written.append(picture)
    except (OSError, WriteError) as exc:
        why = exc.reason if isinstance(exc, WriteError) else exc.strerror or str(exc)
        plan.run_dir = None  # the report points at no run folder: the error says what is there
        message = _not_written(plan, folder, written, current, why)
        raise WriteError(message, plan, current, why) from None
    return written


def _not_written(plan: Plan, folder: Path, written: list[Path], path: Path, why: str) -> str:
    kept = ", ".join(p.name for p in written) or "no new file"
    where = f"{path.name}: " if path != folder else ""
    again = f"autofit export --storage {plan.storage} --study {plan.study_name} --output plan.yaml"
    return (
        f"The search finished (its result is above), but the run folder {folder} could not be "
        f"written ({where}{why}). Kept: {kept} written there; every file that was there before "
        f"and not replaced is whole; the study, with every finished trial, in {plan.storage}. "
        f"Free some space (or make the folder writable), then `{again}` writes the plan again "
        "without running anything."
    )


def check_earlier_plan(folder: str | Path, storage: str) -> None:
    """Before a search: never replace a plan whose study is gone. A `plan.json` in `folder`
    that names an SQLite study file now missing or empty (0 bytes: SQLite would take it for a
    new database) is the only copy of that plan; the search would start a new study and
    overwrite it. `storage` is the URL this search will use."""
    path = Path(folder) / PLAN_JSON
    if not path.is_file():
        return
    try:
        earlier = json.loads(read_head(path, MAX_PLAN_JSON))
        old_storage = str(earlier["storage"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a plan autofit wrote: the search replaces only its own plan files
    database = sqlite_path(old_storage)
    if database is None or (database.is_file() and database.stat().st_size > 0):
        return
    state = "is empty (0 bytes)" if database.is_file() else "no longer exists"
    same = sqlite_path(storage) == database
    raise AutofitError(
        f"{path} holds an earlier plan (study {earlier.get('study')!r}), but its study "
        f"database {database} {state}, so that plan cannot be made again from its trials; "
        + (
            "this search would start a new study there and replace the plan"
            if same
            else "this search would replace the plan"
        )
        + ". It is kept as it is. Pass --run-dir a new folder, or move "
        f"{path.name} and plan.yaml out of {path.parent} to start over there."
    )
