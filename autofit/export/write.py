"""Writing an export: every file rendered and parsed back before anything touches the disk, then
each written atomically (`autofit.files.atomic_write`); a file autofit did not write is never
replaced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from autofit.errors import AutofitError
from autofit.export.render import render_accelerate, render_autofit, trainer_arguments
from autofit.export.schema import FORMATS, MARKER, plan_document, side_path
from autofit.files import atomic_write


def check_format(format: str) -> str:
    fmt = str(format).strip().lower()
    if fmt not in FORMATS:
        from autofit.errors import did_you_mean

        raise AutofitError(
            f"Unknown export format {format!r}.{did_you_mean(fmt, FORMATS)} Allowed formats: "
            f"{', '.join(FORMATS)} (autofit: YAML plan for autofit.load_plan; accelerate: an "
            "Accelerate config file (plain, DDP or FSDP2); trainer: TrainingArguments JSON)."
        )
    return fmt


WRITE_HINT = "Choose a file path in a folder you can write in."


def check_export_target(format: str, path: str | Path, flag: str = "--export") -> str:
    """Before anything runs: `format` is known and every file its export writes (the side file
    too) can be written: its folder is writable, and no folder or foreign file is in the way.
    Returns the normalised format."""
    from autofit.checks import check_file_writable

    fmt = check_format(format)
    target = Path(path).expanduser()
    for out_path in [target] if fmt == "autofit" else [target, side_path(target)]:
        what = f"{flag} {target}" if out_path == target else f"{out_path} (the side file)"
        check_file_writable(out_path, what, WRITE_HINT)
        _check_replaceable(out_path)
    return fmt


def export_plan(plan: Any, format: str, path: str | Path) -> list[Path]:
    """Write the winner of `plan` as `format` to `path`; returns every file written."""
    fmt = check_format(format)
    doc = plan_document(plan)
    target = Path(path).expanduser()
    outputs: list[tuple[Path, str]] = []
    if fmt == "autofit":
        outputs.append((target, render_autofit(doc, target)))
    else:
        side = side_path(target)
        if fmt == "accelerate":
            text = render_accelerate(doc, side, target)
        else:
            text = json.dumps(trainer_arguments(doc), indent=2) + "\n"
        outputs += [(target, text), (side, render_autofit(doc, side))]
    from autofit.checks import check_file_writable

    for out_path, text in outputs:
        _parse_back(out_path, text)
        check_file_writable(out_path, str(out_path), WRITE_HINT)
        _check_replaceable(out_path)
    for out_path, text in outputs:
        try:
            atomic_write(out_path, text)
        except OSError as exc:
            raise AutofitError(
                f"Cannot write {out_path} ({exc.strerror or exc}). {WRITE_HINT}"
            ) from None
    return [p for p, _ in outputs]


def _parse_back(path: Path, text: str) -> None:
    """Never write what cannot be read back."""
    try:
        json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:  # pragma: no cover - a renderer bug
        raise AutofitError(
            f"internal error: the export for {path} does not parse ({exc})."
        ) from exc


def _check_replaceable(path: Path) -> None:
    if path.is_dir():
        raise AutofitError(f"{path} is a folder; pass a file path to export to.")
    if not path.exists():
        return
    try:
        head = path.read_text(errors="replace")[:4000]
    except OSError as exc:
        raise AutofitError(f"Cannot read {path} to check it before replacing it: {exc}.") from None
    side = side_path(path)
    mine = MARKER in head or (
        path.suffix == ".json"
        and side.exists()
        and MARKER in side.read_text(errors="replace")[:4000]
    )
    if not mine:
        raise AutofitError(
            f"{path} exists and was not written by autofit; it is left as it is. Choose another "
            "path, or move that file away first."
        )
