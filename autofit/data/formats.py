"""A local dataset's records, in batches, whatever file holds them: JSON Lines, JSON (a list of
records), CSV, Parquet, or a folder written by `datasets.save_to_disk` (Arrow IPC files).

The text formats' readers (`jsonl_records`, `json_records`, `csv_records`) yield batches of
records, each with where it came from (`line 7`, `record 7`) for errors, and how far through the
input the reader is (for the progress bar). Text files stream line by line; only a `.json` list
is read whole (JSON has no streaming reader in the standard library). Parquet and Arrow are read
one column at a time (`autofit.data.columnar.column_batches`: one field's Arrow array a record
batch at a time, with pyarrow, the `autofit[data]` extra). Torch-free.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from autofit.errors import DataError

BATCH = 10_000  # records per batch: big enough for batch encoding, small enough to stream
TEXT_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv"}
ALLOWED = (
    ".jsonl, .ndjson, .json, .csv (each also .gz), .parquet, a folder of such files (shards of one "
    "format), or a folder saved by datasets.save_to_disk"
)
# the fields a record's text may be found in, in the order they are looked for
INPUT_IDS, MESSAGES, TEXT = "input_ids", "messages", "text"


def dataset_files(path: Path) -> list[tuple[Path, str]]:
    """The files of the dataset at `path` with their kind (`kind_of`): the file itself, a
    `save_to_disk` folder (one entry), or a folder of shards of one format (as a Hub snapshot's
    `data/` holds them: `train-00000-of-00004.parquet`, ...), in name order, hidden files left
    out."""
    if not path.is_dir() or _saved_to_disk(path):
        return [(path, kind_of(path))]
    shards = sorted(
        p for p in path.rglob("*")
        if p.is_file() and _suffix_kind(p) is not None
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )  # fmt: skip
    kinds = sorted({str(_suffix_kind(p)) for p in shards})
    if not shards:
        raise DataError(
            f"The folder {str(path)!r} holds no dataset: no file of a format autofit reads, and it "
            f"is not a folder saved by datasets.save_to_disk (no state.json). Allowed: {ALLOWED}."
        )
    if len(kinds) > 1:
        raise DataError(
            f"The folder {str(path)!r} holds files of several formats ({', '.join(kinds)}): pass "
            "--dataset one file, or a folder of one format's shards."
        )
    return [(p, kinds[0]) for p in shards]


def _saved_to_disk(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _suffix_kind(path: Path) -> str | None:
    """The format a file's name says (a text format's may end in .gz)."""
    name = path.name.lower()
    suffix = Path(name.removesuffix(".gz")).suffix if name.endswith(".gz") else path.suffix.lower()
    if name.endswith(".gz") and suffix not in TEXT_SUFFIXES:
        return None
    if suffix in TEXT_SUFFIXES:
        return TEXT_SUFFIXES[suffix]
    return "parquet" if suffix in (".parquet", ".pq") else None


def kind_of(path: Path) -> str:
    """`jsonl`, `json`, `csv`, `parquet` or `arrow` (a `save_to_disk` folder); `DataError`
    for a path that is not there or not one of them."""
    if not path.exists():
        raise DataError(
            f"The dataset {str(path)!r} does not exist. Pass --dataset a local file ({ALLOWED}); "
            "autofit reads local data only and downloads nothing."
        )
    if path.is_dir() and _saved_to_disk(path):
        return "arrow"
    kind = _suffix_kind(path)
    if kind is None:
        suffix = path.suffix.lower() or "none"
        raise DataError(
            f"The dataset {str(path)!r} has an extension autofit does not read ({suffix}). "
            f"Allowed: {ALLOWED}."
        )
    return kind


@contextlib.contextmanager
def _open(path: Path) -> Iterator[tuple[BinaryIO, Callable[[], int]]]:
    """The file's bytes (decompressed when its name ends in .gz) and how far into the file on
    disk the reader is (for progress); a broken gzip stream is a `DataError`."""
    with open(path, "rb") as raw:
        if path.suffix.lower() != ".gz":
            yield raw, raw.tell
            return
        try:
            with gzip.GzipFile(fileobj=raw) as unzipped:
                yield unzipped, raw.tell  # type: ignore[misc]
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise DataError(
                f"The dataset {str(path)!r} is not a whole gzip file ({exc or 'it ends early'}); "
                "its name ends in .gz. Pass it uncompressed, or re-compress it with gzip."
            ) from None


def _check_text(path: Path) -> None:
    """A text format's file must be text: NUL bytes or invalid UTF-8 at its start say binary."""
    with _open(path) as (f, _):
        head = f.read(8192)
        more = bool(f.read(1))
    if not head.strip() and not more:
        raise DataError(f"The dataset {str(path)!r} is empty: it holds no records.")
    try:
        head.decode("utf-8")
        binary = b"\x00" in head
    except UnicodeDecodeError as exc:
        binary = exc.start < len(head) - 4  # a character cut at the 8 KiB mark is not binary
    if binary:
        raise DataError(
            f"The dataset {str(path)!r} is not a text file (it holds binary bytes near its "
            f"start), but its extension {path.suffix} says text. Pass a UTF-8 "
            "JSON Lines, JSON or CSV file, or a .parquet file for columnar data."
        )


