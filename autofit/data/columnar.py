"""Columnar datasets: a Parquet file, or a folder written by `datasets.save_to_disk` (Arrow IPC
stream files named by its `state.json`; a `DatasetDict`'s `train` split, or its only split).
One column is read, a record batch at a time, with pyarrow (the `autofit[data]` extra);
`datasets` itself is not needed. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autofit.data.formats import BATCH
from autofit.errors import DataError


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(
            "Reading Parquet files and datasets.save_to_disk folders needs pyarrow, which is not "
            "installed: pip install 'autofit[data]' (or pip install pyarrow). JSON Lines, JSON "
            "and CSV files are read without it."
        ) from None
    return pyarrow


def arrow_files(folder: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder, in order (`state.json`'s `_data_files`)."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            splits = []
        if not splits:
            raise DataError(f"{folder}/dataset_dict.json names no splits; re-save the dataset.")
        split = "train" if "train" in splits else splits[0] if len(splits) == 1 else None
        if split is None:
            raise DataError(
                f"The dataset folder {str(folder)!r} holds the splits {', '.join(splits)} and "
                "none is named train: pass --dataset the split's own folder, e.g. "
                f"{folder / splits[0]}."
            )
        folder = folder / split
    try:
        state = json.loads((folder / "state.json").read_text())
        names = [f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(
            f"Cannot read {folder / 'state.json'} ({exc.__class__.__name__}: {exc}): a "
            "datasets.save_to_disk folder lists its Arrow files there. Re-save the dataset, or "
            "pass a JSON Lines or Parquet file."
        ) from None
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise DataError(f"The dataset folder {str(folder)!r} lacks its file {missing[0]}.")
    return [folder / n for n in names]


def _open_arrow(path: Path) -> Any:
    pa = _pyarrow()
    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_stream(source)  # what datasets writes
    except pa.ArrowInvalid:
        try:
            return pa.ipc.open_file(source)
        except pa.ArrowInvalid as exc:
            raise DataError(f"{path} is not an Arrow IPC file ({exc}).") from None


def _batches_of(reader: Any) -> Iterator[Any]:
    if hasattr(reader, "num_record_batches"):  # the IPC file format
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def column_names(path: Path, kind: str) -> list[str]:
    """The fields every record of a columnar dataset has."""
    if kind == "parquet":
        return list(_parquet(path).schema_arrow.names)
    files = arrow_files(path)
    return list(_open_arrow(files[0]).schema.names)


def _parquet(path: Path) -> Any:
    pa = _pyarrow()
    try:
        return pa.parquet.ParquetFile(str(path))
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(
            f"The dataset {str(path)!r} is not a Parquet file ({exc}). Pass a .parquet file "
            "written by pyarrow, pandas or datasets, or a JSON Lines or CSV file."
        ) from None


def column_batches(path: Path, kind: str, field: str) -> Iterator[tuple[Any, int, int, int]]:
    """(an Arrow array of `field`'s values, its first row's number from 1, rows read, total rows
    or -1 where the files do not say) a record batch at a time."""
    if kind == "parquet":
        pf = _parquet(path)
        total = pf.metadata.num_rows
        batches: Iterator[Any] = pf.iter_batches(batch_size=BATCH, columns=[field])
    else:
        total = -1
        batches = (b for p in arrow_files(path) for b in _batches_of(_open_arrow(p)))
    done = 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(field))
        yield column, done + 1, done + len(column), total
        done += len(column)
