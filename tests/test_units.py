"""Byte sizes as users type them, and as autofit prints them."""

from __future__ import annotations

import pytest

from autofit.errors import AutofitError
from autofit.units import (
    GB,
    GiB,
    MiB,
    all_together,
    device_noun,
    fmt_bytes,
    fmt_count,
    fmt_tokens_per_s,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("24GiB", 24 * GiB),
        ("80GB", 80 * GB),
        ("512MiB", 512 * MiB),
        ("1.5 TiB", int(1.5 * 1024**4)),
        ("24gib", 24 * GiB),
        ("  16 G ", 16 * GB),
        ("1000", 1000),
        (4096, 4096),
    ],
)
def test_parse_size_reads_binary_and_decimal_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["24XB", "GiB", "", "-5GiB", "24 Gibibytes", "1e9"])
def test_parse_size_rejects_unreadable_sizes_with_examples(text):
    with pytest.raises(AutofitError, match=r"24GiB"):
        parse_size(text)


@pytest.mark.parametrize("value", [0, -1, "0GiB"])
def test_parse_size_rejects_non_positive_sizes(value):
    with pytest.raises(AutofitError, match="positive"):
        parse_size(value)


def test_fmt_bytes_and_fmt_count():
    assert fmt_bytes(24 * GiB) == "24.0 GiB"
    assert fmt_bytes(80 * GB, "GB") == "80.0 GB"
    assert fmt_count(6_738_415_616) == "6.74B"
    assert fmt_count(3_426_560) == "3.43M"
    assert fmt_count(12) == "12"


def test_a_runs_ranks_are_gpus_or_cpu_processes_in_every_phrase():
    # A CPU run's ranks are processes over gloo, never GPUs (`autofit --device cpu`).
    assert [device_noun("cuda", n) for n in (1, 2)] == ["GPU", "GPUs"]
    assert [device_noun("cpu", n) for n in (1, 4)] == ["CPU process", "CPU processes"]
    assert all_together(2, "cuda") == "all 2 GPUs together"
    assert all_together(4, "cpu") == "all 4 CPU processes together"
    assert fmt_tokens_per_s(12_800, 2, "cpu") == (
        "12,800 tokens/s for all 2 CPU processes together (6,400 per CPU process)"
    )
    assert fmt_tokens_per_s(9_000.4, 1) == "9,000 tokens/s on 1 GPU"
