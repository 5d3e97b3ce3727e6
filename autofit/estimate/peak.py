"""The peak memory of configurations: the terms of `memory.py` put together at the three
moments that can hold the peak (end of forward, optimizer step, the root's first all-gather).

A space repeats the same few knob values tens of thousands of times, so `Peaks` computes each
group of terms once per distinct value of the knobs it reads: the model state (parameters,
gradients, optimizer state, gathered copies, and with them the two moments after forward:
`_model_state`), the activations (`_activations`), and the peak once per value of every knob but
`compile`. Memory is eager by design: `torch.compile` changes no term, so a compiled config
shares the peak of its eager twin.
"""

from __future__ import annotations

from dataclasses import fields
from functools import lru_cache, partial
from operator import attrgetter
from typing import Any, NamedTuple

from autofit.arch import Structure, structure_of
from autofit.config import Config, Sharding, sharding_for, uses_autocast
from autofit.estimate import memory as mem
from autofit.models import ModelSpec
from autofit.recipe import base_stays_whole

BREAKDOWN_KEYS = (
    "base_weights",
    "trainable_weights",
    "gradients",
    "optimizer_state",
    "gathered_params",
    "activations",
    "logits_loss",
)
# Entries a batch memo keeps before it starts afresh. The configs of a space that share an entry
# differ in `compile` or `loss`, the innermost knobs but `grad_accum`, so they come close together;
# a small memo stays in the CPU's caches.
MEMO_SIZE = 256


class Peak(NamedTuple):
    """Per GPU at the peak moment, and the offloaded state on the host (the ranks of one node)."""

    breakdown: dict[str, int]  # bytes by part (`BREAKDOWN_KEYS`)
    phase: str  # "forward", "optimizer" or "gather"
    allocated: int  # == sum(breakdown)
    overhead: dict[str, int]  # allocator slack and CUDA context
    reserved: int  # allocated + allocator slack
    host: float  # offloaded to one node's host RAM, all its ranks
    trainable: int  # trainable parameters (all GPUs)
    shard: int  # the FSDP2 shard degree (1: replicas or the plain module; K under HSDP)
    sharding: str  # `Sharding`'s value


# Every knob and setting but `compile`: what a peak depends on.
EAGER_KNOBS = attrgetter(*(f.name for f in fields(Config) if f.name != "compile"))


class Peaks:
    """Peak memory of configs of `model` on `n` GPUs of `device`, `gpus_per_node` of them in each
    node (default: one node), each group of terms computed once per distinct value of the knobs
    it reads (memos of one batch of configs: nothing outlives it)."""

    def __init__(
        self, model: ModelSpec, n: int, device: str, gpus_per_node: int | None = None
    ) -> None:
        s = structure_of(model)
        self.device = device
        per_node = min(gpus_per_node or n, n)
        # on one node `shard: node` is the same mesh as `all` (`mesh_shape`): one memo entry
        self._hsdp = per_node < n
        self._peaks: dict[Any, Peak] = {}
        self._model_state = lru_cache(maxsize=None)(partial(_model_state, s, n, per_node, device))
        self._activations = lru_cache(maxsize=None)(partial(_activations, model, s))

    def of(self, config: Config) -> Peak:
        key = EAGER_KNOBS(config)
        found = self._peaks.get(key)
        if found is None:
            if len(self._peaks) >= MEMO_SIZE:
                self._peaks.clear()
            found = self._peaks[key] = self._peak(config)
        return found

    def _peak(self, c: Config) -> Peak:
        m = self._model_state(
            c.wrap, c.shard if self._hsdp else "all", c.reshard, c.quant, c.lora_rank,
            c.lora_targets, c.precision, c.optimizer, c.offload, c.grad_accum > 1,
        )  # fmt: skip
        a = self._activations(
            c.micro_batch, c.seq_len, c.lora_rank, c.checkpointing, m.autocast, c.lora_targets,
            c.lora_dropout, c.loss, c.quant,
        )  # fmt: skip
        return _forward_or_later(m, a, self.device)


