"""A local dataset's token counts, as a `LengthHistogram`: `read_lengths` for the data itself,
`read_length_file` for counts made elsewhere (`--lengths`).

What is counted, per record: the field `text_field` names, else the first of `input_ids`
(pre-tokenized: its length, no tokenizer needed), `messages` (a chat, rendered with the
tokenizer's chat template) and `text` the first record has. A text's count includes the special
tokens the tokenizer adds (BOS/EOS), as a training collator sees it. Records stream in batches
(`autofit.data.formats`, `autofit.data.columnar`); nothing but the histogram is kept.
Torch-free.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from autofit.checks import MAX_SEQ_LEN, AutofitWarning
from autofit.data.columnar import column_batches, column_names
from autofit.data.formats import (
    INPUT_IDS,
    MESSAGES,
    TEXT,
    csv_records,
    dataset_files,
    json_records,
    jsonl_records,
)
from autofit.data.histogram import LengthHistogram
from autofit.data.progress import Progress
from autofit.data.tokens import NEEDS_TOKENIZER, TokenCounter, load_tokenizer
from autofit.errors import DataError
from autofit.files import special_kind

_RECORDS = {"jsonl": jsonl_records, "json": json_records, "csv": csv_records}


def read_lengths(
    path: str | Path,
    *,
    tokenizer: str | Path | TokenCounter | None = None,
    text_field: str | None = None,
    progress: Progress | None = None,
) -> LengthHistogram:
    """Each record's token count in the dataset at `path` (JSON Lines, JSON, CSV, Parquet, a
    folder of such shards of one format, or a `datasets.save_to_disk` folder), counted with
    `tokenizer` (a local tokenizer.json or model folder; not needed for `input_ids`). `DataError`
    names the file and the line of the first problem. The lengths are not truncated: a plan clips
    them to its `seq_len`."""
    path = Path(path).expanduser()
    files = dataset_files(path)
    shards = progress is not None and len(files) > 1
    # shards are files (a save_to_disk folder is a dataset's only entry): their bytes
    sizes = [file.stat().st_size for file, _ in files] if shards else [0] * len(files)
    reader = _Reader(tokenizer, text_field)
    before = 0
    for (file, kind), size in zip(files, sizes, strict=True):
        reader.path, reader.csv = file, kind == "csv"
        for done, total in _read_file(reader, file, kind):
            if progress is None:
                continue
            if not shards:  # the file's own units: bytes, or rows
                progress(done, total)
            else:  # shards: bytes of all, each shard's share by its own units
                progress(before + (round(size * done / total) if total else 0), sum(sizes))
        before += size
    return reader.histogram(path)


def _read_file(reader: _Reader, file: Path, kind: str) -> Iterator[tuple[int, int | None]]:
    """Count one file's records into `reader`, yielding (done, total) after each batch."""
    if kind in _RECORDS:
        for records, where, done, total in _RECORDS[kind](file):
            reader.add_records(records, where)
            yield done, total
    else:
        reader.field = reader.field_of(column_names(file, kind), "its columns")
        for column, first, done, total in column_batches(file, kind, reader.field):
            reader.add_column(column, first)
            yield done, total if total >= 0 else None


