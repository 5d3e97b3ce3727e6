"""Napkin estimates: peak memory per GPU (with a breakdown) and step time of one configuration.

`estimate(model, hardware, config)` is pure arithmetic over `memory` and `speed`; it scores tens
of thousands of candidates per second, which is what lets the search prune before any trial.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from autofit.arch import structure_of
from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.errors import ConfigError
from autofit.estimate import memory as mem
from autofit.estimate.data import shapes_of, with_checked
from autofit.estimate.peak import BREAKDOWN_KEYS, MEMO_SIZE, Peaks, padding_mask_applies
from autofit.estimate.speed import TIME_KEYS
from autofit.estimate.step import step_time, step_time_terms
from autofit.hardware import Hardware
from autofit.layout import Layout
from autofit.models import ModelSpec
from autofit.structure import Structure
from autofit.values import Batching, Launch, Offload

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
    tokens_per_s: float  # the whole run's: every GPU together (n_gpus x one GPU's tokens)
    layout: Layout  # how the run holds the model (`autofit.layout.layout_of`)
    time_breakdown: dict[str, float] = field(default_factory=dict)
    n_gpus: int = 1
    # the napkin's `communication` by link (`LINK_KEYS`); all `intra` on one node
    communication_by_link: dict[str, float] = field(default_factory=dict)
    host_ranks: int = 1  # the GPUs whose offloaded state `host_bytes` holds: one node's
    # tokens an optimizer step trains, as `tokens_per_s` counts them: useful tokens (padding
    # excluded) when the data's lengths are known, else micro_batch x grad_accum x GPUs x seq_len
    step_tokens: float = 0.0
    padding_share: float = 0.0  # of the positions a step computes, the share that is padding

    @property
    def fits(self) -> bool:
        """The old name of `within_capacity`, kept for callers (and as the JSON key `fits`). It
        is not the planner's test, which also keeps a headroom margin (`autofit.plan`)."""
        return self.within_capacity

    @property
    def sharding(self) -> str:
        """How the run holds the model: `none` (the plain module), `ddp` or `fsdp2`."""
        return str(self.layout.sharding)

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
            "padding_share": self.padding_share,
        }


def estimate(
    model: ModelSpec, hardware: Hardware, config: Config, *, device: str = "cuda",
    foreach_intermediates: int | None = None, expandable_segments: bool = True,
    lengths: LengthHistogram | None = None,
) -> Estimate:  # fmt: skip
    """Predict peak memory per GPU and step time of `config` for `model` on `hardware`.

    `device="cpu"` predicts what a CPU trial measures (tensor bytes only: no CUDA context, no
    caching-allocator slack) so CPU trials can check the same formulas. `foreach_intermediates`
    and `expandable_segments` describe a launch autofit did not set up (autofit's own trials and
    exports set `expandable_segments:True`): another torch's foreach AdamW, the allocator's
    default segments (`estimate_many`). `lengths`: the data's sequence lengths (`estimate_many`).
    """
    return estimate_many(
        model, hardware, (config,), device=device, foreach_intermediates=foreach_intermediates,
        expandable_segments=expandable_segments, lengths=lengths,
    )[0]  # fmt: skip


# Every knob and setting but `loss`, which changes no FLOP nor byte moved (the LM head's matmul is
# the same however the loss is chunked or fused): what a step time depends on.
_TIMED_KNOBS = attrgetter(*(f.name for f in fields(Config) if f.name != "loss"))


