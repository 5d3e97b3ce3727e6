"""Napkin estimates: peak memory per GPU (with a breakdown) and step time of one configuration.

`estimate(model, hardware, config)` is pure arithmetic over `memory` and `speed`; it scores tens
of thousands of candidates per second, which is what lets the search prune before any trial.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autofit.arch import Structure, structure_of
from autofit.config import Config, Sharding, sharding_for, uses_autocast, wrap_units
from autofit.estimate import memory as mem
from autofit.estimate import speed as spd
from autofit.hardware import Hardware
from autofit.models import ModelSpec
from autofit.recipe import base_stays_whole

__all__ = ["Estimate", "estimate"]

BREAKDOWN_KEYS = (
    "base_weights",
    "trainable_weights",
    "gradients",
    "optimizer_state",
    "gathered_params",
    "activations",
    "logits_loss",
)


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
    n = max(hardware.n_gpus, 1)
    gpu = hardware.smallest_gpu
    sharding = sharding_for(config.wrap, n)
    shard = mem.shard_degree(sharding, n)
    ddp = sharding is Sharding.DDP
    autocast = uses_autocast(config.precision, config.optimizer, sharding)
    lora = config.lora_rank
    targets = config.lora_targets
    s = structure_of(model)
    trainable = mem.trainable_params(s, lora, targets)
    pb = mem.master_bytes(config.precision, config.optimizer)

    # --- persistent state, per GPU -------------------------------------------------------------
    if lora:
        projections = mem.base_weight_bytes(s, config.quant)
        other = mem.frozen_other_bytes(s)
        # torchao Int8Tensor cannot be FSDP2-sharded, nor NF4 on a one-rank mesh: those
        # projections stay whole (the rule the builder's `unshardable_params` reads too).
        whole = base_stays_whole(config.quant, shard)
        base = projections + other / shard if whole else (projections + other) / shard
    else:
        projections, whole, base = 0.0, False, 0.0
    weights = trainable * pb / shard
    grads = trainable * mem.grad_bytes(config.precision, config.optimizer) / shard
    opt = trainable * mem.optimizer_bytes_per_param(config.optimizer, config.precision) / shard

    host = 0.0
    if config.offload == "params":
        # FSDP2 CPUOffloadPolicy: sharded params, grads and the optimizer step live on the host;
        # parameters FSDP2 leaves whole stay on the GPU.
        kept = projections if whole else 0.0
        host = (base - kept + weights + grads + opt) * n
        base, weights, grads, opt = kept, 0.0, 0.0, 0.0
    elif config.offload == "optimizer":
        # torchao CPUOffloadOptimizer: states + an fp32 param copy + grads on the host; device
        # grads are freed as soon as they are copied off (offload_gradients).
        host = (opt + trainable * (mem.FP32 + mem.FP32) / shard) * n
        opt = 0.0

    # --- transient state --------------------------------------------------------------------
    gathered = mem.gathered_bytes(
        s, config.quant, lora, config.wrap, config.reshard, sharding, targets
    )
    copies = mem.autocast_copy_bytes(s, lora, autocast, targets)
    gathered_at_loss = copies + mem.gathered_at_loss_bytes(
        s, config.quant, lora, config.wrap, config.reshard, sharding, targets
    )
    gathered += copies
    unit_grads = mem.unit_grad_bytes(s, lora, config.wrap, sharding, targets)
    acts, logits = mem.activation_bytes(
        model, s, config.micro_batch, config.seq_len, lora, config.checkpointing, autocast,
        targets, config.lora_dropout, config.loss,
    )  # fmt: skip
    recomputed = mem.recomputed_layer_bytes(
        model, config.micro_batch, config.seq_len, lora, config.checkpointing, autocast,
        targets, config.lora_dropout,
    )  # fmt: skip
    if config.quant == "int8":
        acts += mem.int8_saved_weight_bytes(s, config.checkpointing)
    # Gradients alive during forward. FSDP2 with grad_accum > 1 skips the reduce-scatter on all
    # but the last micro-step and keeps unsharded gradients (in reduce_dtype fp32) on every GPU.
    # DDP allocates its all-reduce buckets (which the gradients are views of) when it wraps the
    # model, and under `no_sync` autograd accumulates into separate `.grad` tensors besides.
    # The plain module accumulates into `.grad` from the first micro-step on.
    accum = 0.0
    if config.grad_accum > 1 and shard > 1:
        accum = trainable * mem.accumulated_grad_bytes(config.precision)
    elif config.grad_accum > 1:
        accum = grads  # 0 under offload=params: the gradients live on the host
    buckets = grads if ddp else 0.0

    # Every saved activation is alive from the end of forward into backward, beside one of two
    # things that are never alive together: the loss's tensors over the vocabulary (while FSDP2
    # has resharded every layer unit after its forward: `gathered_at_loss`), then, once they are
    # freed, the last layer's backward: its unit and the prefetched one gathered (`[norm, head]`
    # resharded after its own backward), the unit's unsharded gradients and, under
    # checkpointing, the layer being recomputed. The larger is the forward phase.
    # The loss's own peak is in its forward (with FSDP2's last all-gather output still held) or
    # at the start of its backward, whichever is larger.
    loss_fwd = mem.loss_forward_bytes(
        model, config.micro_batch, config.seq_len, lora, config.checkpointing, autocast,
        targets, config.lora_dropout, config.loss,
    )  # fmt: skip
    buffer = mem.forward_gather_buffer_bytes(s, config.quant, lora, config.wrap, sharding, targets)
    if loss_fwd + buffer > logits:
        gathered_at_loss, logits = gathered_at_loss + buffer, loss_fwd
    at_loss = {"gradients": buckets + accum, "gathered_params": gathered_at_loss,
               "activations": acts, "logits_loss": logits}  # fmt: skip
    layer_grads = mem.layer_unit_grad_bytes(s, lora, config.wrap, sharding, targets)
    gathered_at_layer = copies + mem.gathered_at_layer_backward_bytes(
        s, config.quant, lora, config.wrap, config.reshard, sharding, targets
    )
    at_layer = {"gradients": buckets + accum + layer_grads, "gathered_params": gathered_at_layer,
                "activations": acts + recomputed, "logits_loss": 0.0}  # fmt: skip
    moment = max((at_loss, at_layer), key=lambda m: sum(m.values()))  # the loss's on a tie
    forward_phase = {
        "base_weights": base,
        "trainable_weights": weights,
        "gradients": moment["gradients"],
        "optimizer_state": opt,
        "gathered_params": moment["gathered_params"],
        "activations": moment["activations"],
        "logits_loss": moment["logits_loss"],
    }
    # The root's first all-gather under `wrap: model`: buffer and unsharded params at once, with
    # the model states but hardly any activations yet.
    root_gather_phase = {
        **forward_phase,
        "gradients": buckets + accum,  # no layer's backward has begun
        "gathered_params": gathered
        + mem.root_all_gather_buffer_bytes(s, config.quant, lora, config.wrap, sharding, targets),
        "activations": 0.0,
        "logits_loss": 0.0,
    }
    gathered_at_reduce = mem.gathered_at_reduce_bytes(s, config.wrap, sharding, device, gathered)
    # Optimizer step: the gradients exist, activations are gone. Backward's tail (last unit's
    # unsharded grads + the embedding unit gathered) is folded in here, and on CPU trials the
    # single-tensor AdamW's temporaries.
    optimizer_phase = {
        "base_weights": base,
        "trainable_weights": weights,
        "gradients": grads + accum + unit_grads,
        "optimizer_state": opt
        + mem.optimizer_temp_bytes(
            s, lora, config.precision, config.optimizer, device, shard, targets
        ),
        "gathered_params": gathered_at_reduce,
        "activations": 0.0,
        "logits_loss": 0.0,
    }
    phases = {"forward": forward_phase, "optimizer": optimizer_phase, "gather": root_gather_phase}
    phase = max(phases, key=lambda name: sum(phases[name].values()))  # earlier wins ties
    parts = phases[phase]
    breakdown = {k: int(round(v)) for k, v in parts.items()}
    allocated = sum(breakdown.values())
    overhead = {
        "allocator": 0 if device == "cpu" else int(mem.allocator_overhead(allocated)),
        "cuda_context": mem.cuda_context_bytes(device),
    }
    reserved = allocated + overhead["allocator"]
    capacity = gpu.memory_bytes
    usable = mem.usable_bytes(capacity, device)
    host_cap = hardware.host_ram_bytes
    fits = reserved <= usable and (host <= mem.usable_host_bytes(host_cap) if host else True)

    # --- time ------------------------------------------------------------------------------------
    times = step_time(s, hardware, config, trainable, shard)
    step = sum(times.values())
    tokens = config.micro_batch * config.grad_accum * n * config.seq_len
    return Estimate(
        config=config,
        peak_bytes=int(reserved),
        peak_allocated_bytes=int(allocated),
        capacity_bytes=int(capacity),
        usable_bytes=int(usable),
        within_capacity=bool(fits),
        breakdown=breakdown,
        peak_phase=phase,
        overhead=overhead,
        host_bytes=int(host),
        host_capacity_bytes=int(host_cap),
        step_time_s=step,
        tokens_per_s=tokens / step if step > 0 else 0.0,
        time_breakdown=times,
        n_gpus=n,
        sharding=str(sharding),
    )


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