class _ModelState(NamedTuple):
    """What a config's model takes whatever its activations: the persistent state, the gathered
    parameters, and the larger of the two moments after forward (`_later`)."""

    st: _States
    g: _Gathered
    autocast: bool
    later: Peak
    later_total: float


def _model_state(
    s: Structure, n: int, per_node: int, device: str, wrap: str, mesh: str, reshard: bool,
    quant: str, lora: int, targets: mem.Targets, precision: str, optimizer: str, offload: str,
    accumulates: bool,
) -> _ModelState:  # fmt: skip
    """The model state of a config: its persistent state, its gathered parameters (through
    autocast's copies, which its precision and sharding decide) and the moments after forward.
    `mesh` is the `shard` knob; `per_node` the GPUs of a node (`n` on one node)."""
    st = _states(s, n, per_node, device, wrap, mesh, quant, lora, targets, precision, optimizer,
                 offload, accumulates)  # fmt: skip
    autocast = uses_autocast(precision, optimizer, st.sharding)
    g = _gathered(s, n, device, wrap, reshard, quant, lora, targets, autocast)
    return _ModelState(st, g, autocast, *_later(st, g, device))


def _later(st: _States, g: _Gathered, device: str) -> tuple[Peak, float]:
    """The larger of the moments without activations (the optimizer's on a tie), as the peak,
    and its total. Each moment's parts are in `BREAKDOWN_KEYS` order."""
    # Optimizer step: the gradients exist, activations are gone. Backward's tail (last unit's
    # unsharded grads + the embedding unit gathered) is folded in here, and on CPU trials the
    # single-tensor AdamW's temporaries.
    optimizer = (
        st.base, st.weights, st.grads + st.accum + g.unit_grads, st.opt + st.opt_temp,
        g.at_reduce, 0.0, 0.0,
    )  # fmt: skip
    # The root's first all-gather under `wrap: model`: buffer and unsharded params at once, with
    # the model states but hardly any activations yet (no layer's backward has begun).
    gather = (
        st.base, st.weights, st.buckets + st.accum, st.opt, g.end_of_forward + g.root_buffer,
        0.0, 0.0,
    )  # fmt: skip
    if sum(optimizer) >= sum(gather):
        return _peak_at(st, "optimizer", optimizer, device), sum(optimizer)
    return _peak_at(st, "gather", gather, device), sum(gather)


def _forward_or_later(m: _ModelState, a: _Activations, device: str) -> Peak:
    """The peak: the end of forward, or the larger moment after it (`_later`), which forward
    wins on a tie."""
    st, g = m.st, m.g
    # Every saved activation is alive from the end of forward into backward, beside one of two
    # things that are never alive together: the loss's tensors over the vocabulary (while FSDP2
    # has resharded every layer unit after its forward: `gathered_at_loss`), then, once they are
    # freed, the last layer's backward: its unit and the prefetched one gathered (`[norm, head]`
    # resharded after its own backward), the unit's unsharded gradients and, under
    # checkpointing, the layer being recomputed. The larger is the forward phase.
    # The loss's own peak is in its forward (with FSDP2's last all-gather output still held) or
    # at the start of its backward, whichever is larger.
    gathered_at_loss, logits = g.at_loss, a.logits
    if a.loss_forward + g.forward_buffer > logits:
        gathered_at_loss, logits = gathered_at_loss + g.forward_buffer, a.loss_forward
    forward_grads = st.buckets + st.accum
    # (gradients, gathered_params, activations, logits_loss) at either moment
    at_loss = (forward_grads, gathered_at_loss, a.kept, logits)
    at_layer = (forward_grads + g.layer_grads, g.at_layer_backward, a.kept + a.recomputed, 0.0)
    moment = at_layer if sum(at_layer) > sum(at_loss) else at_loss  # the loss's on a tie
    gradients, gathered_params, activations, logits_loss = moment
    forward = (st.base, st.weights, gradients, st.opt, gathered_params, activations, logits_loss)
    if sum(forward) >= m.later_total:
        return _peak_at(st, "forward", forward, device)
    return m.later


