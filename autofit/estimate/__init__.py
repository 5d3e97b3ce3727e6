"""Napkin estimates: peak memory per GPU (with a breakdown) and step time of one configuration.

`estimate(model, hardware, config)` is pure arithmetic over `memory` and `speed`; it scores tens
of thousands of candidates per second, which is what lets the search prune before any trial.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from autofit.arch import structure_of
from autofit.config import Config, Sharding, mesh_shape, sharding_for, wrap_units
from autofit.errors import ConfigError
from autofit.estimate import memory as mem
from autofit.estimate import speed as spd
from autofit.estimate.peak import BREAKDOWN_KEYS, MEMO_SIZE, Peaks
from autofit.estimate.speed import TIME_KEYS
from autofit.estimate.terms import reads
from autofit.hardware import Hardware
from autofit.models import ModelSpec
from autofit.structure import Structure

__all__ = [
    "BREAKDOWN_KEYS", "LINK_KEYS", "MEMORY_ERROR", "OUTSIDE_KEYS", "TIME_KEYS", "Estimate",
    "estimate",
    "estimate_many",
]  # fmt: skip

OUTSIDE_KEYS = ("cuda_context", "nccl")
"""`Estimate.overhead`'s parts outside PyTorch's caching allocator
(`memory.outside_allocator_bytes`)."""

LINK_KEYS = ("intra", "inter", "network_busy")
"""`Estimate.communication_by_link`: the exposed `communication` seconds of collectives inside a
node (`intra`, on the GPUs' link) and of those that span nodes (`inter`, on the network), which
sum to it, and the seconds per step the network carries collectives before any overlap
(`network_busy`: how much of the step the NICs are busy)."""

MEMORY_ERROR = 0.10
"""The napkin peak's stated error, |estimated / measured - 1|: the bound `bench/accuracy.py` holds
it to (docs/accuracy.md). A search measures candidates estimated up to this far above the headroom
line (`autofit.plan.PRUNE_TOLERANCE`); a calibration without measurements of its own has it as
its band."""


@dataclass(slots=True)
class Estimate:
    """What the napkin predicts for one config on one piece of hardware (per GPU). Its dicts are
    shared with the estimates of a batch that have the same peak or step time (`estimate_many`):
    read them, or copy before changing one (as `autofit.calibration` does)."""

    config: Config
    peak_bytes: int  # predicted torch.cuda.max_memory_reserved on the busiest GPU
    peak_allocated_bytes: int  # predicted max_memory_allocated; == sum(breakdown)
    capacity_bytes: int
    usable_bytes: int  # capacity less what lies outside the allocator (context, NCCL)
    within_capacity: bool  # device bytes <= capacity, offloaded state within host RAM; no margin
    breakdown: dict[str, int]  # bytes by part at the peak moment
    peak_phase: str  # "forward" (end of forward), "optimizer" (step), "gather" (root all-gather)
    # "allocator": the caching allocator's slack (reserved - allocated); then the parts outside
    # the allocator (`OUTSIDE_KEYS`: the CUDA context, NCCL's buffers)
    overhead: dict[str, int]
    host_bytes: int  # host RAM for offloaded parts, all ranks of one node (each has its host)
    host_capacity_bytes: int
    step_time_s: float
    tokens_per_s: float
    time_breakdown: dict[str, float] = field(default_factory=dict)
    n_gpus: int = 1
    sharding: str = "fsdp2"  # how the run holds the model: none (plain module), ddp, fsdp2
    # the napkin's `communication` by link (`LINK_KEYS`); all `intra` on one node
    communication_by_link: dict[str, float] = field(default_factory=dict)
    host_ranks: int = 1  # the GPUs whose offloaded state `host_bytes` holds: one node's

    @property
    def fits(self) -> bool:
        """The old name of `within_capacity`, kept for callers (and as the JSON key `fits`). It
        is not the planner's test, which also keeps a headroom margin (`autofit.plan`)."""
        return self.within_capacity

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.peak_bytes

    @property
    def peak_tensor_bytes(self) -> int:
        """The allocated peak less cuBLAS's workspaces: what a tensor tracker counts
        (FSDPMemTracker, a CPU trial's tracker), which sees tensors, not library workspaces."""
        return self.peak_allocated_bytes - self.breakdown.get("workspace", 0)

    @property
    def allocator_slack_bytes(self) -> int:
        """Reserved less allocated: what the caching allocator holds that no tensor uses."""
        return self.overhead.get("allocator", 0)

    @property
    def outside_allocator_bytes(self) -> int:
        """The CUDA context and NCCL's buffers: device memory PyTorch's allocator never sees."""
        return sum(self.overhead.get(k, 0) for k in OUTSIDE_KEYS)

    @property
    def device_bytes(self) -> int:
        """What fills the card at the peak (an NVML reading): reserved plus what lies outside the
        allocator. The fit check compares it with the capacity."""
        return self.peak_bytes + self.outside_allocator_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "peak_bytes": self.peak_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "allocator_slack_bytes": self.allocator_slack_bytes,
            "outside_allocator_bytes": self.outside_allocator_bytes,
            "device_bytes": self.device_bytes,
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
            "communication_by_link": dict(self.communication_by_link),
            "host_ranks": self.host_ranks,
        }


