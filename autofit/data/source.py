"""Where a plan's lengths come from: a dataset with its tokenizer and field, or a length file.

`DataSource` is what the flags (`--dataset`, `--tokenizer`, `--text-field`, `--lengths`), the API's
keywords and a space file's `dataset:` key (`SpaceData`, its schema) say; `read` turns it into a
`LengthHistogram`. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from autofit.data.histogram import LengthHistogram
from autofit.data.progress import stderr_bar
from autofit.errors import DataError, SpaceError

if TYPE_CHECKING:
    from typing_extensions import Unpack

BOTH = (
    "--dataset and --lengths both say where the sequence lengths come from; give one: --dataset "
    "PATH counts the tokens of a local dataset (with --tokenizer), --lengths FILE reads counts "
    "made elsewhere (one per line, or a JSON histogram)."
)


class SpaceData(BaseModel):
    """The data plans are made for: a dataset counted with a tokenizer, or a length file."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None, description="A local JSON Lines, JSON, CSV or Parquet file or save_to_disk folder."
    )
    tokenizer: str | None = Field(None, description="A local tokenizer.json or model folder.")
    text_field: str | None = Field(
        None, description="The field counted (default: input_ids, messages or text)."
    )
    lengths: str | None = Field(
        None, description="A length file (one count per line, or a JSON histogram) instead."
    )


def as_space_data(value: Any) -> Any:
    """`dataset: train.jsonl` stands for `dataset: {path: train.jsonl}`."""
    return {"path": value} if isinstance(value, str) else value


@dataclass(frozen=True)
class DataSource:
    """A dataset (`dataset`, counted with `tokenizer` in `text_field`) or a length file
    (`lengths`); all None: no data, every sequence is `seq_len` long."""

    dataset: str | None = None
    tokenizer: str | None = None
    text_field: str | None = None
    lengths: str | None = None

    def __post_init__(self) -> None:
        if self.dataset is not None and self.lengths is not None:
            raise DataError(BOTH)

    @property
    def given(self) -> bool:
        return self.dataset is not None or self.lengths is not None

    @classmethod
    def of_space(cls, data: SpaceData | None, where: str) -> DataSource | None:
        """A space file's `dataset:` (read at `where`), relative paths from the file's folder."""
        if data is None:
            return None
        if (data.path is None) == (data.lengths is None):
            raise SpaceError(
                f"{where}: dataset needs exactly one of path (a dataset to count) and lengths (a "
                "length file); e.g. `dataset: {path: train.jsonl, tokenizer: model/}`."
            )
        source = cls(data.path, data.tokenizer, data.text_field, data.lengths)
        return source.relative_to(Path(where).parent)

    def over(self, base: DataSource | None) -> DataSource:
        """These values where given, `base`'s (a space file's) for the rest; a dataset or a
        length file given here replaces both of `base`'s."""
        if base is None:
            return self
        if self.given:
            keep = {"dataset": self.dataset, "lengths": self.lengths}
        else:
            keep = {"dataset": base.dataset, "lengths": base.lengths}
        return DataSource(
            **keep,
            tokenizer=self.tokenizer if self.tokenizer is not None else base.tokenizer,
            text_field=self.text_field if self.text_field is not None else base.text_field,
        )

    def relative_to(self, folder: Path) -> DataSource:
        """Relative paths read from `folder` (a space file's)."""

        def at(p: str | None) -> str | None:
            return p if p is None or Path(p).expanduser().is_absolute() else str(folder / p)

        return replace(
            self, dataset=at(self.dataset), tokenizer=at(self.tokenizer), lengths=at(self.lengths)
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def read(self, progress: bool = False) -> LengthHistogram | None:
        """The histogram (None without data); a progress bar on stderr when `progress` and stderr
        is a terminal. `--tokenizer` or `--text-field` without data is an error: they would be
        ignored."""
        if not self.given:
            if self.tokenizer is not None or self.text_field is not None:
                flag = "--tokenizer" if self.tokenizer is not None else "--text-field"
                raise DataError(
                    f"{flag} says how to count a dataset's tokens, but no --dataset was given. "
                    "Add --dataset PATH (a local JSON Lines, JSON, CSV or Parquet file, or a "
                    "datasets.save_to_disk folder), or drop it."
                )
            return None
        from autofit.data.read import read_length_file, read_lengths

        if self.lengths is not None:
            return read_length_file(self.lengths)
        assert self.dataset is not None
        with stderr_bar(f"Counting tokens in {Path(self.dataset).name}", progress) as bar:
            return read_lengths(
                self.dataset, tokenizer=self.tokenizer, text_field=self.text_field, progress=bar
            )


class DataKeywords(TypedDict, total=False):
    """The data keywords of `autofit.estimate`, `autofit.plan` and `autofit.trial` (the CLI's
    `--dataset`, `--tokenizer`, `--text-field` and `--lengths`): a `dataset` (a local JSON
    Lines, JSON, CSV or Parquet file, or a `datasets.save_to_disk` folder) counted with
    `tokenizer` (a local tokenizer.json or model folder) in `text_field`, or `lengths` (a length
    file, or a `LengthHistogram`)."""

    dataset: str | Path | None
    tokenizer: str | Path | None
    text_field: str | None
    lengths: str | Path | LengthHistogram | None


DATA_KEYWORDS = tuple(DataKeywords.__annotations__)


def data_keywords(function: str, keywords: dict[str, Any], *, only: bool) -> DataKeywords:
    """The data keywords taken out of `keywords`, the `**` arguments of a call of `function`;
    `only`: it takes no others (`autofit.plan`), and another is refused with the `TypeError`
    Python raises for an unexpected keyword."""
    if only:
        for name in keywords:
            if name not in DATA_KEYWORDS:
                raise TypeError(f"{function}() got an unexpected keyword argument '{name}'")
    return DataKeywords(**{name: keywords.pop(name) for name in DATA_KEYWORDS if name in keywords})


def data_lengths(
    base: DataSource | None = None, progress: bool = False, **data: Unpack[DataKeywords]
) -> LengthHistogram | None:
    """The API's data keywords (`DataKeywords`): the histogram they name, over `base` (a space
    file's `dataset:`); `lengths` may be a `LengthHistogram` already."""
    lengths = data.get("lengths")
    if isinstance(lengths, LengthHistogram):
        if data.get("dataset") is not None:
            raise DataError(BOTH)
        return lengths
    given = DataSource(**{name: None if data.get(name) is None else str(data.get(name))
                          for name in DATA_KEYWORDS})  # fmt: skip
    return given.over(base).read(progress)
