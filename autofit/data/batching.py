"""How the `batching` knob lays a dataset's sequences out in micro-batches: the one rule the
trials run (`micro_batches`, `longest_micro_batch`; `pack_rows` for the tensors too) and the
estimator counts (`data_shape`).

- `padded`: `micro_batch` sequences in dataset order (random draws), each row padded to the
  longest of them (right padding, as HF's `DataCollatorWithPadding`);
- `grouped`: the same, but the sequences are ordered as HF Trainer's `group_by_length`
  (`LengthGroupedSampler`): a random permutation cut into mega-batches of 50 micro-batches, each
  sorted longest first, then cut into micro-batches;
- `packed`: sequences concatenated in dataset order into rows of exactly `seq_len` tokens (a
  sequence that does not fit the row's rest continues, as a document of its own, at the start of
  the next row: TRL's `wrapped` packing), so no row holds padding; attention and the loss stay
  inside each document (position ids reset per document, `autofit.builder.batching`).

Every sequence is truncated to `seq_len` first. Torch-free.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from autofit.data.histogram import LengthHistogram
from autofit.values import Batching, values

BATCHINGS = values(Batching)
GROUP_MEGABATCH = 50
"""Micro-batches per mega-batch of HF's `LengthGroupedSampler` (`mega_batch_mult` = 50)."""
SAMPLE_ROWS = 20_000
"""Rows a `data_shape` simulates for `grouped` (a fixed seed: the same answer each time)."""


def check_batching(batching: str) -> None:
    """`ValueError` for a `batching` that is none of `BATCHINGS`."""
    if batching not in BATCHINGS:
        raise ValueError(f"batching={batching!r}; allowed: {', '.join(BATCHINGS)}")


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's layout: `rows[i]` the lengths of the documents row i holds (one each
    unless packed) and `width` the padded length of every row."""

    rows: tuple[tuple[int, ...], ...]
    width: int

    @property
    def useful_tokens(self) -> int:
        return sum(sum(row) for row in self.rows)

    @property
    def tokens(self) -> int:
        """Every position computed, padding included."""
        return len(self.rows) * self.width


def _clipped_lengths(hist: LengthHistogram, seq_len: int, k: int, rng: random.Random) -> list[int]:
    return [min(n, seq_len) for n in hist.sample(k, rng)]


def _padded(lengths: list[int], micro_batch: int) -> list[MicroBatch]:
    out = []
    for i in range(0, len(lengths) - micro_batch + 1, micro_batch):
        rows = lengths[i : i + micro_batch]
        out.append(MicroBatch(tuple((n,) for n in rows), max(rows)))
    return out


def _grouped(lengths: list[int], micro_batch: int, rng: random.Random) -> list[MicroBatch]:
    """HF's mega-batches, each sorted longest first and cut into micro-batches; the
    micro-batches of each mega-batch in random order (HF runs them longest first: a few drawn
    for a trial would all be the longest)."""
    mega = micro_batch * GROUP_MEGABATCH
    out: list[MicroBatch] = []
    for i in range(0, len(lengths), mega):
        batches = _padded(sorted(lengths[i : i + mega], reverse=True), micro_batch)
        rng.shuffle(batches)
        out += batches
    return out


def pack_rows(
    lengths: Iterable[int], seq_len: int
) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """The `packed` rule: `lengths` concatenated in order into rows of `seq_len` tokens, a
    sequence that does not fit the row's rest continuing, as a document of its own, at the start
    of the next row (a length of 0 adds nothing). The full rows, each the lengths of its
    documents, and the last row's documents if the lengths do not fill it (else empty)."""
    rows: list[tuple[int, ...]] = []
    row: list[int] = []
    room = seq_len
    for n in lengths:
        while n:
            part = min(n, room)
            row.append(part)
            n -= part
            room -= part
            if room == 0:
                rows.append(tuple(row))
                row, room = [], seq_len
    return rows, tuple(row)