def estimate(
    model: ModelSpec, hardware: Hardware, config: Config, *, device: str = "cuda",
    optimizer_impl: str = "fused", expandable_segments: bool = True,
) -> Estimate:  # fmt: skip
    """Predict peak memory per GPU and step time of `config` for `model` on `hardware`.

    `device="cpu"` predicts what a CPU trial measures (tensor bytes only: no CUDA context, no
    caching-allocator slack) so CPU trials can check the same formulas. `optimizer_impl` and
    `expandable_segments` describe a launch autofit did not set up (autofit's own build and
    exports pin fused AdamW and set `expandable_segments:True`): torch's default foreach AdamW,
    the allocator's default segments (`estimate_many`).
    """
    return estimate_many(
        model, hardware, (config,), device=device, optimizer_impl=optimizer_impl,
        expandable_segments=expandable_segments,
    )[0]  # fmt: skip


# Every knob and setting but `loss`, which changes no FLOP nor byte moved (the LM head's matmul is
# the same however the loss is chunked or fused): what a step time depends on.
_TIMED_KNOBS = attrgetter(*(f.name for f in fields(Config) if f.name != "loss"))


def estimate_many(
    model: ModelSpec, hardware: Hardware, configs: Iterable[Config], *, device: str = "cuda",
    optimizer_impl: str = "fused", expandable_segments: bool = True,
) -> list[Estimate]:  # fmt: skip
    """`estimate` of each of `configs`, in order. The configs of a space share most knob values,
    so each group of terms is computed once per distinct value of the knobs it reads (memory:
    `autofit.estimate.peak.Peaks`; the step time once per value of every knob but `loss`).

    What the launch does that autofit's own build pins: `optimizer_impl` (`memory.OPTIMIZER_IMPLS`:
    `fused`; `foreach`, torch's default, whose step holds a parameter-sized temporary; or
    `foreach-2.0`, torch 2.0's, which held two) and
    `expandable_segments` (the caching allocator's mode the slack is replayed with)."""
    if optimizer_impl not in mem.OPTIMIZER_IMPLS:
        raise ConfigError(
            f"optimizer_impl cannot be {optimizer_impl!r}. Allowed values: "
            f"{', '.join(mem.OPTIMIZER_IMPLS)} (fused: what autofit's build and exports pin; "
            "foreach: torch AdamW's default, e.g. HF Trainer's adamw_torch; foreach-2.0: the same "
            "on torch 2.0, which held two parameter-sized intermediates)."
        )
    n = max(hardware.n_gpus, 1)
    per_node = min(max(hardware.gpus_per_node, 1), n)
    s = structure_of(model)
    gpu = hardware.smallest_gpu
    flat = mem.outside_allocator_bytes(device, n, hardware.link)
    hsdp = mem.outside_allocator_bytes(device, n, hardware.link, communicators=2)
    peaks = Peaks(model, n, device, per_node,
                  workspace=mem.workspace_bytes(device, gpu.compute_capability),
                  outside=(flat, hsdp), optimizer_impl=optimizer_impl,
                  expandable_segments=expandable_segments)  # fmt: skip
    step_times: dict[Any, tuple[dict[str, float], float, dict[str, float]]] = {}  # sum, by link
    parts = step_time_terms(s, hardware)  # `step_time`'s parts, per value of their knobs
    capacity = gpu.memory_bytes
    host_cap = hardware.host_ram_bytes
    host_usable = mem.usable_host_bytes(host_cap)
    capacity_int = int(capacity)
    out: list[Estimate] = []
    held: list[Any] = []  # each estimate's peak, for its slack
    # a space has a few hundred thousand configs: names bound once, fields given in order
    append, hold, peak_of, timed_of = out.append, held.append, peaks.of, step_times.get
    for config in configs:
        peak = peak_of(config)
        key = _TIMED_KNOBS(config)
        timed = timed_of(key)
        if timed is None:
            if len(step_times) >= MEMO_SIZE:
                step_times.clear()
            times, links = step_time(s, hardware, config, peak.trainable, peak.shard, parts)
            timed = step_times[key] = times, sum(times.values()), links
        times, step, links = timed
        tokens = config.micro_batch * config.grad_accum * n * config.seq_len
        # the slack, the fit and the usable bytes are set below, once every peak is known
        append(Estimate(
            config, peak.allocated, peak.allocated, capacity_int, 0, False, peak.breakdown,
            peak.phase, peak.overhead, int(peak.host), int(host_cap), step,
            tokens / step if step > 0 else 0.0, times, n, peak.sharding, links, per_node,
        ))  # fmt: skip
        hold(peak)
    slack_of = _allocator_slacks(peaks, out, held, capacity, device)
    # per peak (configs that differ in `compile` or the step-time knobs share one): the slack,
    # the overhead dict (shared, as the rest of a peak is), the usable bytes and the fit
    per_peak: dict[int, tuple[int, dict[str, int], int, bool]] = {}
    get_peak = per_peak.get
    for est, peak in zip(out, held, strict=True):
        shared = get_peak(id(peak))
        if shared is None:
            slack = slack_of(est.config, peak)
            usable = capacity - peak.outside
            host = peak.host
            fits = peak.allocated + slack <= usable and (host <= host_usable if host else True)
            overhead = {**peak.overhead, "allocator": slack}
            shared = per_peak[id(peak)] = slack, overhead, int(usable), bool(fits)
        est.peak_bytes = est.peak_allocated_bytes + shared[0]
        est.overhead, est.usable_bytes, est.within_capacity = shared[1], shared[2], shared[3]
    return out


