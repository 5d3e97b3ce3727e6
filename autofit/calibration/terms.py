"""The calibration's terms: what a peak and a step time are made of, each a factor (1.0 in the
napkin) or an added share (0.0), and their values for one estimate."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

from autofit.estimate import BREAKDOWN_KEYS, TIME_KEYS, Estimate
from autofit.values import Offload

MEMORY_TERMS: tuple[str, ...] = (*BREAKDOWN_KEYS, "allocator")
"""What a peak is made of: the napkin's breakdown at its peak moment, and the caching allocator's
slack (`Estimate.overhead["allocator"]`; 0 on CPU). Each has a factor, 1.0 in the napkin."""
OFFLOADED_TERMS: tuple[str, ...] = ("offloaded_params", "offloaded_optimizer")
"""What the napkin holds on the host per GPU, under `offload: params` and `offload: optimizer`:
none of it should show on the device, so each has a share (0.0 in the napkin) that measurements
may find does (staging copies, a device that is the host: CPU trials)."""
MODES: tuple[str, ...] = (
    "lora", "quant=nf4", "quant=int8", "checkpointing=full", "checkpointing=every-2",
    "checkpointing=selective", "offload=params", "offload=optimizer", "wrap=none", "compile",
)  # fmt: skip
"""Knob values that change how a step runs. Where the napkin is off for one of them alone (its
layout under param offload, recomputation's working set, peft's or NF4's kernels), a share of
the dynamic memory (activations and logits) and of the step time under that mode, 0 in the napkin,
lets a calibration correct those candidates without moving the factors every candidate shares."""
MEMORY_MODE_TERMS: tuple[str, ...] = tuple(f"activations|{m}" for m in MODES)
PEAK_TERMS: tuple[str, ...] = (*MEMORY_TERMS, *OFFLOADED_TERMS, *MEMORY_MODE_TERMS)
TIME_FACTOR_TERMS: tuple[str, ...] = TIME_KEYS
SPEED_MODE_TERMS: tuple[str, ...] = tuple(f"step|{m}" for m in MODES)
SPEED_TERMS: tuple[str, ...] = (*TIME_FACTOR_TERMS, *SPEED_MODE_TERMS)
SHARE_TERMS = frozenset((*OFFLOADED_TERMS, *MEMORY_MODE_TERMS, *SPEED_MODE_TERMS))
"""Terms fitted as an added share (0 in the napkin), not a factor."""
"""What a step time is made of: the napkin's `time_breakdown`."""


def mode_on(cfg: Any, mode: str) -> bool:
    """Whether `cfg` runs in `mode` (one of `MODES`)."""
    if mode == "lora":
        return cfg.lora_rank > 0
    if mode == "compile":
        return bool(cfg.compile)
    knob, value = mode.split("=")
    return str(getattr(cfg, knob)) == value


_MODE_KNOBS = tuple(dict.fromkeys(m.split("=")[0] for m in MODES if "=" in m))
"""The knobs the `MODES` entries of the form `knob=value` read (beside LoRA and compile)."""


def modes_on(cfg: Any) -> tuple[bool, ...]:
    """`mode_on(cfg, m)` for every mode of `MODES`, in order: read once per combination of the
    knobs they depend on (a space scores a few hundred thousand configs of a few dozen)."""
    return _modes_on(cfg.lora_rank > 0, bool(cfg.compile), *(getattr(cfg, k) for k in _MODE_KNOBS))


@functools.lru_cache(maxsize=4096)
def _modes_on(lora: bool, compiled: bool, *values: str) -> tuple[bool, ...]:
    knobs = dict(zip(_MODE_KNOBS, values, strict=True))
    cfg = SimpleNamespace(lora_rank=int(lora), compile=compiled, **knobs)
    return tuple(mode_on(cfg, m) for m in MODES)


def memory_terms(est: Estimate) -> tuple[float, ...]:
    """The napkin's memory terms of an estimate, in `PEAK_TERMS` order."""
    b = est.breakdown
    cfg = est.config
    host = float(est.host_bytes) / max(est.host_ranks, 1)  # per GPU: one node's host
    dynamic = float(b.get("activations", 0) + b.get("logits_loss", 0))
    return (
        *(float(b.get(k, 0)) for k in BREAKDOWN_KEYS),
        float(est.overhead.get("allocator", 0)),
        host if cfg.offload == Offload.PARAMS else 0.0,
        host if cfg.offload == Offload.OPTIMIZER else 0.0,
        *(dynamic if on else 0.0 for on in modes_on(cfg)),
    )


def time_terms(est: Estimate) -> tuple[float, ...]:
    """The napkin's time terms of an estimate, in `SPEED_TERMS` order."""
    t = est.time_breakdown
    step = float(est.step_time_s)
    return (
        *(float(t.get(k, 0.0)) for k in TIME_FACTOR_TERMS),
        *(step if on else 0.0 for on in modes_on(est.config)),
    )


def tokens(est: Estimate) -> float:
    """Tokens per optimizer step as the estimate's tokens/s counts them (useful tokens when the
    data's lengths are known)."""
    return float(est.step_tokens)