def _packed(lengths: list[int], micro_batch: int, seq_len: int) -> list[MicroBatch]:
    """Full rows only (a run's packed micro-batches are all `seq_len` wide)."""
    rows, _ = pack_rows(lengths, seq_len)
    whole = len(rows) - len(rows) % micro_batch
    return [
        MicroBatch(tuple(rows[i : i + micro_batch]), seq_len) for i in range(0, whole, micro_batch)
    ]


def micro_batches(
    hist: LengthHistogram, batching: str, micro_batch: int, seq_len: int, count: int,
    rng: random.Random,
) -> list[MicroBatch]:  # fmt: skip
    """`count` micro-batches as a run over data with these lengths meets them, in order."""
    check_batching(batching)
    out: list[MicroBatch] = []
    while len(out) < count:
        if batching == Batching.PACKED:
            mean = max(hist.tokens(seq_len) / hist.examples, 1.0)
            need = int((count - len(out)) * micro_batch * seq_len / mean) + micro_batch + 1
            out += _packed(_clipped_lengths(hist, seq_len, need, rng), micro_batch, seq_len)
        else:
            mega = micro_batch * GROUP_MEGABATCH
            need = -(-(count - len(out)) * micro_batch // mega) * mega
            lengths = _clipped_lengths(hist, seq_len, need, rng)
            if batching == Batching.GROUPED:
                out += _grouped(lengths, micro_batch, rng)
            else:
                out += _padded(lengths, micro_batch)
    return out[:count]


def longest_micro_batch(
    hist: LengthHistogram, batching: str, micro_batch: int, seq_len: int
) -> MicroBatch:
    """The micro-batch with the most positions the data can produce, which sets the peak: the
    longest sequence (truncated to `seq_len`) with `micro_batch - 1` others padded to it (they
    may be as long: every row at that width), or for `packed` rows of `seq_len` always."""
    if batching == Batching.PACKED:
        return MicroBatch(((seq_len,),) * micro_batch, seq_len)
    width = min(hist.longest, seq_len)
    return MicroBatch(((width,),) * micro_batch, width)


@dataclass(frozen=True)
class DataShape:
    """What the estimator reads of a dataset for one (batching, micro_batch, seq_len): the row
    width of the longest micro-batch (the peak's sequence length), the mean row width (what a
    step computes) and the mean useful tokens per row (what tokens/s counts)."""

    peak_len: int
    mean_width: float
    mean_useful: float

    @property
    def padding_share(self) -> float:
        """The share of computed positions that are padding."""
        return 1.0 - self.mean_useful / self.mean_width if self.mean_width else 0.0


def data_shape(hist: LengthHistogram, batching: str, micro_batch: int, seq_len: int) -> DataShape:
    """`DataShape` of `hist`: `padded` exactly (the expected longest of `micro_batch`
    independent draws), `grouped` from `SAMPLE_ROWS` simulated rows (a fixed seed),
    `packed` exactly (rows of `seq_len`, no padding)."""
    return _data_shape(hist, batching, micro_batch, seq_len)


@lru_cache(maxsize=1024)
def _data_shape(hist: LengthHistogram, batching: str, micro_batch: int, seq_len: int) -> DataShape:
    peak = longest_micro_batch(hist, batching, micro_batch, seq_len).width
    if batching == Batching.PACKED:
        return DataShape(peak, float(seq_len), float(seq_len))
    clipped = hist.clipped(seq_len)
    mean_len = clipped.tokens() / clipped.examples
    if batching == Batching.PADDED:
        total, below = clipped.examples, 0
        expected = 0.0  # E[max of micro_batch draws] = sum over n of n * P(max == n)
        for n, c in zip(clipped.lengths, clipped.counts, strict=True):
            at_most = (below + c) / total
            expected += n * (at_most**micro_batch - (below / total) ** micro_batch)
            below += c
        return DataShape(peak, expected, mean_len)
    count = max(SAMPLE_ROWS // micro_batch, GROUP_MEGABATCH)
    sample = micro_batches(hist, batching, micro_batch, seq_len, count, random.Random(0))
    rows = len(sample) * micro_batch
    return DataShape(
        peak,
        sum(b.tokens for b in sample) / rows,
        sum(b.useful_tokens for b in sample) / rows,
    )
