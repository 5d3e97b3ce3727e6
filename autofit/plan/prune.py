"""Pruning policy: which candidates the estimate rules out, and why (`PruneReason`).

Two rules read the same estimate. An estimate-only plan keeps what fits under the headroom line
(`prune_reason`). A search also measures candidates whose estimated peak is above the line by less
than `PRUNE_TOLERANCE`, since the estimate may be off by that much (`search_prune_reason`).
"""

from __future__ import annotations

from enum import StrEnum

from autofit.estimate import MEMORY_ERROR, Estimate
from autofit.estimate.memory import usable_bytes, usable_host_bytes
from autofit.hardware import Hardware
from autofit.request import PlanRequest

PRUNE_TOLERANCE = MEMORY_ERROR
"""How far above the headroom line (as a fraction) an estimated peak may be and a search still
measure its candidate rather than trust the estimate: the napkin's stated error
(`autofit.estimate.MEMORY_ERROR`, the bound `bench/accuracy.py` holds it to). A calibrated search
uses the calibration's measured error instead."""


class PruneReason(StrEnum):
    """Why the estimate rules a candidate out; the value is the sentence users read."""

    NO_BF16 = "GPU has no bf16 support"
    HOST_RAM = "offloaded state above host RAM"
    OVER_CAPACITY = "estimated peak above GPU memory"
    OVER_MARGIN = "estimated peak within the headroom margin"
    BEYOND_TOLERANCE = (
        f"estimated peak more than {PRUNE_TOLERANCE:.0%} (the estimate's error) above the "
        "headroom line"
    )
    BEYOND_CALIBRATED = (
        "calibrated peak more than the calibration's error band above the headroom line"
    )


def headroom_line(usable: float, margin: float) -> float:
    """The headroom line: what a winner's peak may reach, the usable memory less `margin` of it."""
    return usable * (1 - margin)


def request_usable_bytes(request: PlanRequest) -> float:
    """What `max_memory_reserved` may reach on each of a request's GPUs (the smallest one): its
    capacity less the CUDA context, and NCCL's buffers of one communicator on several GPUs (a
    config with more, FSDP2's group of one on one GPU or HSDP's second, has less; its estimate's
    `usable_bytes` says how much)."""
    hw = request.hardware
    return usable_bytes(
        hw.capacity_bytes, request.device, hw.n_gpus, hw.link, context=hw.context_bytes
    )


def allowed_bytes(request: PlanRequest) -> float:
    """The headroom line of a request's GPUs (the smallest one's usable memory)."""
    return headroom_line(request_usable_bytes(request), request.margin)


def host_ram_bound(est: Estimate) -> bool:
    """The offloaded state needs more host RAM than a run may use."""
    return est.host_bytes > usable_host_bytes(est.host_capacity_bytes)


def prune_reason(
    est: Estimate, margin: float, hardware: Hardware, peak: float | None = None
) -> PruneReason | None:
    """Why an estimate rules its candidate out, or None if it may fit with `margin` headroom.
    `peak`: the peak to judge (a calibrated one), default the estimate's."""
    peak = est.peak_bytes if peak is None else peak
    if not hardware.smallest_gpu.bf16:
        return PruneReason.NO_BF16
    if host_ram_bound(est):
        return PruneReason.HOST_RAM
    if peak > est.usable_bytes:
        return PruneReason.OVER_CAPACITY
    if peak > headroom_line(est.usable_bytes, margin):
        return PruneReason.OVER_MARGIN
    return None


def search_prune_reason(
    est: Estimate,
    margin: float,
    hardware: Hardware,
    allowed_bytes: float,
    *,
    peak: float | None = None,
    band: float | None = None,
) -> PruneReason | None:
    """A search's rule: over the headroom line `allowed_bytes` by more than the estimate's error
    is ruled out; closer than that, the measurement decides (None). The error is the napkin's
    `PRUNE_TOLERANCE`, or with a calibrated `peak` the calibration's measured `band`."""
    reason = prune_reason(est, margin, hardware, peak)
    if reason in (PruneReason.OVER_CAPACITY, PruneReason.OVER_MARGIN):
        peak = est.peak_bytes if peak is None else peak
        if band is None:
            beyond = peak > allowed_bytes * (1 + PRUNE_TOLERANCE)
            return PruneReason.BEYOND_TOLERANCE if beyond else None
        return PruneReason.BEYOND_CALIBRATED if peak > allowed_bytes * (1 + band) else None
    return reason
