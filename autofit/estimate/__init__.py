"""Napkin estimates: peak memory per GPU (with a breakdown) and step time of one configuration.

`estimate(model, hardware, config)` is pure arithmetic over `memory` and `speed`; it scores tens
of thousands of candidates per second, which is what lets the search prune before any trial.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from autofit.arch import Structure, structure_of
from autofit.config import Config, Sharding, sharding_for, wrap_units
from autofit.estimate import memory as mem
from autofit.estimate import speed as spd
from autofit.estimate.peak import BREAKDOWN_KEYS, MEMO_SIZE, Peaks
from autofit.estimate.speed import TIME_KEYS
from autofit.hardware import Hardware
from autofit.models import ModelSpec

__all__ = ["BREAKDOWN_KEYS", "TIME_KEYS", "Estimate", "estimate", "estimate_many"]


@dataclass
class Estimate:
    """What the napkin predicts for one config on one piece of hardware (per GPU)."""

    config: Config
    peak_bytes: int  # predicted torch.cuda.max_memory_reserved on the busiest GPU
    peak_allocated_bytes: int  # predicted max_memory_allocated; == sum(breakdown)
    capacity_bytes: int
    usable_bytes: int  # capacity minus CUDA context
    within_capacity: bool  # peak <= usable bytes and offloaded state within host RAM; no margin
    breakdown: dict[str, int]  # bytes by part at the peak moment
    peak_phase: str  # "forward" (end of forward), "optimizer" (step), "gather" (root all-gather)
    overhead: dict[str, int]  # allocator slack and CUDA context
    host_bytes: int  # host RAM for offloaded parts, all ranks together
    host_capacity_bytes: int
    step_time_s: float
    tokens_per_s: float
    time_breakdown: dict[str, float] = field(default_factory=dict)
    n_gpus: int = 1
    sharding: str = "fsdp2"  # how the run holds the model: none (plain module), ddp, fsdp2

    @property
    def fits(self) -> bool:
        """The old name of `within_capacity`, kept for callers (and as the JSON key `fits`). It
        is not the planner's test, which also keeps a headroom margin (`autofit.plan`)."""
        return self.within_capacity

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "peak_bytes": self.peak_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "capacity_bytes": self.capacity_bytes,
            "usable_bytes": self.usable_bytes,
            "fits": self.within_capacity,
            "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase,
            "overhead": dict(self.overhead),
            "host_bytes": self.host_bytes,
            "host_capacity_bytes": self.host_capacity_bytes,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "time_breakdown": dict(self.time_breakdown),
            "n_gpus": self.n_gpus,
            "sharding": self.sharding,
        }


def estimate(
    model: ModelSpec, hardware: Hardware, config: Config, *, device: str = "cuda"
) -> Estimate:
    """Predict peak memory per GPU and step time of `config` for `model` on `hardware`.

    `device="cpu"` predicts what a CPU trial measures (tensor bytes only: no CUDA context, no
    caching-allocator slack) so CPU trials can check the same formulas.
    """
    return estimate_many(model, hardware, (config,), device=device)[0]


# Every knob and setting but `loss`, which changes no FLOP nor byte moved (the LM head's matmul is
# the same however the loss is chunked or fused): what a step time depends on.
_TIMED_KNOBS = attrgetter(*(f.name for f in fields(Config) if f.name != "loss"))