def fields_of(record: Any, path: Path, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise DataError(
            f"{path}, {where}: expected a JSON object (one record with fields such as "
            f'"text", "messages" or "input_ids"), got {type(record).__name__} {_short(record)}.'
        )
    return record


def _short(value: Any, n: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= n else text[: n - 3] + "..."


def jsonl_records(path: Path) -> Iterator[tuple[list[dict[str, Any]], list[str], int, int]]:
    """Batches of (records, where, bytes read, file bytes) from a JSON Lines file, line by line;
    blank lines are skipped."""
    _check_text(path)
    total = path.stat().st_size
    records: list[dict[str, Any]] = []
    where: list[str] = []
    with _open(path) as (f, tell):
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                shown = raw[:60].decode("utf-8", "replace").strip()
                raise DataError(
                    f"{path}, line {number}: not JSON ({exc.__class__.__name__}: "
                    f"{str(exc).split(':')[0]}): {shown!r}. A JSON Lines file holds one JSON "
                    'object per line, e.g. {"text": "..."}.'
                ) from None
            records.append(fields_of(record, path, f"line {number}"))
            where.append(f"line {number}")
            if len(records) >= BATCH:
                yield records, where, tell(), total
                records, where = [], []
    if records:
        yield records, where, total, total


def json_records(path: Path) -> Iterator[tuple[list[dict[str, Any]], list[str], int, int]]:
    """Batches from a `.json` file: a list of records (read whole), or JSON Lines saved as
    `.json` (as `datasets.Dataset.to_json` writes by default), which streams."""
    _check_text(path)
    with _open(path) as (f, _):
        first = f.read(64).lstrip()
    if not first.startswith(b"["):
        yield from jsonl_records(path)
        return
    try:
        with _open(path) as (f, _):
            data = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        line = getattr(exc, "lineno", None)
        raise DataError(
            f"{path}{f', line {line}' if line else ''}: not valid JSON ({exc}). A .json dataset "
            'is a list of records, [{"text": "..."}, ...], or one record per line.'
        ) from None
    total = len(data)
    for start in range(0, total, BATCH):
        chunk = data[start : start + BATCH]
        where = [f"record {start + i + 1}" for i in range(len(chunk))]
        records = [fields_of(r, path, w) for r, w in zip(chunk, where, strict=True)]
        yield records, where, start + len(chunk), total


def csv_records(path: Path) -> Iterator[tuple[list[dict[str, Any]], list[str], int, int]]:
    """Batches from a CSV file with a header row, streamed."""
    _check_text(path)
    total = path.stat().st_size
    with _open(path) as (raw, tell):
        text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        reader = csv.DictReader(text)
        records: list[dict[str, Any]] = []
        where: list[str] = []
        try:
            for row in reader:
                records.append(row)
                where.append(f"line {reader.line_num}")
                if len(records) >= BATCH:
                    yield records, where, tell(), total
                    records, where = [], []
        except (csv.Error, UnicodeDecodeError) as exc:
            raise DataError(
                f"{path}, line {reader.line_num + 1}: not CSV ({exc}). A CSV dataset is UTF-8 "
                "with a header row naming its fields."
            ) from None
    if records:
        yield records, where, total, total