REPLAY_BUDGET_S = 0.05
"""Seconds a batch of estimates spends replaying allocation sequences (`autofit.estimate.slack`,
tens of milliseconds each at 7B-70B) beyond the first: the candidates nearest the capacity line
are replayed first, the rest take the slack share of the replayed configs like them. 0 replays
none (every slack is then `memory.allocator_overhead`'s assumed share: what a test that scores
thousands of single configs sets)."""
_LAST_REPLAY = [0.0]  # seconds the last fresh replay took in this process

NEAR_CAPACITY = (0.5, 1.3)
"""Allocated peaks, as shares of the usable memory, whose allocator slack decides whether they
fit: replayed first, nearest 0.95 first."""


def _allocator_slacks(
    peaks: Peaks, estimates: list[Estimate], held: list[Any], capacity: float, device: str
) -> Callable[[Config, Any], int]:
    """The caching allocator's slack of a config's peak, as a function of (config, peak): a
    replay of its step through the allocator model (`Peaks.replayed_slack`) for the configs
    nearest the capacity line within `REPLAY_BUDGET_S` (the first one always, unless the budget
    is 0), and for the others the largest slack share (slack / allocated) among the replayed
    configs of the same micro-batch, checkpointing, LoRA and sharding (else of all), or the
    assumed share where none was replayed. Nothing on CPU, which has no caching allocator."""
    if device == "cpu" or not held:
        return lambda _config, _peak: 0
    share = [peak.allocated / max(capacity - peak.outside, 1.0) for peak in held]
    near = [i for i, x in enumerate(share) if NEAR_CAPACITY[0] <= x <= NEAR_CAPACITY[1]]
    near.sort(key=lambda i: abs(share[i] - 0.95))
    if not near:  # seed the shares with the config nearest the line
        near = [min(range(len(held)), key=lambda i: abs(share[i] - 0.95))]
    replayed: dict[int, int] = {}  # id(peak) -> slack
    ratios: dict[tuple[Any, ...], float] = {}
    budget = REPLAY_BUDGET_S
    deadline = time.monotonic() + budget
    for count, i in enumerate(near):
        config, peak = estimates[i].config, held[i]
        fresh = not peaks.has_replayed(config)
        # a replay that would end past the deadline is not begun (the first always is)
        if budget <= 0 or (count and fresh and time.monotonic() + _LAST_REPLAY[0] > deadline):
            break
        start = time.monotonic()
        slack = replayed[id(peak)] = peaks.replayed_slack(config).slack
        if fresh:
            _LAST_REPLAY[0] = time.monotonic() - start
        g = _slack_group(config, peak)
        ratios[g] = max(ratios.get(g, 0.0), slack / max(peak.allocated, 1))
    overall = max(ratios.values()) if ratios else None

    def slack_of(config: Config, peak: Any) -> int:
        found = replayed.get(id(peak))
        if found is not None:
            return found
        if overall is None:  # nothing replayed (a budget of 0)
            return int(mem.allocator_overhead(peak.allocated))
        return int(peak.allocated * ratios.get(_slack_group(config, peak), overall))

    return slack_of