def estimate_many(
    model: ModelSpec, hardware: Hardware, configs: Iterable[Config], *, device: str = "cuda",
    foreach_intermediates: int | None = None, expandable_segments: bool = True,
    lengths: LengthHistogram | None = None,
) -> list[Estimate]:  # fmt: skip
    """`estimate` of each of `configs`, in order. The configs of a space share most knob values,
    so each group of terms is computed once per distinct value of the knobs it reads (memory:
    `autofit.estimate.peak.Peaks`; the step time once per value of every knob but `loss`).

    What a launch autofit did not set up does differently: `foreach_intermediates`, the
    parameter-sized intermediates its torch's foreach AdamW step holds (configs with
    `optimizer_impl: foreach`; None: torch 2.13's one, `autofit.recipe.ADAMW_IMPLS`;
    torch 2.0's step held 2) and `expandable_segments` (the caching allocator's mode the slack is
    replayed with).

    With the data's sequence `lengths` the peak is that of the longest micro-batch the data can
    produce under the config's `batching`, and the step time that of its mean micro-batch, whose
    useful tokens (padding excluded) `tokens_per_s` counts (`autofit.estimate.data`); without
    them every sequence is `seq_len` tokens."""
    _check_foreach_intermediates(foreach_intermediates)
    n = max(hardware.n_gpus, 1)
    per_node = min(max(hardware.gpus_per_node, 1), n)
    s = structure_of(model)
    gpu = hardware.smallest_gpu
    peaks = Peaks(model, n, device, per_node,
                  workspace=mem.workspace_bytes(device, gpu.compute_capability),
                  outside=mem.outsides(device, n, hardware.link, hardware.context_bytes),
                  foreach_intermediates=foreach_intermediates,
                  expandable_segments=expandable_segments)  # fmt: skip
    batch = _unsettled(model, s, hardware, configs, peaks, n, per_node, lengths)
    _settle(batch, peaks, hardware, device)
    return batch.out


def _check_foreach_intermediates(foreach_intermediates: int | None) -> None:
    """`ConfigError` unless `foreach_intermediates` is None or a whole number >= 0."""
    if foreach_intermediates is not None and (
        isinstance(foreach_intermediates, bool)
        or not isinstance(foreach_intermediates, int)
        or foreach_intermediates < 0
    ):
        raise ConfigError(
            f"foreach_intermediates must be a whole number >= 0 (the parameter-sized tensors a "
            f"launch's foreach AdamW step holds at once: 1 on torch 2.1 and later, 2 on torch "
            f"2.0), or None for this torch's; got {foreach_intermediates!r}."
        )


@dataclass
class _Unsettled:
    """A batch's estimates before their allocator slack, usable bytes and fit are known, with
    each one's peak (`held`) and the config that peak is of (`at_peaks`: the longest
    micro-batch's shape), in the estimates' order."""

    out: list[Estimate]
    held: list[Any]
    at_peaks: list[Config]


def _unsettled(
    model: ModelSpec, s: Structure, hardware: Hardware, configs: Iterable[Config], peaks: Peaks,
    n: int, per_node: int, lengths: LengthHistogram | None,
) -> _Unsettled:  # fmt: skip
    """Each config's peak and step time on `n` GPUs (`s`: the model's structure): its estimate,
    but for the slack and fit."""
    step_times: dict[Any, tuple[dict[str, float], float, dict[str, float]]] = {}  # sum, by link
    parts = step_time_terms(s, hardware, model)  # `step_time`'s parts, per value of their knobs
    capacity_int = int(hardware.smallest_gpu.memory_bytes)
    host_cap = hardware.host_ram_bytes
    out: list[Estimate] = []
    held: list[Any] = []  # each estimate's peak, for its slack
    at_peaks: list[Config] = []  # the config each peak is of (the longest micro-batch's shape)
    shapes = shapes_of(lengths) if lengths is not None else None
    # a space has a few hundred thousand configs: names bound once, fields given in order
    append, hold, peak_of, timed_of = out.append, held.append, peaks.of, step_times.get
    for config in configs:
        config = config.resolved(n)  # `wrap: auto`, the default: what it stands for here
        if shapes is None:  # every sequence is seq_len: each batching is the same run
            at_peak = at_step = _unbatched(config)
            useful, padding = config.seq_len, 0.0
        else:
            at_peak, at_step, useful, padding = shapes(config)
        tokens: float = config.micro_batch * config.grad_accum * n * useful
        at_peaks.append(at_peak)
        peak = peak_of(at_peak, padding_mask_applies(at_peak, padding > 0))
        key = _TIMED_KNOBS(at_step)
        timed = timed_of(key)
        if timed is None:
            if len(step_times) >= MEMO_SIZE:
                step_times.clear()
            # the step's micro-batch shape has its peak's layout (`LAYOUT_KNOBS`)
            times, links = step_time(s, hardware, at_step, peak.trainable, peak.layout, parts)
            timed = step_times[key] = times, sum(times.values()), links
        times, step, links = timed
        # the slack, the fit and the usable bytes are set by `_settle`, once every peak is known
        append(Estimate(
            config, peak.allocated, peak.allocated, capacity_int, 0, False, peak.breakdown,
            peak.phase, peak.overhead, int(peak.host), int(host_cap), step,
            tokens / step if step > 0 else 0.0, peak.layout, times, n, links, per_node,
            tokens, padding,
        ))  # fmt: skip
        hold(peak)
    return _Unsettled(out, held, at_peaks)


