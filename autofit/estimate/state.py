"""A config's model state per GPU, before activations: the persistent state (weights, gradients,
optimizer state, what offload moves to the host: `states`) and the unsharded parameters at each
moment of a step (FSDP2's all-gathers, autocast's copies: `gathered_at_moments`), from the terms
of `autofit.estimate.memory`. `autofit.estimate.peak` puts them together with the activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from autofit.estimate import memory as mem
from autofit.layout import Layout, Sharding, embedding_precision, embeddings_cast
from autofit.recipe import Bnb4bit, base_stays_whole
from autofit.structure import Structure
from autofit.values import Launch, Offload, TrainEmbeddings

__all__ = ["Gathered", "States", "gathered_at_moments", "states"]


class States(NamedTuple):
    """Bytes per GPU a config holds whatever the moment (`states`), and how it is sharded."""

    trainable: int
    base: float  # frozen base weights
    weights: float  # trainable weights
    grads: float
    opt: float
    opt_temp: float  # the optimizer step's temporaries
    accum: float  # gradients kept across micro-steps
    buckets: float  # DDP's all-reduce buckets
    host: float  # offloaded to one node's host, all its ranks
    head_grad: float  # a trained LM head's gradient, born in the loss's backward
    layout: Layout  # how the run holds the model (`autofit.layout`)

    @property
    def sharding(self) -> Sharding:
        return self.layout.sharding

    @property
    def shard(self) -> int:
        """The ranks each sharded parameter is split over (`Layout.shard`)."""
        return self.layout.shard


def states(
    s: Structure, layout: Layout, per_node: int, device: str, quant: str, lora: int,
    targets: mem.Targets, precision: str, optimizer: str, offload: str, accumulates: bool,
    embeddings: str = TrainEmbeddings.NONE, foreach_intermediates: int | None = None,
    bnb: Bnb4bit | None = None, launch: str = Launch.AUTOFIT,
) -> States:  # fmt: skip
    """Persistent state per GPU (weights, gradients, optimizer) of a config whose `layout` is
    (`autofit.layout.layout_of`), sharded over its mesh's shard dimension (`Layout.shard`), what
    offload moves to a node's host (its `per_node` ranks' share), the gradients alive during
    forward and the optimizer step's intermediates (of the layout's AdamW implementation,
    `Layout.adamw`; `foreach_intermediates`: another torch's count for foreach,
    `mem.optimizer_temp_bytes`)."""
    sharding, shard = layout.sharding, layout.shard
    adapters = mem.trainable_params(s, lora, targets)
    copies = mem.trained_embedding_params(s, embeddings)
    trainable = adapters + copies
    held = (precision, embedding_precision(precision, launch, embeddings))

    def per_gpu(width: Callable[[str], float]) -> float:
        """Bytes of the trainable parameters at `width(precision)` bytes each, per GPU."""
        return (adapters * width(held[0]) + copies * width(held[1])) / shard

    if lora:
        projections = mem.base_weight_bytes(s, quant, bnb)
        other = mem.frozen_other_bytes(s, mem.kbit_prepared(quant, bnb, launch))
        # torchao Int8Tensor cannot be FSDP2-sharded, nor NF4 on a one-rank mesh: those
        # projections stay whole (the rule the builder's `unshardable_params` reads too).
        whole = base_stays_whole(quant, shard)
        base = projections + other / shard if whole else (projections + other) / shard
        base += mem.trained_token_buffer_bytes(s, embeddings)  # buffers: whole on every GPU
    else:
        projections, whole, base = 0.0, False, 0.0
    weights = per_gpu(lambda p: mem.master_bytes(p, optimizer))
    grads = per_gpu(lambda p: mem.grad_bytes(p, optimizer))
    opt = per_gpu(lambda p: mem.optimizer_bytes_per_param(optimizer, p))

    host = 0.0
    if offload == Offload.PARAMS:
        # FSDP2 CPUOffloadPolicy: sharded params, grads and the optimizer step live on the host;
        # parameters FSDP2 leaves whole stay on the GPU.
        kept = projections if whole else 0.0
        host = (base - kept + weights + grads + opt) * per_node
        base, weights, grads, opt = kept, 0.0, 0.0, 0.0
    elif offload == Offload.OPTIMIZER:
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
    opt_temp = mem.optimizer_temp_bytes(
        s, lora, precision, optimizer, device, shard, targets,
        impl=layout.adamw, offload=offload,
        trainable=trainable, embeddings=embeddings, foreach_intermediates=foreach_intermediates,
        launch=launch, embedding_precision=held[1],
    )  # fmt: skip
    # DDP's gradients are views into its buckets (counted), but under `no_sync` autograd makes
    # separate `.grad` tensors, as it always does under HF Trainer's DDP (`Layout.grad_views`)
    ddp_views = sharding is Sharding.DDP and layout.grad_views and not accumulates
    head_grad = (
        0.0
        if ddp_views
        else mem.head_grad_bytes(
            s, lora, embeddings, held[1] if copies else precision, optimizer, sharding, offload
        )
    )
    return States(
        trainable, base, weights, grads, opt, opt_temp, accum, buckets, host, head_grad, layout
    )


class Gathered(NamedTuple):
    """Unsharded parameters and gradients per GPU at each moment of a step."""

    end_of_forward: float  # all-gathered parameters at the end of forward (autocast copies too)
    at_loss: float  # through the loss's backward
    at_layer_backward: float  # during the last decoder layer's backward
    at_reduce: float  # while the last gradients are reduced
    forward_buffer: float  # FSDP2's last all-gather output, held through the loss's forward
    root_buffer: float  # the root's all-gather buffer under `wrap: model`
    unit_grads: float  # the reduced unit's unsharded gradients (end of backward)
    layer_grads: float  # a layer unit's unsharded gradients in its backward


def gathered_at_moments(
    s: Structure, sharding: Sharding, device: str, wrap: str, reshard: bool, quant: str,
    lora: int, targets: mem.Targets, autocast: bool,
    embeddings: str = TrainEmbeddings.NONE,
    launch: str = Launch.AUTOFIT, kbit: bool = False,
) -> Gathered:  # fmt: skip
    """Unsharded parameters (and their gradients) at each moment, as the run's `sharding` holds
    them (`Layout.sharding`): FSDP2's all-gathers, or the bf16 copies autocast makes (none of
    the LM head under `launch: trl`, whose fused head casts it chunk by chunk; under `kbit` the
    frozen fp32 head's, through the loss: `kbit_head_copy_bytes`)."""
    gathered = mem.gathered_bytes(s, quant, lora, wrap, reshard, sharding, targets)
    copies = mem.autocast_copy_bytes(s, lora, autocast, targets, head=launch != Launch.TRL)
    # autocast runs over fp32 trainable params only: a trained head copy is one of them where
    # it is held in the trainable dtype (`autofit.layout.embeddings_cast`), not peft's bf16 copy
    copies += mem.trained_head_autocast_bytes(
        s, embeddings, autocast and embeddings_cast(launch, embeddings)
    )
    head_copy = mem.kbit_head_copy_bytes(s, kbit, autocast)
    at_loss = copies + head_copy
    at_loss += mem.gathered_at_loss_bytes(s, quant, lora, wrap, reshard, sharding, targets)
    gathered += copies + head_copy
    return Gathered(
        end_of_forward=gathered,
        at_loss=at_loss,
        at_layer_backward=copies
        + mem.gathered_at_layer_backward_bytes(s, quant, lora, wrap, reshard, sharding, targets),
        at_reduce=mem.gathered_at_reduce_bytes(s, wrap, sharding, device, gathered),
        forward_buffer=mem.forward_gather_buffer_bytes(s, quant, lora, wrap, sharding, targets),
        root_buffer=mem.root_all_gather_buffer_bytes(s, quant, lora, wrap, sharding, targets),
        unit_grads=max(
            mem.unit_grad_bytes(s, lora, wrap, sharding, targets),
            mem.trained_unit_grad_bytes(s, embeddings, sharding),
        )
        + mem.trained_token_grad_bytes(s, embeddings),
        layer_grads=mem.layer_unit_grad_bytes(s, lora, wrap, sharding, targets),
    )
