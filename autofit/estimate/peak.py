"""The peak memory of configurations: the terms of `memory.py` put together at the three
moments that can hold the peak (end of forward, optimizer step, the root's first all-gather).

A space repeats the same few knob values tens of thousands of times, so `Peaks` computes each
group of terms once per distinct value of the knobs it reads: the model state (parameters,
gradients, optimizer state, gathered copies, and with them the two moments after forward:
`_model_state`), the activations (`_activations`), and the peak once per value of every knob
(the allocator's slack once per value of every knob but `compile`: its replay is eager). A
compiled config's activations are its eager twin's less what AOTAutograd's partitioner recomputes
in the layers that keep theirs (`memory.compiled_recomputed_bytes`: the MLP's activation output),
and, for LoRA with `full` or `every-2` recomputation, plus what its fused MLP backward holds at
once (`memory.compiled_mlp_fusion_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from operator import attrgetter
from typing import Any, NamedTuple

from autofit import recipe
from autofit.arch import step_events_of, structure_of
from autofit.config import Config
from autofit.estimate import memory as mem
from autofit.estimate.slack import Slack, StepShape, replay_slack
from autofit.estimate.state import Gathered, States, gathered_at_moments, states
from autofit.estimate.terms import reads
from autofit.layout import LAYOUT_KNOBS, Layout, Sharding, embedding_precision, layout_of
from autofit.models import ModelSpec
from autofit.recipe import (
    DTYPE_BYTES,
    bnb_of,
    checkpointed_layers,
    recompute_policy,
    reduce_dtype,
)
from autofit.settings import BNB_SETTINGS, HF_LAUNCHES
from autofit.structure import ActivationKey, Structure
from autofit.values import Batching, Checkpointing, Launch, Loss, Offload, Quant, TrainEmbeddings

BREAKDOWN_KEYS = (
    "base_weights",
    "trainable_weights",
    "gradients",
    "optimizer_state",
    "gathered_params",
    "activations",
    "logits_loss",
    "workspace",
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
    # "allocator": 0 here (a batch's replay sets the slack), then what lies outside the allocator
    overhead: dict[str, int]
    host: float  # offloaded to one node's host RAM, all its ranks
    trainable: int  # trainable parameters (all GPUs)
    layout: Layout  # how the run holds the model (`layout_of`)
    outside: int = 0  # the overhead's parts outside the allocator, summed


REPLAY_LAYERS = 16
"""Decoder layers a replay composes at most: the slack settles within a few layers, as each
layer's holes are the next one's (llama-70b at 2,048 tokens on 8 GPUs, replayed with 16, 32 and
80 layers: LoRA r16 `ckpt=full` 231 MiB each time, LoRA without checkpointing 177 / 163 / 167 MiB,
a full fine-tune 2.23 / 2.54 / 2.46 GiB), and 80 take five times as long."""

# Replays of allocation sequences, kept for the process (each takes tens of milliseconds at 7B):
# key -> `Slack`, cleared when full.
_REPLAYS: dict[Any, Slack] = {}
REPLAY_MEMO_SIZE = 4096

_LAYOUT_KEY = attrgetter(*LAYOUT_KNOBS)

# Every knob and setting but `compile`: what a peak depends on.
EAGER_KNOBS = attrgetter(*(f.name for f in fields(Config) if f.name != "compile"))


class Peaks:
    """Peak memory of configs of `model` on `n` GPUs of `device`, `gpus_per_node` of them in each
    node (default: one node), each group of terms computed once per distinct value of the knobs
    it reads (memos of one batch of configs: nothing outlives it)."""

    def __init__(
        self, model: ModelSpec, n: int, device: str, gpus_per_node: int | None = None,
        *, workspace: int = 0, outside: mem.Outsides | None = None,
        foreach_intermediates: int | None = None, expandable_segments: bool = True,
    ) -> None:  # fmt: skip
        s = structure_of(model)
        self.device = device
        per_node = min(gpus_per_node or n, n)
        self._peaks: dict[Any, Peak] = {}
        # outside the allocator, by the communicators of a config's layout (0, 1, 2)
        if outside is None:
            outside = mem.outsides(device, n)
        self._model_state = _model_state.memo(
            s, per_node, device, float(workspace), outside, foreach_intermediates,
            _gathered.memo(s, device),
        )  # fmt: skip
        self._layouts: dict[Any, Layout] = {}  # by the layout knobs' values
        self._activations = _activations.memo(model, s, device)
        self._workspace = float(workspace)
        self._outside = outside
        self._model = model
        self._structure = s
        self._n = n
        self._per_node = per_node
        self._foreach_intermediates = foreach_intermediates
        self._expandable = expandable_segments

    def of(self, config: Config, padding_mask: bool = False) -> Peak:
        """The peak of `config`; `padding_mask`: its micro-batch is padded rows of different
        lengths with an attention mask (`padding_mask_applies`)."""
        key = EAGER_KNOBS(config)
        if config.compile:  # its peak differs from its eager twin's (`_peak`)
            key = (key, True)
        if padding_mask:
            key = (key, "mask")
        found = self._peaks.get(key)
        if found is None:
            if len(self._peaks) >= MEMO_SIZE:
                self._peaks.clear()
            found = self._peaks[key] = self._peak(config, padding_mask)
        return found

    def replayed_slack(self, c: Config) -> Slack:
        """The caching allocator's slack at `c`'s peak, from a replay of two of its steps
        (`autofit.estimate.slack`), once per distinct value of the knobs a peak reads (and per
        process: `_REPLAYS` keeps them across batches)."""
        key = self.replay_key(c)
        found = _REPLAYS.get(key)
        if found is None:
            if len(_REPLAYS) >= REPLAY_MEMO_SIZE:
                _REPLAYS.clear()
            found = _REPLAYS[key] = self._replay(c)
        return found

    def replay_key(self, c: Config) -> tuple[Any, ...]:
        """What a replay depends on: configs with equal keys have the same slack."""
        return (self._model, self._n, self._per_node, self.device, self._expandable,
                self._foreach_intermediates, EAGER_KNOBS(c))  # fmt: skip

    def _replay(self, c: Config) -> Slack:
        s, n = self._structure, self._n
        m = self._state(c)
        st = m.st
        layers = min(s.layers, REPLAY_LAYERS)
        checkpointed = set(checkpointed_layers(c.checkpointing, layers))
        per_layer_state = 1.0 / s.layers  # each composed layer holds one layer's state
        policy = recompute_policy(c.checkpointing)
        # the head's and the loss's allocations differ by loss
        loss = mem.traced_loss(c.loss, c.launch)
        casts = mem.adapter_casts(c.launch, c.lora_rank, m.autocast)
        keys = {
            p: ActivationKey(
                c.seq_len, c.lora_rank, c.lora_targets, c.lora_dropout, p, m.autocast, loss, casts
            )  # fmt: skip
            for p in {Checkpointing.NONE.value, policy}
        }
        events = {p: step_events_of(self._model, k) for p, k in keys.items()}
        per_layer = [
            events[policy if i in checkpointed else Checkpointing.NONE] for i in range(layers)
        ]
        persistent = st.base + st.weights + st.buckets
        fsdp = st.sharding is Sharding.FSDP2
        unit = mem.gathered_layer_bytes(s, c.quant, c.lora_rank, c.lora_targets) if fsdp else 0.0
        offload = fsdp and c.offload == Offload.PARAMS
        embedding_trained = st.layout.trains_all or c.train_embeddings != TrainEmbeddings.NONE
        # on a one-rank mesh FSDP2 copies each parameter in from the host instead of gathering
        host = _host_params(s, c, st.layout, embedding_trained) if offload and st.shard == 1 else ()
        shape = StepShape(
            layers=layers,
            micro_batch=c.micro_batch,
            weights_per_layer=persistent * per_layer_state,
            weights_outside=persistent * per_layer_state,
            opt_per_layer=st.opt * per_layer_state,
            gathered_per_layer=unit,
            grad_shard=1.0 / max(st.shard, 1) if n > 1 else 1.0,
            reshard=c.reshard,
            # the traced gradients are in the compute dtype (bf16 under FSDP2); FSDP2 reduces
            # in `reduce_dtype`
            reduce_ratio=DTYPE_BYTES[reduce_dtype(c.precision)] / mem.BF16,
            offload=offload,
            host_params=host,
            embedding_trained=embedding_trained,
        )
        return replay_slack(per_layer, shape, expandable_segments=self._expandable)

    def layout(self, c: Config) -> Layout:
        """The layout of `c` (resolved) on these GPUs and model (`layout_of`), resolved once per
        value of the knobs it reads (`LAYOUT_KNOBS`)."""
        key = _LAYOUT_KEY(c)
        found = self._layouts.get(key)
        if found is None:
            s = self._structure
            found = self._layouts[key] = layout_of(
                c, self._n, self._per_node, s.layers, self.device,
                tuple(p.name for p in s.projections),
            )  # fmt: skip
        return found

    def _state(self, c: Config) -> _ModelState:
        return self._model_state(c, self.layout(c), c.grad_accum > 1)

    def _peak(self, c: Config, padding_mask: bool = False) -> Peak:
        m = self._state(c)
        a = self._activations(c, m.autocast)
        if padding_mask:  # the same square mask as packed rows' (`mem.packed_mask_bytes`)
            mask = mem.packed_mask_bytes(
                self._model, self._structure, c.micro_batch, c.seq_len, c.checkpointing
            )
            a = a._replace(kept=a.kept + mask)
        outside = self._outside[m.st.layout.communicators]
        if c.compile:  # the partitioner recomputes what the uncheckpointed layers' MLPs saved
            recomputed = mem.compiled_recomputed_bytes(
                self._structure, c.micro_batch, c.seq_len, c.checkpointing
            )
            a = a._replace(kept=a.kept - recomputed)
        if c.compile and mem.compiled_fusion_applies(c.lora_rank, c.checkpointing):
            fused = mem.compiled_mlp_fusion_bytes(
                self._structure, c.micro_batch, c.seq_len, c.lora_targets
            )
            a = a._replace(backward=a.backward + fused)
        return _forward_or_later(m, a, self.device, self._workspace, outside)


def _host_params(
    s: Structure, c: Config, layout: Layout, embedding_trained: bool
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """`offload: params` on a one-rank mesh: the parameters FSDP2 copies from the host to gather
    each unit (`StepShape.host_params`), as (bytes stored, bytes gathered), in module order: the
    embedding's, one layer unit's (per projection its base weight unless it stays whole on the
    GPU, then LoRA's A and B; then the norms and the rest), `[norm, head]`'s. The base is stored
    in `layout.base_dtype`, what is trained in `layout.param_dtype` (the embedding and head when
    `embedding_trained`); all is gathered in `layout.compute_dtype`. (A QLoRA model that
    `prepare_model_for_kbit_training` upcast is a Trainer launch's, which runs no FSDP2.)"""
    gathered = DTYPE_BYTES[layout.compute_dtype]
    trained, base = DTYPE_BYTES[layout.param_dtype], DTYPE_BYTES[layout.base_dtype]
    outer = trained if embedding_trained else base

    def param(n: int, stored: int) -> tuple[int, int]:
        return (n * stored, n * gathered)

    layer: list[tuple[int, int]] = []
    whole = recipe.base_stays_whole(c.quant, layout.shard)
    rank = c.lora_rank
    for p in s.projections:
        if layout.trains_all or not whole:
            layer.append(param(p.weight_params, base))
        if p.name in layout.adapted:
            layer += [param(rank * p.in_features, trained), param(p.out_features * rank, trained)]
    layer.append(param(s.layer_frozen_other_params, base))
    head = (param(s.final_norm_params, outer), param(s.head_params, outer))
    return (param(s.embedding_params, outer),), tuple(layer), tuple(p for p in head if p[0])


BNB_KNOBS = ("quant_backend", *BNB_SETTINGS)
"""The settings of bitsandbytes' NF4 storage, which the terms that count the base read
(`recipe.bnb_of`)."""


def padding_mask_applies(config: Config, padded_rows: bool) -> bool:
    """Whether `config`'s micro-batch at its peak carries an attention mask over padding: under
    `launch: trainer` (and `trl`, whose collator pads alike unless it packs) a Trainer script's
    collator pads rows of different lengths (the data's lengths under `padded` or `grouped`,
    `padded_rows`) and passes their `attention_mask`, from which transformers builds a 4-D mask
    for SDPA (bool `rows x width²`, and per layer that keeps its activations SDPA's bf16 copy and
    k, v repeated per query head: what `packed` rows' block-diagonal mask costs). autofit's own
    padded rows pass no mask (the causal kernel)."""
    return padded_rows and config.launch in HF_LAUNCHES and config.batching != Batching.PACKED


class _ModelState(NamedTuple):
    """What a config's model takes whatever its activations: the persistent state, the gathered
    parameters, and the larger of the two moments after forward (`_later`)."""

    st: States
    g: Gathered
    autocast: bool
    later: Peak
    later_total: float


@reads("reshard", "train_embeddings", "launch", layout=True)
def _model_state(
    k: Any, s: Structure, per_node: int, device: str, workspace: float, outsides: mem.Outsides,
    foreach_intermediates: int | None, gathered: Callable[..., Gathered], layout: Layout,
    accumulates: bool,
) -> _ModelState:  # fmt: skip
    """The model state of a config whose layout is `layout`: its persistent state, its gathered
    parameters (`gathered`: `_gathered`'s memo, through autocast's copies, which its precision
    and sharding decide) and the moments after forward. `per_node` is the GPUs of a node;
    `accumulates` whether `grad_accum` > 1."""
    st = states(
        s, layout, per_node, device, k.quant, k.lora_rank, k.lora_targets, k.precision,
        k.optimizer, k.offload, accumulates, k.train_embeddings, foreach_intermediates, bnb_of(k),
        k.launch,
    )  # fmt: skip
    autocast = st.layout.autocast
    g = gathered(k, st.sharding, autocast)
    # a trained head's gradient exists from its backward on, the last layer's included
    held = embedding_precision(k.precision, k.launch, k.train_embeddings)
    head_grad = mem.trained_head_grad_bytes(
        s, k.train_embeddings, st.sharding, st.shard, held, k.optimizer, accumulates
    )
    g = g._replace(layer_grads=g.layer_grads + head_grad)
    outside = outsides[st.layout.communicators]
    return _ModelState(st, g, autocast, *_later(st, g, device, workspace, outside))


@reads("wrap", "reshard", "quant", "lora_rank", "lora_targets", "train_embeddings", "launch",
       *BNB_KNOBS)  # fmt: skip
def _gathered(k: Any, s: Structure, device: str, sharding: Sharding, autocast: bool) -> Gathered:
    """The unsharded parameters of a config at each moment of a step (`gathered_at_moments`),
    under its layout's `sharding` and `autocast`: a term of its own, as it reads neither the
    precision, the optimizer nor the checkpointing the model state is keyed by."""
    return gathered_at_moments(
        s, sharding, device, k.wrap, k.reshard, k.quant, k.lora_rank, k.lora_targets, autocast,
        k.train_embeddings, k.launch, mem.kbit_prepared(k.quant, bnb_of(k), k.launch)
    )  # fmt: skip


def _later(
    st: States, g: Gathered, device: str, workspace: float, outside: dict[str, int]
) -> tuple[Peak, float]:
    """The larger of the moments without activations (the optimizer's on a tie), as the peak,
    and its total. Each moment's parts are in `BREAKDOWN_KEYS` order."""
    # Optimizer step: the gradients exist, activations are gone. Backward's tail (last unit's
    # unsharded grads + the embedding unit gathered) is folded in here, and on CPU trials the
    # single-tensor AdamW's temporaries. What gradient accumulation kept is not there beside
    # the gradients: the plain module accumulated into `.grad` itself, FSDP2 reduce-scattered
    # and freed its unsharded accumulators in the last micro-step, and DDP's reducer copied the
    # `no_sync` gradients into its buckets and made `.grad` views of them again; each is
    # counted in the forward moment of a later micro-step (`st.accum`), where it does coexist.
    # DDP without bucket views (HF Trainer's, `Layout.grad_views`) holds each gradient twice:
    # `.grad` and its copy in the all-reduce bucket.
    copies = 0.0 if st.layout.grad_views else st.buckets
    optimizer = (
        st.base, st.weights, st.grads + copies + g.unit_grads, st.opt + st.opt_temp,
        g.at_reduce, 0.0, 0.0, workspace,
    )  # fmt: skip
    # The root's first all-gather under `wrap: model`: buffer and unsharded params at once, with
    # the model states but hardly any activations yet (no layer's backward has begun).
    gather = (
        st.base, st.weights, st.buckets + st.accum, st.opt, g.end_of_forward + g.root_buffer,
        0.0, 0.0, workspace,
    )  # fmt: skip
    if sum(optimizer) >= sum(gather):
        return _peak_at(st, "optimizer", optimizer, device, outside), sum(optimizer)
    return _peak_at(st, "gather", gather, device, outside), sum(gather)


def _forward_or_later(
    m: _ModelState, a: _Activations, device: str, workspace: float, outside: dict[str, int]
) -> Peak:
    """The peak: the end of forward, or the larger moment after it (`_later`), which forward
    wins on a tie."""
    st, g = m.st, m.g
    # Every saved activation is alive from the end of forward into backward, beside one of two
    # things that are never alive together: the loss's tensors over the vocabulary (while FSDP2
    # has resharded every layer unit after its forward: `gathered_at_loss`), then, once they are
    # freed, the last layer's backward: its unit and the prefetched one gathered (`[norm, head]`
    # resharded after its own backward), the unit's unsharded gradients and the layer's backward
    # working set (traced: the gradients in flight, its temporaries, under checkpointing the
    # layer recomputed; NF4's dequantized weight). The larger is the forward phase.
    # The loss's own peak is in its forward (with FSDP2's last all-gather output still held) or
    # at the start of its backward, whichever is larger.
    gathered_at_loss, logits = g.at_loss - a.copies_freed, a.logits
    if a.loss_forward + g.forward_buffer > logits - a.copies_freed:
        gathered_at_loss, logits = g.at_loss + g.forward_buffer, a.loss_forward
    forward_grads = st.buckets + st.accum
    # (gradients, gathered_params, activations, logits_loss) at either moment
    at_loss = (forward_grads, gathered_at_loss, a.kept, logits)
    if st.head_grad and a.head_out_grad + st.head_grad > logits:
        # the head's backward: its new weight gradient beside its output's gradient, larger
        # than the loss tensors over the vocabulary that were freed before it
        at_loss = (forward_grads + st.head_grad, gathered_at_loss, a.kept, a.head_out_grad)
    at_layer = (forward_grads + g.layer_grads, g.at_layer_backward, a.kept + a.backward, 0.0)
    moment = at_layer if sum(at_layer) > sum(at_loss) else at_loss  # the loss's on a tie
    gradients, gathered_params, activations, logits_loss = moment
    forward = (st.base, st.weights, gradients, st.opt, gathered_params, activations, logits_loss,
               workspace)  # fmt: skip
    if sum(forward) >= m.later_total:
        return _peak_at(st, "forward", forward, device, outside)
    return m.later


def _peak_at(
    st: States, phase: str, parts: tuple[float, ...], device: str, outside: dict[str, int]
) -> Peak:
    """The peak at `phase`, holding `parts` (in `BREAKDOWN_KEYS` order); the allocator's slack
    over them and what lies `outside` the allocator (the CUDA context, NCCL's buffers)."""
    breakdown = dict(zip(BREAKDOWN_KEYS, map(round, parts), strict=True))  # whole bytes
    allocated = sum(breakdown.values())
    overhead = {
        "allocator": 0,  # the batch's replay sets it (`autofit.estimate._allocator_slacks`)
        **outside,
    }
    return Peak(
        breakdown, phase, allocated, overhead, st.host, st.trainable, st.layout,
        sum(outside.values()),
    )  # fmt: skip


class _Activations(NamedTuple):
    kept: float  # saved by the decoder layers for backward (int8's bf16 weight copies too)
    logits: float  # outside the layers at the loss's peak
    loss_forward: float  # outside the layers at the peak of the loss's forward
    backward: float  # the last layer's backward, besides what the layers keep
    head_out_grad: float = 0.0  # the head output's gradient in its compute dtype (`standard`)
    # autocast's copies gone by the loss's backward (`launch: trl`: `_copies_freed_at_loss`)
    copies_freed: float = 0.0


@reads("micro_batch", "seq_len", "lora_rank", "checkpointing", "lora_targets", "lora_dropout",
       "loss", "quant", "train_embeddings", "batching", *BNB_KNOBS, "launch")  # fmt: skip
def _activations(
    k: Any, model: ModelSpec, s: Structure, device: str, autocast: bool
) -> _Activations:
    """Activations of one micro-batch, from the traced layer (and a trained head's, which the
    trace of the frozen one does not keep: `mem.trained_head_loss_bytes`), under `autocast`
    (what the model state's precision and sharding decide). Under `launch: trl` the loss is TRL's
    fused LM head (its buffers on `device`'s path: `_trl_head`), and packed rows reach the model
    flattened into one (`mem.collated_rows`)."""
    kbit = mem.kbit_prepared(k.quant, bnb_of(k), k.launch)
    acts, logits = mem.activation_bytes(
        model, s, k.micro_batch, k.seq_len, k.lora_rank, k.checkpointing, autocast, k.lora_targets,
        k.lora_dropout, k.loss, k.launch, kbit
    )  # fmt: skip
    backward = mem.layer_backward_bytes(
        model, k.micro_batch, k.seq_len, k.lora_rank, k.checkpointing, autocast, k.lora_targets,
        k.lora_dropout, k.launch, kbit
    ) + (0.0 if kbit else mem.dequant_transient_bytes(s, k.quant, bnb_of(k)))  # fmt: skip
    # (the `kbit` trace makes bitsandbytes' dequantized weight where its backward does)
    if k.quant == Quant.INT8:
        acts += mem.int8_saved_weight_bytes(s, k.checkpointing)
    # on the data's lengths (`autofit.estimate.data`); under TRL always
    if k.batching == Batching.PACKED:
        rows, width = mem.collated_rows(k.micro_batch, k.seq_len, k.launch == Launch.TRL)
        acts += mem.packed_mask_bytes(model, s, rows, width, k.checkpointing)
    loss_forward = mem.loss_forward_bytes(
        model, k.micro_batch, k.seq_len, k.lora_rank, k.checkpointing, autocast, k.lora_targets,
        k.lora_dropout, k.loss, k.launch, kbit
    )  # fmt: skip
    head_at_loss, head_in_forward = mem.trained_head_loss_bytes(
        s, k.micro_batch, k.seq_len, k.train_embeddings, mem.traced_loss(k.loss, k.launch)
    )
    # the head's backward runs on its output's bf16 gradient, once the fp32 loss tensors over
    # the vocabulary are freed (the chunked loss computes the head's gradient itself)
    head_out_grad = (
        k.micro_batch * k.seq_len * s.vocab * mem.BF16
        if mem.traced_loss(k.loss, k.launch) == Loss.STANDARD
        else 0.0
    )
    freed = 0.0
    if k.launch == Launch.TRL:  # the trace's root is what the fused head's buffers sit on
        head = _trl_head(k, s, device, autocast)
        logits, loss_forward = logits + head.backward, loss_forward + head.forward
        freed = _copies_freed_at_loss(k, s, autocast)
    return _Activations(
        acts, logits + head_at_loss, loss_forward + head_in_forward, backward, head_out_grad,
        freed,
    )  # fmt: skip


def _copies_freed_at_loss(k: Any, s: Structure, autocast: bool) -> float:
    """The bf16 copies autocast made of the trainable weights (`mem.autocast_copy_bytes`) that
    are gone when TRL's fused head runs its backward: autocast's cache is cleared when the
    forward's autocast region ends, and a checkpointed layer saved none of its copies, so only
    the layers that keep their activations still hold theirs (llama-debug LoRA r8 with `full`
    checkpointing under SFTTrainer: every adapter's copy gone, 0.30 MB, at the head's backward,
    the peak). Counted for `launch: trl`, whose head's backward is its peak; the other launches'
    peaks were measured without it."""
    copies = mem.autocast_copy_bytes(s, k.lora_rank, autocast, k.lora_targets, head=False)
    return copies * recipe.checkpointed_count(k.checkpointing, s.layers) / s.layers


def _trl_head(k: Any, s: Structure, device: str, autocast: bool) -> mem.FusedHead:
    """TRL's fused LM head of one micro-batch (`mem.fused_head_bytes`): the hidden states and the
    head weight in the dtype the model holds them (a full fine-tune's fp32 masters under autocast,
    bf16 otherwise), the head trained in a full fine-tune, Triton's folds on CUDA."""
    rows, width = mem.collated_rows(k.micro_batch, k.seq_len, k.batching == Batching.PACKED)
    width_bytes = mem.FP32 if autocast and not k.lora_rank else mem.BF16
    # a LoRA run trains the head too where `train_embeddings: full` copies it (peft's bf16
    # copy, `embedding_precision`)
    copies = k.train_embeddings == TrainEmbeddings.FULL
    return mem.fused_head_bytes(
        rows, width, s.hidden, s.vocab, width_bytes, width_bytes, not k.lora_rank or copies,
        device == "cuda",
    )  # fmt: skip