def _slack_group(config: Config, peak: Any) -> tuple[Any, ...]:
    """The configs whose slack share (slack / allocated) one replay stands for: the same
    micro-batch, checkpointing, LoRA or not, and sharding."""
    return config.micro_batch, config.checkpointing, config.lora_rank > 0, peak.sharding


def step_time_terms(s: Structure, hardware: Hardware) -> tuple[Callable[..., Any], ...]:
    """`step_time`'s two parts for configs of one model on one piece of hardware, each computed
    once per value of the knobs it reads (`autofit.estimate.terms`)."""
    return _gpu_work.memo(s, hardware), _transfers.memo(s, hardware)


def step_time(
    s: Structure, hardware: Hardware, config: Config, trainable: int, shard: int,
    terms: tuple[Callable[..., Any], ...] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """Seconds per optimizer step by part (`speed.TIME_KEYS`), each >= 0, summing to the step;
    and the `communication` by link (`LINK_KEYS`).

    Per micro-step the GPU runs the matmuls (`compute`), the memory-bound kernels
    (`memory_bound`) and the dequantisation (`dequant`), and the CPU issues them: module calls and
    FSDP2's per-parameter work (`overhead`): `_gpu_work`. FSDP2 prefetches
    the next unit's all-gather and, with `offload: params`, its H2D copy behind that work
    (`speed.prefetched_exposed`), and the last micro-step's reduce-scatter (and gradient D2H copy)
    runs behind its backward: `_transfers` sizes them. Only the exposed parts count as
    `communication` and `offload`. Past one node each collective moves at its group's link
    (`_transfers`); the exposed communication is split by link in proportion to the seconds each
    link's collectives take. `terms` (`step_time_terms`, of the same model and hardware) keeps
    both parts per value of the knobs they read: `estimate_many` scores a space with it.
    """
    work_of, transfers_of = terms or step_time_terms(s, hardware)
    work = work_of(config)
    tr = transfers_of(config, trainable, shard)
    compute, memory_bound, overhead, dequant, backward = work
    (gather, h2d, units, overhead_micro, overhead_step, reduce, d2h, ddp, fsdp, h2d_step, optim,
     gather_net, reduce_net, reduce_busy_net) = tr  # fmt: skip
    busy = compute + memory_bound + overhead + dequant
    on_cpu = hardware.source == "cpu"

    comm = offload = gathered = 0.0
    if gather + h2d > 0:  # prefetched behind each micro-step's work
        exposed = spd.prefetched_exposed(gather + h2d, busy, units)
        comm = gathered = config.grad_accum * exposed * gather / (gather + h2d)
        offload = config.grad_accum * exposed * h2d / (gather + h2d)
    if not fsdp:  # DDP's bucketed all-reduce; torchao's gradient copies in backward hooks
        hide = 0.0 if on_cpu else backward
        if ddp:
            comm += spd.ddp_exposed_reduce_time(reduce, hide, ddp)
        offload += max(d2h - hide, 0.0)
    elif reduce + d2h > 0:
        # each unit's reduce-scatter (under HSDP then its all-reduce across the replicas), then
        # its gradient's D2H copy (`foreach_reduce`, non-blocking into pinned memory), run behind
        # the rest of the last micro-step's backward
        hidden = spd.prefetched_exposed(reduce + d2h, backward, 1 if on_cpu else max(units - 2, 1))
        comm += hidden * reduce / (reduce + d2h)
        offload += hidden * d2h / (reduce + d2h)
    inter = gathered * gather_net + (comm - gathered) * reduce_net
    network = config.grad_accum * gather * gather_net + reduce_busy_net
    times = {
        "compute": config.grad_accum * compute,
        "memory_bound": config.grad_accum * memory_bound,
        "overhead": config.grad_accum * (overhead + overhead_micro) + overhead_step,
        "dequant": config.grad_accum * dequant,
        "communication": comm,
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


@reads("micro_batch", "seq_len", "lora_rank", "lora_targets", "checkpointing", "compile", "quant",
       "train_embeddings")  # fmt: skip
def _gpu_work(k: Any, s: Structure, hardware: Hardware) -> tuple[float, ...]:
    """One micro-step's (compute, memory_bound, overhead, dequant, backward) seconds on one GPU,
    with `compile` applied (`speed.compiled_layer_time`: its saving taken from the CPU overhead
    first, then the memory-bound kernels); `backward` is the part of the four that runs in
    backward, what a reduce-scatter or a gradient copy can hide behind."""
    gpu = hardware.smallest_gpu
    flops_per_s = gpu.bf16_tflops * 1e12 * spd.GEMM_EFFICIENCY
    bytes_per_s = gpu.mem_bw_gbs * 1e9 * spd.MEM_BW_EFFICIENCY
    micro = spd.micro_step_times(
        s, k.micro_batch * k.seq_len, k.seq_len, k.lora_rank,
        k.lora_targets, k.checkpointing, flops_per_s, bytes_per_s,
        k.train_embeddings,
    )  # fmt: skip
    compute, memory_bound, overhead = micro["compute"], micro["memory_bound"], micro["overhead"]
    if k.compile:
        layers_oh = micro["layers_overhead"]
        layers_mm, layers_rest = spd.compiled_layer_time(
            micro["layers_compute"], micro["layers_memory_bound"] + layers_oh
        )
        removed = micro["layers_memory_bound"] + layers_oh - layers_rest
        compute += layers_mm - micro["layers_compute"]
        overhead -= min(removed, layers_oh)
        memory_bound -= removed - min(removed, layers_oh)
    dequant = spd.dequant_time(s, k.quant, k.checkpointing, gpu.mem_bw_gbs)
    eager = micro["compute"] + micro["memory_bound"] + micro["overhead"] + dequant
    busy = compute + memory_bound + overhead + dequant
    return compute, memory_bound, overhead, dequant, micro["backward"] * busy / eager


@reads("wrap", "shard", "reshard", "quant", "lora_rank", "lora_targets", "offload", "precision",
       "optimizer")  # fmt: skip
def _transfers(
    k: Any, s: Structure, hardware: Hardware, trainable: int, shard: int
) -> tuple[Any, ...]:
    """What moves between GPUs and host in one step, in seconds before any overlap: per
    micro-step all-gathers (`gather`, per-call latency included) and param H2D copies (`h2d`),
    the number of units prefetching hides them behind, FSDP2's per-parameter CPU work per
    micro-step and per step, the gradient reduction (`reduce`) and D2H copy (`d2h`) of the last
    micro-step, DDP's gradient bytes (0: not DDP), whether it is FSDP2, the H2D copy after a
    CPU optimizer step, the optimizer step; then what crosses the network: whether the
    all-gathers do (1.0) or not (0.0), the share of `reduce` that does, and the reduction's
    seconds on the network before any overlap.

    Each collective runs over its group of the mesh (`autofit.k.mesh_shape`, whose shard
    degree `shard` is) at that group's bandwidth (`speed.group_bw`) with a latency per network
    step (`speed.collective_latency`): the all-gathers and the reduce-scatter over the shard
    dimension (every GPU under `shard: all`, so across nodes; one node's GPUs under HSDP), and
    under HSDP the all-reduce of each 1/K gradient shard across the replicas, one GPU per node
    (torch `_fsdp_collectives.foreach_reduce`: `dist.all_reduce(reduce_output,
    group=all_reduce_group)` on its own stream right after each unit's reduce-scatter, so the
    two pipeline over the units). DDP's all-reduce spans every GPU."""
    gpu = hardware.smallest_gpu
    n = max(hardware.n_gpus, 1)
    sharding = sharding_for(k.wrap, n)
    fsdp = sharding is Sharding.FSDP2
    # CPU trials run two processes on two cores: a collective or copy has no idle core to hide
    # behind, so nothing overlaps there.
    on_cpu = hardware.source == "cpu"
    per_node = min(max(hardware.gpus_per_node, 1), n)
    replicas = mesh_shape(k.shard, n, per_node)[0] if fsdp else 1
    # the shard (or DDP) group: `group` GPUs, `per_node` of them on each node it spans
    group = shard if fsdp else n
    group_nodes = -(-group // per_node)
    group_bw = spd.group_bw(hardware.link_bw_gbs, hardware.inter_node_bw_gbs, group_nodes,
                            min(group, per_node))  # fmt: skip
    latency = spd.collective_latency(on_cpu, group_nodes - 1)
    units = len(wrap_units(k.wrap, s.layers))
    gathers, reduces = spd.fsdp_collectives(units, s.tied_embeddings, k.reshard)
    prefetch_units = 1 if on_cpu or not units else gathers - units * k.reshard
    pb = mem.master_bytes(k.precision, k.optimizer)
    per_gpu = trainable / shard
    gathered = spd.comm_bytes_per_micro_step(
        s, k.quant, k.lora_rank, k.wrap, k.reshard, k.lora_targets
    )
    gather = spd.ring_time(gathered, shard, group_bw)
    if fsdp and shard > 1:
        gather += gathers * latency
    h2d = 0.0
    if k.offload == "params":  # the sharded params in their stored dtype (fp32 masters)
        stored = gathered / shard * (pb / mem.BF16 if not k.lora_rank else 1.0)
        h2d = spd.pcie_time(stored, gpu.pcie_bw_gbs)
    overhead_micro = overhead_step = 0.0
    if fsdp:  # FSDP2's per-parameter work in each all-gather, and in the one reduce-scatter
        tensors = s.layers * spd.layer_param_tensors(s, k.lora_rank, k.lora_targets)
        overhead_micro = (2 if k.reshard else 1) * tensors * spd.FSDP2_PER_PARAM_S
        overhead_step = tensors * spd.FSDP2_PER_PARAM_S
    ddp = sharding is Sharding.DDP
    reduced = spd.reduce_bytes_per_step(trainable, k.precision, k.optimizer, ddp)
    reduce = spd.ring_time(reduced, group, group_bw)
    if reduce and fsdp:
        reduce += reduces * latency
    elif reduce:  # DDP: one all-reduce per gradient bucket
        latency = spd.collective_latency(on_cpu, 2 * (group_nodes - 1))
        reduce += -(-reduced / 2 // spd.DDP_BUCKET_BYTES) * latency
    # HSDP: each GPU's 1/shard of the reduced gradient all-reduced (a reduce-scatter and an
    # all-gather: 2x a ring) across the replicas, one GPU per node, on that GPU's own NIC
    across = 0.0
    if replicas > 1:
        across = 2 * spd.ring_time(reduced / shard, replicas, hardware.inter_node_bw_gbs)
        across += reduces * spd.collective_latency(on_cpu, 2 * (replicas - 1))
    net = 1.0 if group_nodes > 1 else 0.0
    busy_net = reduce * net + across
    reduce_net = busy_net / (reduce + across) if reduce + across > 0 else 0.0
    if across:  # on two streams: each unit's all-reduce runs beside the next reduce-scatter
        chain = reduce + across if on_cpu else max(reduce, across)
        reduce = chain + (0.0 if on_cpu else min(reduce, across) / max(reduces, 1))
    d2h = spd.pcie_time(per_gpu * pb, gpu.pcie_bw_gbs) if k.offload != "none" else 0.0
    # torchao CPUOffloadOptimizer copies the updated params back H2D after the CPU step
    h2d_step = spd.pcie_time(per_gpu * pb, gpu.pcie_bw_gbs) if k.offload == "optimizer" else 0.0
    optim = spd.optimizer_step_time(
        per_gpu, k.optimizer, k.precision, gpu.mem_bw_gbs, k.offload != "none"
    )
    return (gather, h2d, prefetch_units, overhead_micro, overhead_step, reduce, d2h,
            reduced / 2 if ddp else 0.0, fsdp, h2d_step, optim, net, reduce_net,
            busy_net)  # fmt: skip
