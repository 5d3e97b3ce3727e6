"""Writing an export: every file rendered and parsed back before anything touches the disk, then
each written atomically (`autofit.files.atomic_write`); a file autofit did not write is never
replaced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from autofit.errors import AutofitError, WriteError
from autofit.export.render import render_accelerate, render_autofit, trainer_arguments
from autofit.export.schema import MARKER, check_format, plan_document, side_path
from autofit.files import NotARegularFile, atomic_write, read_head

WRITE_HINT = "Choose a file path in a folder you can write in."


def check_export_target(format: str, path: str | Path, flag: str = "--export") -> str:
    """Before anything runs: `format` is known and every file its export writes (the side file
    too) can be written: its folder is writable, and no folder or foreign file is in the way.
    Returns the normalised format."""
    from autofit.checks import check_file_writable

    fmt = check_format(format)
    target = Path(path).expanduser()
    _check_suffix(fmt, target, flag)
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
    _check_suffix(fmt, target, "the export path")
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
        _parse_back(out_path, text, as_json=fmt == "trainer" and out_path == target)
        check_file_writable(out_path, str(out_path), WRITE_HINT)
        _check_replaceable(out_path)
    done: list[Path] = []
    for out_path, text in outputs:
        try:
            atomic_write(out_path, text)
        except OSError as exc:
            why = exc.strerror or str(exc)
            kept = f" {', '.join(map(str, done))} was written." if done else ""
            raise WriteError(
                f"Cannot write {out_path} ({why}); an earlier file there, if any, is left as "
                f"it was.{kept} {WRITE_HINT}",
                plan, out_path, why,
            ) from None  # fmt: skip
        done.append(out_path)
    return done


_YAML_SUFFIXES = (".yaml", ".yml")


def _check_suffix(fmt: str, path: Path, flag: str) -> None:
    """A file's name says what it holds: YAML formats are not written to a `.json` name (which
    accelerate would read as JSON), nor TrainingArguments JSON to a `.yaml` one."""
    suffix = path.suffix.lower()
    if fmt == "trainer" and suffix in _YAML_SUFFIXES:
        named, written, instead = "YAML", "TrainingArguments JSON", path.with_suffix(".json")
        other = "a format that writes YAML (autofit or accelerate)"
    elif fmt != "trainer" and suffix == ".json":
        named, written, instead = "JSON", "YAML", path.with_suffix(".yaml")
        other = "--format trainer, which writes JSON (TrainingArguments)"
    else:
        return
    raise AutofitError(
        f"{flag} {path} names a {named} file, but --format {fmt} writes {written}. Name the file "
        f"{instead.name}, or use {other}."
    )


def _parse_back(path: Path, text: str, as_json: bool) -> None:
    """Never write what cannot be read back."""
    try:
        json.loads(text) if as_json else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:  # pragma: no cover - a renderer bug
        raise AutofitError(
            f"internal error: the export for {path} does not parse ({exc})."
        ) from exc


def _check_replaceable(path: Path) -> None:
    if path.is_dir():
        raise AutofitError(f"{path} is a folder; pass a file path to export to.")
    if not path.exists():
        return
    side = side_path(path)
    try:  # the marker is in the first lines: 4,000 bytes of a file, never all of it
        mine = MARKER in _head(path) or (
            path.suffix == ".json" and side.exists() and MARKER in _head(side)
        )
    except NotARegularFile as exc:
        raise AutofitError(
            f"{exc.filename} is {exc.kind}, not a regular file; autofit exports only to regular "
            f"files. {WRITE_HINT}"
        ) from None
    except OSError as exc:
        raise AutofitError(f"Cannot read {path} to check it before replacing it: {exc}.") from None
    if not mine:
        raise AutofitError(
            f"{path} exists and was not written by autofit; it is left as it is. Choose another "
            "path, or move that file away first."
        )


def _head(path: Path) -> str:
    return read_head(path, 4000).decode("utf-8", errors="replace")