def estimate_many(
    model: ModelSpec, hardware: Hardware, configs: Iterable[Config], *, device: str = "cuda"
) -> list[Estimate]:
    """`estimate` of each of `configs`, in order. The configs of a space share most knob values,
    so each group of terms is computed once per distinct value of the knobs it reads (memory:
    `autofit.estimate.peak.Peaks`; the step time once per value of every knob but `loss`)."""
    n = max(hardware.n_gpus, 1)
    s = structure_of(model)
    peaks = Peaks(model, n, device)
    step_times: dict[Any, tuple[dict[str, float], float]] = {}  # and their sum
    capacity = hardware.smallest_gpu.memory_bytes
    usable = mem.usable_bytes(capacity, device)
    host_cap = hardware.host_ram_bytes
    host_usable = mem.usable_host_bytes(host_cap)
    out = []
    for config in configs:
        peak = peaks.of(config)
        host = peak.host
        fits = peak.reserved <= usable and (host <= host_usable if host else True)
        key = _TIMED_KNOBS(config)
        timed = step_times.get(key)
        if timed is None:
            if len(step_times) >= MEMO_SIZE:
                step_times.clear()
            times = step_time(s, hardware, config, peak.trainable, peak.shard)
            timed = step_times[key] = times, sum(times.values())
        times, step = timed
        tokens = config.micro_batch * config.grad_accum * n * config.seq_len
        out.append(
            Estimate(
                config=config,
                peak_bytes=peak.reserved,
                peak_allocated_bytes=peak.allocated,
                capacity_bytes=int(capacity),
                usable_bytes=int(usable),
                within_capacity=bool(fits),
                breakdown=peak.breakdown.copy(),
                peak_phase=peak.phase,
                overhead=peak.overhead.copy(),
                host_bytes=int(host),
                host_capacity_bytes=int(host_cap),
                step_time_s=step,
                tokens_per_s=tokens / step if step > 0 else 0.0,
                time_breakdown=times.copy(),
                n_gpus=n,
                sharding=peak.sharding,
            )
        )
    return out


def step_time(
    s: Structure, hardware: Hardware, config: Config, trainable: int, shard: int
) -> dict[str, float]:
    """Seconds per optimizer step by part: compute, exposed communication, offload, optimizer."""
    gpu = hardware.smallest_gpu
    n = max(hardware.n_gpus, 1)
    tokens = config.micro_batch * config.seq_len
    flops = tokens * spd.micro_step_flops(
        s, config.seq_len, config.lora_rank, config.checkpointing, config.lora_targets
    )
    compute = flops / (gpu.bf16_tflops * 1e12 * spd.matmul_efficiency(tokens))
    compute += spd.dequant_time(s, config.quant, config.checkpointing, gpu.mem_bw_gbs)
    if config.checkpointing == "selective":
        compute *= 1.03  # pointwise recompute: no matmuls, a few % of layer time (assumed)
    if config.compile:
        compute = spd.compiled_compute_time(compute)

    gathered = spd.comm_bytes_per_micro_step(
        s, config.quant, config.lora_rank, config.wrap, config.reshard, config.lora_targets
    )
    gather = spd.ring_time(
        gathered,
        shard,
        hardware.link_bw_gbs,
    )
    units = len(wrap_units(config.wrap, s.layers))
    if units >= 2:  # prefetching overlaps all but the first unit's gather with compute
        micro = max(compute, gather) + gather / units
    else:
        micro = compute + gather
    reduce = spd.ring_time(
        spd.reduce_bytes_per_step(trainable, config.wrap), n, hardware.link_bw_gbs
    )
    if sharding_for(config.wrap, n) is Sharding.DDP:
        grad_bytes = spd.reduce_bytes_per_step(trainable, config.wrap) / 2
        reduce_exposed = spd.ddp_exposed_reduce_time(reduce, compute * 2 / 3, grad_bytes)
    else:
        # the last micro-step's reduce-scatter overlaps backward for all but the last unit
        reduce_exposed = reduce / max(units, 1)

    offload = 0.0
    on_cpu = config.offload in ("params", "optimizer")
    per_gpu = trainable / shard
    pb = mem.master_bytes(config.precision, config.optimizer)
    if config.offload == "params":
        h2d = gathered / shard * (pb / mem.BF16 if not config.lora_rank else 1.0)
        offload = spd.offload_traffic_time(h2d, per_gpu * pb, config.grad_accum, gpu.pcie_bw_gbs)
    elif config.offload == "optimizer":
        offload = spd.offload_traffic_time(0.0, per_gpu * (pb + pb), 1, gpu.pcie_bw_gbs)
    optim = spd.optimizer_step_time(
        per_gpu, config.optimizer, config.precision, gpu.mem_bw_gbs, on_cpu
    )
    return {
        "compute": config.grad_accum * compute,
        "communication": config.grad_accum * (micro - compute) + reduce_exposed,
        "offload": offload,
        "optimizer": optim,
    }