def _settle(batch: _Unsettled, peaks: Peaks, hardware: Hardware, device: str) -> None:
    """Set each estimate's allocator slack, peak, overhead, usable bytes and fit, once per peak
    and slack group (configs that differ in `compile` or the step-time knobs share a peak, and
    its dicts; twins that differ in `loss` can share one too, but a slack is of its loss's
    allocations: `_slack_group`)."""
    capacity = hardware.smallest_gpu.memory_bytes
    host_usable = mem.usable_host_bytes(hardware.host_ram_bytes)
    slack_of = _allocator_slacks(peaks, batch.at_peaks, batch.held, capacity, device)
    # per peak and slack group: the slack, the overhead dict (shared, as the rest of a peak is),
    # the usable bytes and the fit
    per_peak: dict[tuple[Any, ...], tuple[int, dict[str, int], int, bool]] = {}
    get_peak = per_peak.get
    for est, peak, at_peak in zip(batch.out, batch.held, batch.at_peaks, strict=True):
        key = (id(peak), _SLACK_KNOBS(at_peak))
        shared = get_peak(key)
        if shared is None:
            slack = slack_of(at_peak, peak)
            usable = capacity - peak.outside
            host = peak.host
            fits = peak.allocated + slack <= usable and (host <= host_usable if host else True)
            overhead = {**peak.overhead, "allocator": slack}
            shared = per_peak[key] = slack, overhead, int(usable), bool(fits)
        est.peak_bytes = est.peak_allocated_bytes + shared[0]
        est.overhead, est.usable_bytes, est.within_capacity = shared[1], shared[2], shared[3]


def _unbatched(config: Config) -> Config:
    """`config` as it runs without the data's lengths: rows of `seq_len` tokens, one sequence
    each, whatever its `batching` (a packed row of one sequence is a padded row without padding:
    no mask is built). But TRL's packing (`launch: trl`) runs padding-free: the collator
    flattens a micro-batch of several rows into one row of as many documents, whose
    block-diagonal mask SDPA is given."""
    if (
        config.launch == Launch.TRL
        and config.batching == Batching.PACKED
        and config.micro_batch > 1
    ):
        return config
    return with_checked(config, "batching", Batching.PADDED)


REPLAY_BUDGET_EVENTS = 17_000
"""Allocator events a batch of estimates replays (`autofit.estimate.slack`) beyond the first
replay: the candidates nearest the capacity line are replayed first, the rest take the slack
share of the replayed configs like them. Counted in events, not seconds, so that a plan gives the
same slacks however loaded the machine. A replay of a 7B-70B step is 16,000-18,000 events (two
steps of 16 layers) and took 26-150 ms end to end on this project's loaded 2-core machine (the
allocator model alone: 0.3-1.4 million events/s, `python bench/allocator_speed.py`), so the
earlier budget of 0.05 s let a batch replay one distinct config; 17,000 events keeps exactly
that. 0 replays none (every slack is then `memory.allocator_overhead`'s assumed share: what a
test that scores thousands of single configs sets)."""

NEAR_CAPACITY = (0.5, 1.3)
"""Allocated peaks, as shares of the usable memory, whose allocator slack decides whether they
fit: replayed first, nearest 0.95 first."""


