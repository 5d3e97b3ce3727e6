"""Byte sizes: parsing what users type (`24GiB`, `80GB`, `512MiB`) and printing them."""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import ByteSize, Field, TypeAdapter, ValidationError

from autofit.errors import AutofitError

GiB = 1024**3
MiB = 1024**2
GB = 1000**3

# A positive byte count, or a number with a unit: pydantic's `ByteSize` reads the units (B, KB/KiB,
# MB/MiB, GB/GiB, TB/TiB, ...; a bare K/M/G/T is decimal) and the number.
_SIZE = TypeAdapter(Annotated[ByteSize, Field(gt=0)])
# `ByteSize` reads the leading size of a text and ignores the rest; a size is the whole text.
_ONE_SIZE = re.compile(r"\s*[0-9]*\.?[0-9]+\s*[a-zA-Z]*\s*")


def parse_size(text: str | int | float) -> int:
    """Parse a memory size such as `24GiB`, `80GB`, `1.5 TiB` or a plain byte count."""
    number = isinstance(text, int | float) and not isinstance(text, bool) and math.isfinite(text)
    if number and text <= 0:
        raise AutofitError(f"A memory size must be positive; got {text}.")
    if number or (isinstance(text, str) and _ONE_SIZE.fullmatch(text)):
        try:
            return int(_SIZE.validate_python(int(text) if number else text))
        except ValidationError as exc:
            if exc.errors()[0]["type"] == "greater_than":  # '0GiB'
                raise AutofitError(f"A memory size must be positive; got {text!r}.") from None
    raise AutofitError(
        f"Cannot read the memory size {text!r}. Write a number with a unit, for example "
        "'24GiB', '80GB', '512MiB' (GiB/MiB are powers of 1024, GB/MB powers of 1000)."
    )


def fmt_bytes(n: float, unit: str | None = None) -> str:
    """`fmt_bytes(25769803776)` -> '24.0 GiB'; the unit follows the size (`fmt_size`) unless
    `unit` names one (GiB, MiB, GB)."""
    if unit is None:
        return fmt_size(n)
    scale = {"GiB": GiB, "MiB": MiB, "GB": GB}[unit]
    return f"{n / scale:.1f} {unit}"


def fmt_count(n: float) -> str:
    """`fmt_count(6738415616)` -> '6.74B'."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:g}"


# ----- printing sizes: the one place that picks a unit -------------------------------------------
SIZE_UNITS = (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024))


def size_unit(n: float) -> tuple[str, int]:
    """The binary unit a size of `n` bytes reads best in: the largest one it is at least 1.0 of
    (after rounding to one decimal), e.g. ('MiB', 1048576) for 30 MiB or for 0.5 GiB."""
    for name, scale in SIZE_UNITS:
        if round(abs(n) / scale, 1) >= 1:
            return name, scale
    return "B", 1


def fmt_size(n: float | None) -> str:
    """Bytes for a person, the unit chosen from the magnitude: 30 MiB -> '30.0 MiB', 0.5 GiB ->
    '512.0 MiB', 24 GiB -> '24.0 GiB', 512 -> '512 B'; None (not measured) -> '-'."""
    if n is None:
        return "-"
    name, scale = size_unit(n)
    if scale == 1:
        return f"{n:.0f} B"
    return f"{n / scale:.1f} {name}"


def device_noun(device: str, n: int = 1) -> str:
    """What a run's ranks are, as every report names `n` of them: GPUs, or CPU processes on
    `device` cpu (gloo), e.g. 'GPU', '2 GPUs' -> 'GPUs', 'CPU process', 'CPU processes'."""
    one, many = ("CPU process", "CPU processes") if device == "cpu" else ("GPU", "GPUs")
    return one if n == 1 else many


def all_together(n: int, device: str) -> str:
    """Whose tokens/s a run of `n` ranks reports: 'all 2 GPUs together' (the whole run's)."""
    return f"all {n} {device_noun(device, n)} together"


def whose_tokens(n: int, device: str) -> str:
    """'on 1 GPU', or 'for all 2 GPUs together' (`all_together`): whose a tokens/s is."""
    return f"on 1 {device_noun(device)}" if n <= 1 else f"for {all_together(n, device)}"


def fmt_tokens_per_s(total: float, n: int, device: str = "cuda") -> str:
    """A run's tokens/s as every report words it: for all `n` GPUs (CPU processes on `device`
    cpu) together, and per GPU. Every tokens/s autofit reports is the whole run's."""
    speed = f"{total:,.0f} tokens/s {whose_tokens(n, device)}"
    return speed if n <= 1 else f"{speed} ({total / n:,.0f} per {device_noun(device)})"
