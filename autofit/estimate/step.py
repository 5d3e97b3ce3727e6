"""Seconds per optimizer step of one configuration: the work of each micro-step on one GPU
(`autofit.estimate.speed`) and what moves between GPUs and host (`autofit.estimate.comm`),
each computed once per value of the knobs it reads, and how much of the moves that work hides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autofit.arch import ops_of
from autofit.config import Config
from autofit.estimate import comm
from autofit.estimate import memory as mem
from autofit.estimate import speed as spd
from autofit.estimate.terms import reads
from autofit.hardware import GPU, Hardware
from autofit.layout import Layout, Sharding, sharding_for, uses_autocast
from autofit.models import ModelSpec
from autofit.recipe import checkpointed_count, recompute_policy
from autofit.structure import OpsKey, Structure
from autofit.values import Checkpointing, Launch, Offload

__all__ = ["step_time", "step_time_terms"]


def step_time_terms(
    s: Structure, hardware: Hardware, model: ModelSpec
) -> tuple[Callable[..., Any], ...]:
    """`step_time`'s three parts for configs of `model` (whose structure `s` is) on one piece of
    hardware, each computed once per value of the knobs it reads (`autofit.estimate.terms`)."""
    return _gpu_work.memo(s, hardware), _host_work.memo(s, model), _transfers.memo(s, hardware)


def step_time(
    s: Structure, hardware: Hardware, config: Config, trainable: int, layout: Layout,
    terms: tuple[Callable[..., Any], ...],
) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """Seconds per optimizer step by part (`speed.TIME_KEYS`), each >= 0, summing to the step;
    and the `communication` by link (`LINK_KEYS`).

    Per micro-step the GPU runs the matmuls (`compute`), the memory-bound kernels
    (`memory_bound`) and the dequantisation (`dequant`) (`_gpu_work`), and the host issues them:
    the ops it dispatches and FSDP2's per-parameter work (`_host_work`). The host runs ahead of
    the device (CUDA's launches are asynchronous), so a micro-step lasts the longer of the two: the
    device's time between its kernels is `overhead`, the host's excess over the device's work
    `host`; on a CPU trial the device is the host, and the two add (`_per_op_time`). FSDP2
    prefetches the next unit's all-gather and, with `offload: params`, its H2D copy behind that work
    (`comm.prefetched_exposed`), and the last micro-step's reduce-scatter (and gradient D2H copy)
    runs behind its backward: `_transfers` sizes them. Only the exposed parts count as
    `communication` and `offload`. Past one node each collective moves at its group's link
    (`_transfers`); the exposed communication is split by link in proportion to the seconds each
    link's collectives take. `terms` (`step_time_terms`, of the same model and hardware) keeps
    its parts per value of the knobs they read: `estimate_many` scores a space with it.
    """
    work_of, host_of, transfers_of = terms
    compute, memory_bound, dequant, backward = work_of(config)
    host, gaps = host_of(config, hardware.n_gpus)
    tr = transfers_of(config, layout, trainable)
    (gather, h2d, units, overhead_micro, overhead_step, reduce, d2h, ddp, fsdp, h2d_step, optim,
     gather_net, reduce_net, reduce_busy_net) = tr  # fmt: skip
    on_cpu = hardware.source == "cpu"
    device = compute + memory_bound + dequant
    overhead, exposed = _per_op_time(host + overhead_micro, device, gaps, on_cpu)
    busy = device + overhead + exposed  # one micro-step, what prefetched transfers hide behind
    backward *= busy / device if device > 0 else 1.0  # as long as the host's share of it

    exposed_comm = offload = gathered = 0.0
    if gather + h2d > 0:  # prefetched behind each micro-step's work
        exposed = comm.prefetched_exposed(gather + h2d, busy, units)
        exposed_comm = gathered = config.grad_accum * exposed * gather / (gather + h2d)
        offload = config.grad_accum * exposed * h2d / (gather + h2d)
    if not fsdp:  # DDP's bucketed all-reduce; torchao's gradient copies in backward hooks
        hide = 0.0 if on_cpu else backward
        if ddp:
            exposed_comm += comm.ddp_exposed_reduce_time(reduce, hide, ddp)
        offload += max(d2h - hide, 0.0)
    elif reduce + d2h > 0:
        # each unit's reduce-scatter (under HSDP then its all-reduce across the replicas), then
        # its gradient's D2H copy (`foreach_reduce`, non-blocking into pinned memory), run behind
        # the rest of the last micro-step's backward
        hidden = comm.prefetched_exposed(reduce + d2h, backward, 1 if on_cpu else max(units - 2, 1))
        exposed_comm += hidden * reduce / (reduce + d2h)
        offload += hidden * d2h / (reduce + d2h)
    inter = gathered * gather_net + (exposed_comm - gathered) * reduce_net
    network = config.grad_accum * gather * gather_net + reduce_busy_net
    times = {
        "compute": config.grad_accum * compute,
        "memory_bound": config.grad_accum * memory_bound,
        "overhead": config.grad_accum * overhead,
        "host": config.grad_accum * exposed + overhead_step,
        "dequant": config.grad_accum * dequant,
        "communication": exposed_comm,
        "offload": offload + h2d_step,
        "optimizer": optim,
    }
    # The all-gathers and the reductions each hide behind the same work, but across nodes they
    # share one NIC per GPU: a step lasts at least as long as the network is busy.
    short = network - sum(times.values()) if network else 0.0
    if short > 0:
        times["communication"] += short
        inter += short
    return times, {"intra": times["communication"] - inter, "inter": inter, "network_busy": network}


def _per_op_time(host: float, device: float, gaps: float, on_cpu: bool) -> tuple[float, float]:
    """What one micro-step takes beyond the device's kernels (`device` seconds), as (`overhead`,
    `host`). On a GPU the host issues kernels while the device runs the earlier ones (CUDA C++
    Programming Guide, "Asynchronous Concurrent Execution": a launch returns to the host before
    its kernel runs), so the micro-step lasts the longer of the host's work and the device's:
    where the device's (its kernels and the `gaps` between them) is the longer, the gaps; else
    the host's excess over the kernels, in which the device waits for the host and its gaps
    hide. On a CPU trial, where the device is the host, all of the host's work (the host's cost
    per op is the time between two ops there)."""
    if on_cpu:
        return 0.0, host
    if host > device + gaps:
        return 0.0, host - device
    return gaps, 0.0


@reads("micro_batch", "seq_len", "lora_rank", "lora_targets", "checkpointing", "compile", "quant",
       "train_embeddings", "launch")  # fmt: skip
def _gpu_work(k: Any, s: Structure, hardware: Hardware) -> tuple[float, ...]:
    """One micro-step's (compute, memory_bound, dequant, backward) seconds on one GPU, with
    `compile` applied (`speed.compiled_layer_time`: its saving taken from the memory-bound
    kernels first, then the matmuls); `backward` is the part of the three that runs in backward,
    what a reduce-scatter or a gradient copy can hide behind. Under `launch: trl` the LM head's
    forward matmul runs again in backward (TRL's fused head recomputes its tiles)."""
    gpu = hardware.smallest_gpu
    flops_per_s = gpu.bf16_tflops * 1e12 * spd.GEMM_EFFICIENCY
    bytes_per_s = gpu.mem_bw_gbs * 1e9 * spd.MEM_BW_EFFICIENCY
    micro = spd.micro_step_times(
        s, k.micro_batch * k.seq_len, k.seq_len, k.lora_rank,
        k.lora_targets, k.checkpointing, flops_per_s, bytes_per_s,
        k.train_embeddings, k.launch == Launch.TRL,
    )  # fmt: skip
    compute, memory_bound = micro["compute"], micro["memory_bound"]
    if k.compile:
        layers_mm, layers_mb = spd.compiled_layer_time(
            micro["layers_compute"], micro["layers_memory_bound"]
        )
        compute += layers_mm - micro["layers_compute"]
        memory_bound += layers_mb - micro["layers_memory_bound"]
    dequant = spd.dequant_time(s, k.quant, k.checkpointing, gpu.mem_bw_gbs)
    eager = micro["compute"] + micro["memory_bound"] + dequant
    device = compute + memory_bound + dequant
    return compute, memory_bound, dequant, micro["backward"] * device / eager


@reads("lora_rank", "lora_targets", "lora_dropout", "checkpointing", "compile", "quant",
       "precision", "optimizer", "wrap")  # fmt: skip
def _host_work(k: Any, s: Structure, model: ModelSpec, n_gpus: int) -> tuple[float, float]:
    """One micro-step's (host, gaps) seconds: what the host takes to issue its ops
    (`speed.host_time`; a compiled layer's at a kernel launch each) and the device's time
    between its kernels (`speed.launch_gaps`), from the ops it dispatches (`_host_ops`)."""
    layer_ops, root_ops = _host_ops(k, s, model, n_gpus)
    return (
        spd.host_time(layer_ops, root_ops, s.layers, k.compile),
        spd.launch_gaps(layer_ops, root_ops, s.layers),
    )


def _host_ops(k: Any, s: Structure, model: ModelSpec, n_gpus: int) -> tuple[float, float]:
    """Ops one micro-step dispatches per decoder layer (the mean over the layers: the
    checkpointed ones, `recipe.checkpointed_count`, rerun their forward) and outside the layers,
    as counted on the model (`autofit.arch.ops_of`) with its quantization, LoRA, dropout and
    dtypes (autocast: `layout.uses_autocast`). Counted with the standard loss: the chunked one
    adds a few ops per chunk."""
    lora = k.lora_rank > 0
    key = OpsKey(
        quant=k.quant, lora=lora, lora_targets=k.lora_targets if lora else None,
        dropout=lora and k.lora_dropout > 0,
        autocast=uses_autocast(k.precision, k.optimizer, sharding_for(k.wrap, max(n_gpus, 1))),
    )  # fmt: skip
    plain = ops_of(model, key)
    if k.checkpointing == Checkpointing.NONE:
        return plain.layer, plain.root
    selective = k.checkpointing == Checkpointing.SELECTIVE
    checked = ops_of(model, replace(key, policy=recompute_policy(k.checkpointing)))
    count = s.layers if selective else checkpointed_count(k.checkpointing, s.layers)
    layer = (count * checked.layer + (s.layers - count) * plain.layer) / max(s.layers, 1)
    return layer, checked.root  # the first layer is checkpointed (`recipe.checkpointed_layers`)


def trainable_tensors(s: Structure, rank: int, targets: tuple[str, ...] | None) -> int:
    """The parameter tensors an optimizer steps: two per LoRA adapter of every layer, or every
    layer's tensors and the embedding, final norm and (untied) head of a full fine-tune."""
    if rank > 0:
        return s.layers * 2 * len(s.targets(targets))
    return s.layers * spd.layer_param_tensors(s, 0, None) + 2 + (not s.tied_embeddings)


@reads("reshard", layout=True)
def _transfers(
    k: Any, s: Structure, hardware: Hardware, layout: Layout, trainable: int
) -> tuple[Any, ...]:
    """What moves between GPUs and host in one step, in seconds before any overlap: per
    micro-step all-gathers (`gather`, per-call latency included) and param H2D copies (`h2d`),
    the number of units prefetching hides them behind, FSDP2's per-parameter CPU work per
    micro-step and per step, the gradient reduction (`reduce`) and D2H copy (`d2h`) of the last
    micro-step, DDP's gradient bytes (0: not DDP), whether it is FSDP2, the H2D copy after a
    CPU optimizer step, the optimizer step; then what crosses the network: whether the
    all-gathers do (1.0) or not (0.0), the share of `reduce` that does, and the reduction's
    seconds on the network before any overlap.

    Each collective runs over its group of the mesh (`Layout.mesh`) at that group's bandwidth
    (`comm.group_bw`) with a latency per network step (`comm.collective_latency`): the
    all-gathers and the reduce-scatter over the shard dimension (every GPU under `shard: all`,
    so across nodes; one node's GPUs under HSDP), and under HSDP the all-reduce of each 1/K
    gradient shard across the replicas, one GPU per node (torch
    `_fsdp_collectives.foreach_reduce`: `dist.all_reduce(reduce_output,
    group=all_reduce_group)` on its own stream right after each unit's reduce-scatter, so the
    two pipeline over the units). DDP's all-reduce spans every GPU."""
    gpu = hardware.smallest_gpu
    shard = layout.shard
    m = _mesh(hardware, layout)
    units = len(layout.units)
    gathers, reduces = comm.fsdp_collectives(units, s.tied_embeddings, k.reshard)
    prefetch_units = 1 if m.on_cpu or not units else gathers - units * k.reshard
    pb = mem.master_bytes(k.precision, k.optimizer)
    per_gpu = trainable / shard
    gather, h2d = _gather_times(k, s, m, shard, gathers, pb, gpu.pcie_bw_gbs)
    overhead_micro, overhead_step = _fsdp_overheads(k, s, m.fsdp)
    ddp = m.layout.sharding is Sharding.DDP
    reduced = comm.reduce_bytes_per_step(trainable, k.precision, k.optimizer, ddp)
    reduce, net, reduce_net, busy_net = _reduce_times(m, hardware, reduced, shard, reduces)
    d2h, h2d_step, optim = _offloaded_step(k, s, m, gpu, trainable, per_gpu, pb)
    return (gather, h2d, prefetch_units, overhead_micro, overhead_step, reduce, d2h,
            reduced / 2 if ddp else 0.0, m.fsdp, h2d_step, optim, net, reduce_net,
            busy_net)  # fmt: skip


@dataclass(frozen=True)
class _Mesh:
    """The mesh a config's collectives run over (`Layout.mesh`): its layout, and its shard (or
    DDP) group of `group` GPUs, spanning `group_nodes` nodes, at `group_bw` with `latency`
    seconds per collective."""

    layout: Layout
    on_cpu: bool  # a CPU trial: nothing overlaps there
    fsdp: bool
    replicas: int  # HSDP's replicas, one per node (1: none)
    group: int
    group_nodes: int
    group_bw: float
    latency: float


def _mesh(hardware: Hardware, layout: Layout) -> _Mesh:
    """The mesh of a config whose layout is `layout` on `hardware`."""
    n = max(hardware.n_gpus, 1)
    shard = layout.shard
    # CPU trials run two processes on two cores: a collective or copy has no idle core to hide
    # behind, so nothing overlaps there.
    on_cpu = hardware.source == "cpu"
    per_node = min(max(hardware.gpus_per_node, 1), n)
    fsdp, replicas = layout.fsdp, layout.mesh[0]
    # the shard (or DDP) group: `group` GPUs, `per_node` of them on each node it spans
    group = shard if fsdp else n
    group_nodes = -(-group // per_node)
    group_bw = comm.group_bw(hardware.link_bw_gbs, hardware.inter_node_bw_gbs, group_nodes,
                            min(group, per_node))  # fmt: skip
    latency = comm.collective_latency(on_cpu, group_nodes - 1)
    return _Mesh(layout, on_cpu, fsdp, replicas, group, group_nodes, group_bw, latency)


def _gather_times(
    k: Any, s: Structure, m: _Mesh, shard: int, gathers: int, pb: int, pcie_bw_gbs: float
) -> tuple[float, float]:
    """One micro-step's all-gathers (per-call latency included) and param H2D copies (under
    `offload: params`), in seconds before any overlap."""
    gathered = comm.comm_bytes_per_micro_step(
        s, k.quant, k.lora_rank, k.wrap, k.reshard, k.lora_targets
    )
    gather = comm.ring_time(gathered, shard, m.group_bw)
    if m.fsdp and shard > 1:
        gather += gathers * m.latency
    h2d = 0.0
    if k.offload == Offload.PARAMS:  # the sharded params in their stored dtype (fp32 masters)
        stored = gathered / shard * (pb / mem.BF16 if not k.lora_rank else 1.0)
        h2d = comm.pcie_time(stored, pcie_bw_gbs)
    return gather, h2d


def _fsdp_overheads(k: Any, s: Structure, fsdp: bool) -> tuple[float, float]:
    """FSDP2's per-parameter CPU work per micro-step (in each all-gather) and per step (in the
    one reduce-scatter); none without FSDP2."""
    if not fsdp:
        return 0.0, 0.0
    tensors = s.layers * spd.layer_param_tensors(s, k.lora_rank, k.lora_targets)
    overhead_micro = (2 if k.reshard else 1) * tensors * spd.FSDP2_PER_PARAM_S
    return overhead_micro, tensors * spd.FSDP2_PER_PARAM_S


def _reduce_times(
    m: _Mesh, hardware: Hardware, reduced: float, shard: int, reduces: int
) -> tuple[float, float, float, float]:
    """The last micro-step's gradient reduction of `reduced` bytes (`reduce`), in seconds before
    any overlap; whether the shard group's collectives cross the network (1.0) or not (0.0);
    the share of `reduce` that does; and the reduction's seconds on the network."""
    reduce = comm.ring_time(reduced, m.group, m.group_bw)
    if reduce and m.fsdp:
        reduce += reduces * m.latency
    elif reduce:  # DDP: one all-reduce per gradient bucket
        latency = comm.collective_latency(m.on_cpu, 2 * (m.group_nodes - 1))
        reduce += -(-reduced / 2 // comm.DDP_BUCKET_BYTES) * latency
    # HSDP: each GPU's 1/shard of the reduced gradient all-reduced (a reduce-scatter and an
    # all-gather: 2x a ring) across the replicas, one GPU per node, on that GPU's own NIC
    across = 0.0
    if m.replicas > 1:
        across = 2 * comm.ring_time(reduced / shard, m.replicas, hardware.inter_node_bw_gbs)
        across += reduces * comm.collective_latency(m.on_cpu, 2 * (m.replicas - 1))
    net = 1.0 if m.group_nodes > 1 else 0.0
    busy_net = reduce * net + across
    reduce_net = busy_net / (reduce + across) if reduce + across > 0 else 0.0
    if across:  # on two streams: each unit's all-reduce runs beside the next reduce-scatter
        chain = reduce + across if m.on_cpu else max(reduce, across)
        reduce = chain + (0.0 if m.on_cpu else min(reduce, across) / max(reduces, 1))
    return reduce, net, reduce_net, busy_net


def _offloaded_step(
    k: Any, s: Structure, m: _Mesh, gpu: GPU, trainable: int, per_gpu: float, pb: int
) -> tuple[float, float, float]:
    """The gradient D2H copy of the last micro-step (under offload), the H2D copy after a CPU
    optimizer step, and the optimizer step, in seconds."""
    d2h = comm.pcie_time(per_gpu * pb, gpu.pcie_bw_gbs) if k.offload != Offload.NONE else 0.0
    # torchao CPUOffloadOptimizer copies the updated params back H2D after the CPU step
    h2d_step = (
        comm.pcie_time(per_gpu * pb, gpu.pcie_bw_gbs) if k.offload == Offload.OPTIMIZER else 0.0
    )
    # the host's step under offload: torch AdamW as the builder makes it (`Layout.adamw`)
    optim = comm.optimizer_step_time(
        per_gpu, k.optimizer, k.precision, gpu.mem_bw_gbs, k.offload != Offload.NONE,
        tensors=trainable_tensors(s, k.lora_rank, k.lora_targets), impl=m.layout.adamw,
    )  # fmt: skip
    return d2h, h2d_step, optim
