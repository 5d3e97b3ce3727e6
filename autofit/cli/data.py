"""The CLI's data flags (`--dataset`, `--tokenizer`, `--text-field`, `--lengths`), declared once
for every command that takes them (`data_flags`). Torch-free."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from autofit.data import LengthHistogram
from autofit.data.source import data_lengths

__all__ = ["FLAGS", "data_flags", "data_lengths", "lengths_dict"]

_Command = TypeVar("_Command", bound=Callable[..., Any])

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
        help="Token counts made elsewhere, instead of --dataset: one per line, or a JSON "
        'histogram ({"512": 10, ...} or a run folder\'s lengths.json).',
    ),
}


def data_flags(command: _Command) -> _Command:
    """Give `command` the data flags (after its other options); it receives them as `data`, a
    dict of the four values (None where not given), the keywords of `autofit.plan`."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in FLAGS}
        return command(*args, data=given, **kwargs)

    own = [p for p in inspect.signature(command).parameters.values() if p.name != "data"]
    flags = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                          annotation=str | None)
        for name, option in FLAGS.items()
    ]  # fmt: skip
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
    at = next((i for i, p in enumerate(params) if p.name == "json_out"), len(params))
    run.__signature__ = inspect.Signature(params[:at] + flags + params[at:])  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def lengths_dict(hist: LengthHistogram | None, seq_len: int) -> dict[str, Any]:
    """`{"lengths": summary}` for a command's JSON (as `Plan.to_dict` has it); nothing without
    data."""
    if hist is None:
        return {}
    return {"lengths": hist.summary_json(seq_len)}