def _allocator_slacks(
    peaks: Peaks, configs: list[Config], held: list[Any], capacity: float, device: str
) -> Callable[[Config, Any], int]:
    """The caching allocator's slack of a config's peak, as a function of (config, peak): a replay
    of its step through the allocator model (`Peaks.replayed_slack`) for the configs nearest the
    capacity line within `REPLAY_BUDGET_EVENTS` (the first of each `_slack_family` always,
    unless the budget is 0; a config whose replay this batch has already made costs nothing),
    and for the others the largest slack share (slack / allocated) among the replayed configs of
    the same `_slack_group` (else of the same family), or the assumed share where none was
    replayed. Nothing on CPU, which has no caching allocator. The loss's own allocations set its
    share apart: the standard loss's tensors over the whole batch's vocabulary leave holes the
    chunked loss never makes (llama-3-8b NF4 LoRA r16 micro-batch 2 on an H200: 1.23 GiB of
    slack replayed with the standard loss's allocations, 0.22 with its own, 0.30 measured), so
    one loss's share never stands for the other's; nor does a step that offloads its parameters
    stand for one that keeps them (the llama-3-8b 1xrtx4090 plan's one standard-loss replay was
    an `offload: params` config's, a slack share of 0.4%, where the H200 rows without offload
    measure 6-10%)."""
    if device == "cpu" or not held:
        return lambda _config, _peak: 0
    share = [peak.allocated / max(capacity - peak.outside, 1.0) for peak in held]
    family_of = [_slack_family(c) for c in configs]
    families = set(family_of)
    near = [i for i, x in enumerate(share) if NEAR_CAPACITY[0] <= x <= NEAR_CAPACITY[1]]
    for family in sorted(families - {family_of[i] for i in near}):
        # seed the shares of a family none of whose configs is near the line with its nearest
        near.append(
            min((i for i in range(len(held)) if family_of[i] == family),
                key=lambda i: abs(share[i] - 0.95))
        )  # fmt: skip
    near.sort(key=lambda i: abs(share[i] - 0.95))
    replayed: dict[tuple[Any, ...], int] = {}  # (id(peak), *slack group) -> slack
    ratios: dict[tuple[Any, ...], float] = {}
    overall: dict[tuple[Any, ...], float] = {}  # per `_slack_family`: the largest share replayed
    budget = REPLAY_BUDGET_EVENTS
    spent = last = 0  # events of this batch's distinct replays, and of the last one
    made: set[Any] = set()  # their keys
    for i in near:
        if budget <= 0:
            break
        config, peak = configs[i], held[i]
        key = peaks.replay_key(config)
        fresh = key not in made
        # a replay expected (as large as the last) to end past the budget is not begun (the
        # first of each family always is)
        if made and fresh and spent + last > budget:
            if len(overall) == len(families):
                break
            if family_of[i] in overall:
                continue
        replay = peaks.replayed_slack(config)
        slack = replayed[(id(peak), _SLACK_KNOBS(config))] = replay.slack
        if fresh:
            made.add(key)
            spent, last = spent + replay.events, replay.events
        g = _slack_group(config, peak)
        ratio = slack / max(peak.allocated, 1)
        ratios[g] = max(ratios.get(g, 0.0), ratio)
        overall[g[0]] = max(overall.get(g[0], 0.0), ratio)

    def slack_of(config: Config, peak: Any) -> int:
        found = replayed.get((id(peak), _SLACK_KNOBS(config)))
        if found is not None:
            return found
        g = _slack_group(config, peak)
        ratio = ratios.get(g, overall.get(g[0]))
        if ratio is None:  # nothing replayed (a budget of 0)
            return int(mem.allocator_overhead(peak.allocated))
        return int(peak.allocated * ratio)

    return slack_of


_SLACK_KNOBS = attrgetter("loss", "launch", "offload", "micro_batch", "checkpointing")
"""The knobs `_slack_group` reads of a config (its LoRA and sharding are its peak's): a peak's
slack is one per value of these."""


def _slack_family(config: Config) -> tuple[Any, ...]:
    """The configs one replay can stand for at all: the same loss as traced, and whether FSDP2
    keeps the parameters and gradients on the host (`offload: params`: each unit's gradients
    leave the GPU at its reduce, no sharded gradient stays, `slack.py`), whose holes are not
    those of a step that keeps them."""
    return mem.traced_loss(config.loss, config.launch), config.offload == Offload.PARAMS


def _slack_group(config: Config, peak: Any) -> tuple[Any, ...]:
    """The configs whose slack share (slack / allocated) one replay stands for: the same
    `_slack_family` (first), micro-batch, checkpointing, LoRA or not, and sharding."""
    return (_slack_family(config), config.micro_batch, config.checkpointing,
            config.lora_rank > 0, peak.layout.sharding)  # fmt: skip