class _Reader:
    """The tally of one dataset's counts. Without `text_field`, each record's field is the first
    of `input_ids`, `messages` and `text` it has (so chats and plain texts may mix)."""

    def __init__(self, tokenizer: Any, text_field: str | None) -> None:
        self.text_field = text_field
        self.tokenizer = tokenizer
        self.path = Path()  # the file being read, `csv` when it is CSV
        self.csv = False
        self.field = ""  # a columnar dataset's column
        self.fields: set[str] = set()  # the fields counted
        self.tally: Counter[int] = Counter()
        self.records = 0

    def field_of(self, names: Iterable[str], where: str) -> str:
        names = list(names)
        if self.text_field is not None:
            if self.text_field not in names:
                raise DataError(
                    f"{self.path}, {where}: the field {self.text_field!r} (--text-field) is "
                    f"missing ({_fields_text(names)}). Every record needs the field counted; fix "
                    "the record, or pass --text-field one of its fields."
                )
            return self.text_field
        found = next((f for f in (INPUT_IDS, MESSAGES, TEXT) if f in names), None)
        if found is None:
            raise DataError(
                f"{self.path}, {where}: no field to count ({_fields_text(names)}). autofit counts "
                f"'{INPUT_IDS}' (pre-tokenized), '{MESSAGES}' (a chat) or '{TEXT}' by default: "
                "pass --text-field NAME to count another field."
            )
        return found

    def counter(self, field: str) -> TokenCounter:
        if not isinstance(self.tokenizer, TokenCounter):
            if self.tokenizer is None:
                raise DataError(f"{self.path}: " + NEEDS_TOKENIZER.format(what=f"{field!r}"))
            self.tokenizer = load_tokenizer(self.tokenizer)
        return self.tokenizer

    def add_records(self, records: list[dict[str, Any]], where: list[str]) -> None:
        groups: dict[str, tuple[list[Any], list[str]]] = {}
        for record, at in zip(records, where, strict=True):
            present = [k for k, v in record.items() if v is not None]
            field = self.field_of(present if self.text_field is None else record, at)
            value = record[field]
            if value is None:
                raise DataError(
                    f"{self.path}, {at}: the field {field!r} is null. Every record needs the "
                    "field counted; fix the record or pass --text-field NAME."
                )
            if self.csv and field in (INPUT_IDS, MESSAGES):
                value = _csv_json(value, self.path, at, field)
            values, places = groups.setdefault(field, ([], []))
            values.append(value)
            places.append(at)
        for field, (values, places) in groups.items():
            self.add(field, values, places)

    def add(self, field: str, values: list[Any], where: list[str]) -> None:
        """Count `values` of `field`: all texts, all token lists or all chats."""
        self.fields.add(field)
        if field == INPUT_IDS:  # already tokenized: its length is its count, no tokenizer read
            _token_ids(values, where, self.path)
        first = values[0]
        if isinstance(first, str):
            _same_type(values, where, str, "text", self.path, field)
            lengths = self.counter(field).count_texts(values)
        elif isinstance(first, list) and any(map(_is_chat, values)):  # not by the first alone
            lengths = self.counter(field).count_chats(values, self.path, where)
        elif isinstance(first, list):
            _same_type(values, where, list, "list of token ids", self.path, field)
            lengths = [len(v) for v in values]
        else:
            raise DataError(
                f"{self.path}, {where[0]}: the field {field!r} holds {type(first).__name__} "
                f"{json.dumps(first)[:40]}; autofit counts a text, a list of token ids, or a "
                "chat (a list of {role, content} messages)."
            )
        self.records += len(lengths)
        self.tally.update(lengths)

    def add_column(self, column: Any, first_row: int) -> None:
        """Count an Arrow array of the chosen field: list lengths without leaving Arrow."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if column.null_count:
            row = first_row + column.is_null().to_pylist().index(True)
            raise DataError(
                f"{self.path}, row {row}: the field {self.field!r} is null. Every record needs "
                "the field counted; fix the row or pass --text-field NAME."
            )
        kind = column.type
        lists = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        if lists and pa.types.is_integer(kind.value_type):
            lengths = pc.list_value_length(column).to_pylist()
            self.fields.add(self.field)
            self.records += len(lengths)
            self.tally.update(lengths)
        else:
            values = column.to_pylist()
            self.add(self.field, values, [f"row {first_row + i}" for i in range(len(values))])

    def histogram(self, source: Path) -> LengthHistogram:
        """The counts of the dataset at `source` (a file or folder)."""
        self.path = source
        if self.records == 0:
            raise DataError(f"The dataset {str(self.path)!r} is empty: it holds no records.")
        fields = ", ".join(sorted(self.fields))
        empty = self.tally.pop(0, 0)
        if empty == self.records:
            raise DataError(
                f"Every record of {self.path} counts 0 tokens (fields counted: {fields}): "
                "nothing to train on. Pass --text-field the field that holds the text."
            )
        if empty:
            warnings.warn(
                f"{empty} of {self.records} records of {self.path} hold no tokens ({fields}); "
                "they are left out of the lengths (a trainer drops them too).",
                AutofitWarning,
                stacklevel=3,
            )
        return LengthHistogram.of_tally(self.tally, str(self.path))


def _is_chat(value: Any) -> bool:
    """A non-empty list of dicts: a chat's messages (a list of token ids holds none)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def _token_ids(values: list[Any], where: list[str], path: Path) -> None:
    for value, at in zip(values, where, strict=True):
        if not isinstance(value, list):
            raise DataError(
                f"{path}, {at}: the field {INPUT_IDS!r} holds {type(value).__name__} "
                f"{json.dumps(value)[:40]}; {INPUT_IDS} must be a list of token ids (e.g. [1, "
                "15043, 29892]: text already tokenized, counted without a tokenizer). A text "
                f"belongs in a {TEXT!r} field (or the one --text-field names), counted with "
                "--tokenizer."
            )


def _same_type(
    values: list[Any], where: list[str], kind: type, what: str, path: Path, field: str
) -> None:
    for value, at in zip(values, where, strict=True):
        if not isinstance(value, kind):
            raise DataError(
                f"{path}, {at}: the field {field!r} holds {type(value).__name__} where the "
                f"record before holds a {what}; every record's must be of one kind."
            )