def _peak_at(st: _States, phase: str, parts: tuple[float, ...], device: str) -> Peak:
    """The peak at `phase`, holding `parts` (in `BREAKDOWN_KEYS` order)."""
    breakdown = dict(zip(BREAKDOWN_KEYS, map(round, parts), strict=True))  # whole bytes
    allocated = sum(breakdown.values())
    overhead = {
        "allocator": 0 if device == "cpu" else int(mem.allocator_overhead(allocated)),
        "cuda_context": mem.cuda_context_bytes(device),
    }
    reserved = allocated + overhead["allocator"]
    return Peak(
        breakdown, phase, allocated, overhead, reserved, st.host, st.trainable, st.shard,
        st.sharding_name,
    )  # fmt: skip


class _States(NamedTuple):
    sharding: Sharding
    sharding_name: str
    shard: int
    trainable: int
    base: float  # frozen base weights
    weights: float  # trainable weights
    grads: float
    opt: float
    opt_temp: float  # the optimizer step's temporaries
    accum: float  # gradients kept across micro-steps
    buckets: float  # DDP's all-reduce buckets
    host: float  # offloaded to one node's host, all its ranks


def _states(
    s: Structure, n: int, per_node: int, device: str, wrap: str, mesh: str, quant: str,
    lora: int, targets: mem.Targets, precision: str, optimizer: str, offload: str,
    accumulates: bool,
) -> _States:  # fmt: skip
    """Persistent state per GPU (weights, gradients, optimizer), sharded over the mesh's shard
    dimension (`mem.shard_degree`), what offload moves to a node's host (its `per_node` ranks'
    share), and the gradients alive during forward."""
    sharding = sharding_for(wrap, n)
    shard = mem.shard_degree(sharding, n, mesh, per_node)
    trainable = mem.trainable_params(s, lora, targets)
    pb = mem.master_bytes(precision, optimizer)
    if lora:
        projections = mem.base_weight_bytes(s, quant)
        other = mem.frozen_other_bytes(s)
        # torchao Int8Tensor cannot be FSDP2-sharded, nor NF4 on a one-rank mesh: those
        # projections stay whole (the rule the builder's `unshardable_params` reads too).
        whole = base_stays_whole(quant, shard)
        base = projections + other / shard if whole else (projections + other) / shard
    else:
        projections, whole, base = 0.0, False, 0.0
    weights = trainable * pb / shard
    grads = trainable * mem.grad_bytes(precision, optimizer) / shard
    opt = trainable * mem.optimizer_bytes_per_param(optimizer, precision) / shard

    host = 0.0
    if offload == "params":
        # FSDP2 CPUOffloadPolicy: sharded params, grads and the optimizer step live on the host;
        # parameters FSDP2 leaves whole stay on the GPU.
        kept = projections if whole else 0.0
        host = (base - kept + weights + grads + opt) * per_node
        base, weights, grads, opt = kept, 0.0, 0.0, 0.0
    elif offload == "optimizer":
        # torchao CPUOffloadOptimizer: states + an fp32 param copy + grads on the host; device
        # grads are freed as soon as they are copied off (offload_gradients).
        host = (opt + trainable * (mem.FP32 + mem.FP32) / shard) * per_node
        opt = 0.0

    # Gradients alive during forward. FSDP2 with grad_accum > 1 skips the reduce-scatter on all
    # but the last micro-step and keeps unsharded gradients (in reduce_dtype fp32) on every GPU.
    # DDP allocates its all-reduce buckets (which the gradients are views of) when it wraps the
    # model, and under `no_sync` autograd accumulates into separate `.grad` tensors besides.
    # The plain module accumulates into `.grad` from the first micro-step on.
    accum = 0.0
    if accumulates and shard > 1:
        accum = trainable * mem.accumulated_grad_bytes(precision)
    elif accumulates:
        accum = grads  # 0 under offload=params: the gradients live on the host
    buckets = grads if sharding is Sharding.DDP else 0.0
    opt_temp = mem.optimizer_temp_bytes(s, lora, precision, optimizer, device, shard, targets)
    return _States(
        sharding, str(sharding), shard, trainable, base, weights, grads, opt, opt_temp, accum,
        buckets, host,
    )  # fmt: skip


