"""The CLI's data flags (`--dataset`, `--tokenizer`, `--text-field`, `--lengths`), declared once
for every command that takes them (`data_flags`). Torch-free."""

from __future__ import annotations

from typing import Any

import typer

from autofit.cli.flags import _Command, gathered, option
from autofit.data import LengthHistogram
from autofit.data.read import LENGTH_FILE_FORMS
from autofit.data.source import DATA_KEYWORDS

__all__ = ["FLAGS", "data_flags", "lengths_dict"]

FLAGS = {
    "dataset": typer.Option(
        None,
        "--dataset",
        metavar="PATH",
        help="Your training data, read locally: a JSON Lines, JSON, CSV or Parquet file, a "
        "folder of such shards, or a folder saved by datasets.save_to_disk. Each example's "
        "tokens are counted (with "
        "--tokenizer) and the plan is made for these lengths.",
    ),
    "tokenizer": typer.Option(
        None,
        "--tokenizer",
        metavar="PATH",
        help="The model's tokenizer: a local tokenizer.json or model folder (nothing is "
        "downloaded). Not needed for pre-tokenized input_ids.",
    ),
    "text_field": typer.Option(
        None,
        "--text-field",
        metavar="NAME",
        help="The field counted (default: input_ids, then messages, a chat rendered with the "
        "tokenizer's chat template, then text).",
    ),
    "lengths": typer.Option(
        None,
        "--lengths",
        metavar="FILE",
        help=f"Token counts made elsewhere, instead of --dataset: {LENGTH_FILE_FORMS} (a run "
        "folder keeps one).",
    ),
}


def data_flags(command: _Command) -> _Command:
    """Give `command` the data flags (after its other options); it receives them as `data`, a
    dict of the four values (None where not given), the API's data keywords (`DataKeywords`, in
    their order)."""
    flags = [option(name, FLAGS[name], str | None) for name in DATA_KEYWORDS]
    return gathered(command, "data", flags, _before_json)


def _before_json(names: list[str]) -> int:
    return names.index("json_out") if "json_out" in names else len(names)


def lengths_dict(hist: LengthHistogram | None, seq_len: int) -> dict[str, Any]:
    """`{"lengths": summary}` for a command's JSON (as `Plan.to_dict` has it); nothing without
    data."""
    if hist is None:
        return {}
    return {"lengths": hist.summary_json(seq_len)}