def _csv_json(value: str, path: Path, at: str, field: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise DataError(
            f"{path}, {at}: the CSV field {field!r} is not JSON ({value[:40]!r}); in a CSV file "
            f"{field} is written as a JSON list."
        ) from None


def _fields_text(names: Iterable[str]) -> str:
    names = list(names)
    return f"its fields: {', '.join(names)}" if names else "it has no fields"


LENGTH_FILE_FORMS = (
    "a text file of one token count per line, or JSON: a list of counts ([512, 87, ...]), a "
    'histogram ({"512": 10, ...}) or autofit\'s lengths.json'
)
"""What a length file may hold, as every message about one (and `--lengths`' help) says it."""
_TAKES = f"--lengths takes {LENGTH_FILE_FORMS}."


def read_length_file(path: str | Path) -> LengthHistogram:
    """Lengths counted elsewhere (`--lengths`): a text file of one integer per line (blank lines
    and `#` comments skipped), or JSON: a list of lengths, a `LengthHistogram.to_json` object
    (`{"lengths": [...], "counts": [...]}`) or a `{"length": count}` mapping. Every length is
    a whole number from 1 to `MAX_SEQ_LEN`, the longest `--seq-len` autofit takes."""
    path = Path(path).expanduser()
    if path.suffix.lower() in (".jsonl", ".ndjson", ".csv", ".parquet") or path.is_dir():
        raise DataError(
            f"{str(path)!r} looks like a dataset, not a length file: pass it with --dataset (and "
            f"--tokenizer) to count its tokens. {_TAKES}"
        )
    kind = special_kind(path)
    if kind is not None:  # /dev/null, a FIFO: nothing to read, or a read that never ends
        raise DataError(f"The length file {str(path)!r} is {kind}, not a regular file. {_TAKES}")
    if not path.is_file():
        raise DataError(f"The length file {str(path)!r} does not exist. {_TAKES}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(
            f"The length file {str(path)!r} is not UTF-8 text (a binary file?). {_TAKES}"
        ) from None
    if not text.strip():
        raise DataError(f"The length file {str(path)!r} is empty: it holds no lengths.")
    if text.lstrip().startswith(("{", "[")):
        return _histogram_json(text, path)
    return LengthHistogram.of(_lines(text, path), source=str(path))


def _lines(text: str, path: Path) -> Iterator[int]:
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            yield _count(line, length=True)
        except ValueError as exc:
            raise DataError(f"{path}, line {number}: {exc}. {_TAKES}") from None


def _histogram_json(text: str, path: Path) -> LengthHistogram:
    problem = "it is not valid JSON"
    try:
        data = json.loads(text)
        if isinstance(data, list):  # the lengths themselves, one per example
            hist = LengthHistogram.of((_count(n, length=True) for n in data), source=str(path))
        elif "lengths" in data and "counts" in data:
            hist = LengthHistogram(
                tuple(_count(n, length=True) for n in data["lengths"]),
                tuple(_count(n) for n in data["counts"]),
                str(data.get("source") or path),
            )
        else:
            pairs = sorted((_count(k, length=True), _count(v)) for k, v in data.items())
            hist = LengthHistogram(
                tuple(k for k, _ in pairs), tuple(v for _, v in pairs), str(path)
            )
        if hist.lengths:
            return hist
        problem = "it holds no lengths"
    except json.JSONDecodeError as exc:
        problem = f"line {exc.lineno}: not valid JSON ({exc.msg})"
    except (ValueError, TypeError, AttributeError) as exc:
        problem = str(exc) or "a length or count is not a whole number >= 1"
    raise DataError(f"The length file {path}: {problem}. {_TAKES}")


def _count(value: Any, length: bool = False) -> int:
    """A whole number >= 1 from JSON (an int, or a key's digits) or a line of text; a `length`
    at most `MAX_SEQ_LEN`, the longest `--seq-len` autofit takes."""
    digits = str(value).strip()
    what = "a token count (a whole number >= 1)" if length else "a whole number >= 1"
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not digits.isdigit():
        raise ValueError(f"{digits[:40]!r} is not {what}")
    if len(digits) > 40:
        raise ValueError(f"{digits[:20]}... ({len(digits):,} digits) is no count of anything")
    n = int(digits)
    if n < 1:
        raise ValueError(f"{n} is not {what}")
    if length and n > MAX_SEQ_LEN:
        raise ValueError(
            f"a length of {n:,} tokens is longer than the longest sequence autofit plans for "
            f"(--seq-len at most {MAX_SEQ_LEN:,})"
        )
    return n