class _Gathered(NamedTuple):
    end_of_forward: float  # all-gathered parameters at the end of forward (autocast copies too)
    at_loss: float  # through the loss's backward
    at_layer_backward: float  # during the last decoder layer's backward
    at_reduce: float  # while the last gradients are reduced
    forward_buffer: float  # FSDP2's last all-gather output, held through the loss's forward
    root_buffer: float  # the root's all-gather buffer under `wrap: model`
    unit_grads: float  # the reduced unit's unsharded gradients (end of backward)
    layer_grads: float  # a layer unit's unsharded gradients in its backward


def _gathered(
    s: Structure, n: int, device: str, wrap: str, reshard: bool, quant: str, lora: int,
    targets: mem.Targets, autocast: bool,
) -> _Gathered:  # fmt: skip
    """Unsharded parameters (and their gradients) at each moment: FSDP2's all-gathers, or the
    bf16 copies autocast makes."""
    sharding = sharding_for(wrap, n)
    gathered = mem.gathered_bytes(s, quant, lora, wrap, reshard, sharding, targets)
    copies = mem.autocast_copy_bytes(s, lora, autocast, targets)
    at_loss = copies + mem.gathered_at_loss_bytes(s, quant, lora, wrap, reshard, sharding, targets)
    gathered += copies
    return _Gathered(
        end_of_forward=gathered,
        at_loss=at_loss,
        at_layer_backward=copies
        + mem.gathered_at_layer_backward_bytes(s, quant, lora, wrap, reshard, sharding, targets),
        at_reduce=mem.gathered_at_reduce_bytes(s, wrap, sharding, device, gathered),
        forward_buffer=mem.forward_gather_buffer_bytes(s, quant, lora, wrap, sharding, targets),
        root_buffer=mem.root_all_gather_buffer_bytes(s, quant, lora, wrap, sharding, targets),
        unit_grads=mem.unit_grad_bytes(s, lora, wrap, sharding, targets),
        layer_grads=mem.layer_unit_grad_bytes(s, lora, wrap, sharding, targets),
    )


class _Activations(NamedTuple):
    kept: float  # saved by the decoder layers for backward (int8's bf16 weight copies too)
    logits: float  # outside the layers at the loss's peak
    loss_forward: float  # outside the layers at the peak of the loss's forward
    recomputed: float  # the layer backward recomputes


def _activations(
    model: ModelSpec, s: Structure, micro_batch: int, seq_len: int, lora: int, checkpointing: str,
    autocast: bool, targets: mem.Targets, dropout: float, loss: str, quant: str,
) -> _Activations:  # fmt: skip
    """Activations of one micro-batch, from the traced layer."""
    acts, logits = mem.activation_bytes(
        model, s, micro_batch, seq_len, lora, checkpointing, autocast, targets, dropout, loss
    )
    recomputed = mem.recomputed_layer_bytes(
        model, micro_batch, seq_len, lora, checkpointing, autocast, targets, dropout
    )
    if quant == "int8":
        acts += mem.int8_saved_weight_bytes(s, checkpointing)
    loss_forward = mem.loss_forward_bytes(
        model, micro_batch, seq_len, lora, checkpointing, autocast, targets, dropout, loss
    )
    return _Activations(acts, logits, loss_forward, recomputed)
