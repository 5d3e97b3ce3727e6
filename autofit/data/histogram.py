"""A dataset's sequence lengths as a histogram: the one object the reader produces and the
estimator, the trials, the plan and the run folder read."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LengthHistogram:
    """How many examples hold each token count. `lengths` is sorted ascending and distinct;
    `counts[i]` examples hold `lengths[i]` tokens (before truncation to a plan's `seq_len`).
    `source` names where it came from (a file, for messages)."""

    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.counts):
            raise ValueError("lengths and counts differ in size")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:], strict=False)):
            raise ValueError("lengths must be distinct and ascending")
        if any(n < 1 for n in self.counts) or any(n < 1 for n in self.lengths):
            raise ValueError("every length and count must be at least 1")

    @classmethod
    def of(cls, lengths: Iterable[int], source: str = "") -> LengthHistogram:
        """From one length per example."""
        return cls.of_tally(Counter(int(n) for n in lengths), source)

    @classmethod
    def of_tally(cls, tally: Mapping[int, int], source: str = "") -> LengthHistogram:
        """From how many examples hold each length (`{length: count}`, e.g. a `Counter`)."""
        keys = tuple(sorted(tally))
        return cls(keys, tuple(tally[k] for k in keys), source)

    def _pairs(self) -> zip[tuple[int, int]]:
        return zip(self.lengths, self.counts, strict=True)

    @property
    def examples(self) -> int:
        return sum(self.counts)

    @property
    def longest(self) -> int:
        return self.lengths[-1] if self.lengths else 0

    def clipped(self, seq_len: int) -> LengthHistogram:
        """Each length truncated to `seq_len`, as training sees them."""
        tally: Counter[int] = Counter()
        for n, c in self._pairs():
            tally[min(n, seq_len)] += c
        return LengthHistogram.of_tally(tally, self.source)

    def quantile(self, q: float) -> int:
        """The smallest length that at least a share `q` (0..1) of the examples do not exceed."""
        if not self.lengths:
            return 0
        need = math.ceil(q * self.examples)
        seen = 0
        for n, c in self._pairs():
            seen += c
            if seen >= max(need, 1):
                return n
        return self.lengths[-1]

    def truncated_share(self, seq_len: int) -> float:
        """The share of examples longer than `seq_len` (cut by truncation)."""
        if not self.lengths:
            return 0.0
        return sum(c for n, c in self._pairs() if n > seq_len) / self.examples

    def tokens(self, seq_len: int | None = None) -> int:
        """Total tokens, each example truncated to `seq_len` when given."""
        cap = seq_len if seq_len is not None else self.longest
        return sum(min(n, cap) * c for n, c in self._pairs())

    def sample(self, k: int, rng: random.Random) -> list[int]:
        """`k` lengths drawn with replacement, in proportion to the counts."""
        return rng.choices(self.lengths, weights=self.counts, k=k)

    def summary(self, seq_len: int | None = None) -> dict[str, Any]:
        """count, median, p90, p99, max and (with `seq_len`) the share truncated."""
        out: dict[str, Any] = {
            "examples": self.examples,
            "median": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "p99": self.quantile(0.99),
            "max": self.longest,
        }
        if seq_len is not None:
            out["truncated_share"] = self.truncated_share(seq_len)
        return out

    def summary_json(self, seq_len: int) -> dict[str, Any]:
        """`summary(seq_len)` with the `source`: what a plan's and an estimate's JSON hold."""
        return {"source": self.source, **self.summary(seq_len)}

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "lengths": list(self.lengths), "counts": list(self.counts)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> LengthHistogram:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LengthHistogram:
        return cls(
            tuple(int(n) for n in data["lengths"]),
            tuple(int(n) for n in data["counts"]),
            str(data.get("source", "")),
        )
