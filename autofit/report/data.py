"""The data's lengths in one line, as the plan and the estimate print them."""

from __future__ import annotations

from pathlib import Path

from autofit.data import LengthHistogram


def lengths_line(hist: LengthHistogram, seq_len: int) -> str:
    """`Data: 1,000 examples (train.jsonl): median 312 tokens, p90 840, p99 1,900, max 4,100;
    2.1% longer than seq_len 2048 are truncated.`"""
    s = hist.summary(seq_len)
    where = f" ({Path(hist.source).name})" if hist.source else ""
    cut = s["truncated_share"]
    tail = (
        f"{_percent(cut)} longer than seq_len {seq_len} are truncated"
        if cut
        else f"none longer than seq_len {seq_len}"
    )
    return (
        f"Data: {s['examples']:,} examples{where}: median {s['median']:,} tokens, p90 "
        f"{s['p90']:,}, p99 {s['p99']:,}, max {s['max']:,}; {tail}."
    )


def _percent(share: float) -> str:
    """A share as a percentage that is never shown as 0% when some examples are cut."""
    text = f"{share:.1%}"
    return text if text != "0.0%" else "<0.1%"
