"""Napkin memory: bytes per GPU, part by part. Pure arithmetic: no torch, no tensors.

Each function is one term, with a comment naming where its number comes from. `docs/accuracy.md`
records how these terms compare with measured peaks and which were calibrated by measurement.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import autofit.recipe as recipe
from autofit.arch import ActivationKey, LayerActivations, Structure, activations_of
from autofit.config import Sharding, mesh_shape, wrap_group_size
from autofit.models import ModelSpec

Targets = tuple[str, ...] | None  # `lora_targets`: None adapts every projection

BF16 = recipe.DTYPE_BYTES[recipe.BF16]
FP32 = recipe.DTYPE_BYTES[recipe.FP32]
MiB = 1024**2


# ----- storage widths ---------------------------------------------------------------------------
def base_bytes_per_param(quant: str) -> float:
    """Bytes per frozen base-projection weight, quantization scales included.

    - none: `autofit.recipe.FROZEN_DTYPE` (bf16, 2 B) whatever `precision` says.
    - int8: torchao int8 weight-only: 1 B + one bf16 scale per output row, counted per model in
      `base_weight_bytes` (torchao `Int8WeightOnlyConfig`, per-channel symmetric).
    - nf4: torchao `to_nf4` (QLoRA, Dettmers et al. 2023): `autofit.recipe.nf4_bytes_per_param`
      (4-bit codes + an int8 scale per 64 weights + a bf16 factor per 64 x 256 weights).
    """
    if quant == "nf4":
        return recipe.nf4_bytes_per_param()
    if quant == "int8":
        return 1.0
    return float(recipe.DTYPE_BYTES[recipe.FROZEN_DTYPE])


def master_bytes(precision: str, optimizer: str = "adamw") -> int:
    """Bytes per trainable parameter: fp32 master weights under bf16-mixed (FSDP2
    `MixedPrecisionPolicy(param_dtype=bf16)` keeps the sharded originals in fp32; the plain module
    and DDP keep fp32 params under bf16 autocast), else bf16; the rule is
    `autofit.recipe.trainable_dtype`, which the builder reads too."""
    return recipe.DTYPE_BYTES[recipe.trainable_dtype(precision, optimizer)]


def grad_bytes(precision: str, optimizer: str = "adamw") -> int:
    """Sharded gradients live in the parameter's dtype (FSDP2 reduce-scatters in fp32 with
    `reduce_dtype=fp32` and casts to the sharded param's dtype)."""
    return master_bytes(precision, optimizer)


def accumulated_grad_bytes(precision: str) -> int:
    """Unsharded gradients kept across micro-steps without sync: FSDP2 converts them to
    `reduce_dtype` (fp32 under bf16-mixed); under pure bf16 they stay bf16
    (`autofit.recipe.reduce_dtype`, which the builder's `MixedPrecisionPolicy` reads too)."""
    return recipe.DTYPE_BYTES[recipe.reduce_dtype(precision)]


def optimizer_bytes_per_param(optimizer: str, precision: str) -> float:
    """AdamW's two moments in the param's dtype, or torchao AdamW8bit / AdamW4bit's block-wise
    quantized ones: `autofit.recipe.optimizer_state_bytes_per_param` (whose block sizes the builder
    passes to torchao)."""
    return recipe.optimizer_state_bytes_per_param(optimizer, master_bytes(precision, optimizer))


# ----- parameter groups -------------------------------------------------------------------------
# `s` is the model's structure read from the model itself (`autofit.arch.Structure`): exact counts
# by role for any family.
def trainable_params(s: Structure, lora_rank: int, targets: Targets = None) -> int:
    return s.lora_params(lora_rank, targets) if lora_rank > 0 else s.n_params


def base_weight_bytes(s: Structure, quant: str) -> float:
    """All frozen projection weights of a LoRA run at their storage width (unsharded)."""
    total = s.linear_params * base_bytes_per_param(quant)
    if quant == "int8":
        rows = sum(p.out_features for p in s.projections)
        total += s.layers * rows * BF16
    return total


def frozen_other_bytes(s: Structure) -> int:
    """Everything but the projections in a LoRA run (embedding, head, norms, biases, MoE router
    and experts): frozen, bf16, never quantized."""
    return (s.root_params + s.layers * s.layer_frozen_other_params) * BF16


def shard_degree(
    sharding: Sharding, n_gpus: int, shard: str = "all", gpus_per_node: int | None = None
) -> int:
    """The GPUs each FSDP2 state is split over: the shard dimension of the mesh
    (`autofit.config.mesh_shape`: every GPU under `shard: all`, the GPUs of one node under HSDP's
    `shard: node`); the plain module and DDP replicas hold everything."""
    if sharding is not Sharding.FSDP2:
        return 1
    return mesh_shape(shard, n_gpus, gpus_per_node or n_gpus)[1]


# ----- all-gather buffers -----------------------------------------------------------------------
def gathered_layer_bytes(
    s: Structure, quant: str, lora_rank: int, targets: Targets = None
) -> float:
    """One decoder layer's parameters as FSDP2 all-gathers them: in bf16 (MixedPrecisionPolicy
    param_dtype, or bf16 storage); NF4 gathers its packed codes and scales (torchao NF4Tensor
    implements fsdp_pre_all_gather); int8 is not sharded so never gathered."""
    if lora_rank == 0:
        return s.layer_params * BF16
    lora = s.lora_params(lora_rank, targets) / s.layers * BF16
    others = s.layer_frozen_other_params * BF16
    if quant == "int8":
        return lora + others
    return s.layer_linear_params * base_bytes_per_param(quant) + lora + others


def embed_unit_bytes(s: Structure) -> float:
    """The token-embedding unit gathered in bf16 (its own FSDP2 unit, as torchtitan shards it)."""
    return s.embedding_params * BF16


def head_unit_bytes(s: Structure) -> float:
    """The `[final norm, LM head]` unit gathered in bf16 (a tied head is the embedding's weight,
    which then stays in the root unit with the embedding)."""
    return (s.head_params + s.final_norm_params) * BF16


def gathered_bytes(
    s: Structure, quant: str, lora_rank: int, wrap: str, reshard: bool, sharding: Sharding,
    targets: Targets = None,
) -> float:  # fmt: skip
    """Peak bytes of unsharded (all-gathered) parameters held at once on a GPU, at the end of
    forward, for FSDP2 laid out as torchtitan does (autofit/build/fsdp.py):

    - `[norm, head]` is not resharded after forward (backward needs it first): gathered;
    - the embedding unit is resharded after forward when `reshard` (else kept);
    - with layer units and reshard_after_forward=True, at most the current unit and the
      prefetched next one are gathered (FSDP2 implicit prefetching); with reshard=False every
      unit stays gathered from its forward to its backward; `model` puts every layer in the root
      unit, which FSDP2 never reshards after forward.

    The plain module and DDP gather nothing (their bf16 working copies under autocast are
    `autocast_copy_bytes`).
    """
    if sharding is not Sharding.FSDP2:
        return 0.0
    layer = gathered_layer_bytes(s, quant, lora_rank, targets)
    k = wrap_group_size(wrap, s.layers)
    if wrap == "model" or k >= s.layers or not reshard:
        layers = s.layers * layer
    else:
        layers = 2 * k * layer
    if s.tied_embeddings:  # embedding, norm and the tied head live in the root unit
        return embed_unit_bytes(s) + s.final_norm_params * BF16 + layers
    embed = 0.0 if reshard else embed_unit_bytes(s)
    return head_unit_bytes(s) + embed + layers


def root_all_gather_buffer_bytes(
    s: Structure, quant: str, lora_rank: int, wrap: str, sharding: Sharding,
    targets: Targets = None,
) -> float:  # fmt: skip
    """With `wrap: model` the root unit is every layer, and its first all-gather in forward holds
    the all-gather output buffer beside the unsharded params until the copy-out is done (FSDP2
    `AllGatherState`, `_fsdp_param_group.py`): a second whole-model copy at that moment, while
    activations are still few (FSDPMemTracker at 7B: 12.38 + 12.14 GiB). Smaller units make this
    one unit's worth, inside the prefetch allowance of `gathered_bytes`."""
    if sharding is not Sharding.FSDP2 or wrap != "model":
        return 0.0
    return s.layers * gathered_layer_bytes(s, quant, lora_rank, targets)


def gathered_at_loss_bytes(
    s: Structure, quant: str, lora_rank: int, wrap: str, reshard: bool, sharding: Sharding,
    targets: Targets = None,
) -> float:  # fmt: skip
    """Unsharded parameters from the end of forward through the loss's backward. With layer
    units and reshard_after_forward=True each unit was resharded after its own forward and is
    gathered again only for its backward, once the loss's tensors are freed: what remains is
    `[norm, head]` and the root (`gathered_bytes` without its two layer units, which belong to
    the layers' backward). Without resharding, or with `model`, every layer stays gathered.
    CPU trials measured the difference (bench/accuracy.py --families: two units of Mixtral's
    experts counted at the loss over-estimated its LoRA runs by 16-18%)."""
    total = gathered_bytes(s, quant, lora_rank, wrap, reshard, sharding, targets)
    k = wrap_group_size(wrap, s.layers)
    if sharding is not Sharding.FSDP2 or wrap == "model" or k >= s.layers or not reshard:
        return total
    return total - 2 * k * gathered_layer_bytes(s, quant, lora_rank, targets)


def gathered_at_layer_backward_bytes(
    s: Structure, quant: str, lora_rank: int, wrap: str, reshard: bool, sharding: Sharding,
    targets: Targets = None,
) -> float:  # fmt: skip
    """Unsharded parameters during the last decoder layer's backward: `gathered_bytes` (its unit
    and the prefetched one, or every layer without resharding) less an untied `[norm, head]`
    unit, which FSDP2 reshards after its own backward, just before."""
    total = gathered_bytes(s, quant, lora_rank, wrap, reshard, sharding, targets)
    if sharding is not Sharding.FSDP2 or s.tied_embeddings:
        return total
    return total - head_unit_bytes(s)


def gathered_at_reduce_bytes(s: Structure, wrap: str, sharding: Sharding, device: str,
                             gathered: float) -> float:  # fmt: skip
    """Gathered params while the last gradients are reduced (end of backward). The embedding unit
    is unsharded for its backward, the last to run; every other unit was resharded after its own
    backward. With `model` on CUDA the root reshards before it reduces (FSDPMemTracker at 7B); on
    CPU trials gloo's reduce-scatter path keeps the forward's buffers (measured)."""
    if sharding is not Sharding.FSDP2:
        return 0.0
    if wrap == "model" and device == "cpu":
        return gathered
    return embed_unit_bytes(s)


def unit_grad_bytes(s: Structure, lora_rank: int, wrap: str, sharding: Sharding,
                    targets: Targets = None) -> float:  # fmt: skip
    """Unsharded gradients of the unit being reduced at the end of its backward: bf16 from
    autograd plus the fp32 copy FSDP2 makes for `reduce_dtype=fp32` (6 B per trainable parameter
    of the unit; the largest unit sets the peak). `model` is one unit of every layer; the
    embedding and `[norm, head]` are units of their own. The plain module and DDP accumulate
    straight into `.grad` (DDP's bucket views): nothing extra.
    Calibrated on CPU trials (docs/accuracy.md)."""
    if sharding is not Sharding.FSDP2:
        return 0.0
    if lora_rank:
        per_layer = s.lora_params(lora_rank, targets) / s.layers
        edges = 0.0
    else:
        per_layer = s.layer_params
        edges = max(s.embedding_params, s.head_params + s.final_norm_params)
    k = max(1, min(wrap_group_size(wrap, s.layers), s.layers))  # `model`: every layer
    return max(k * per_layer, edges) * (BF16 + FP32)


def layer_unit_grad_bytes(s: Structure, lora_rank: int, wrap: str, sharding: Sharding,
                          targets: Targets = None) -> float:  # fmt: skip
    """The unsharded gradients of one unit of decoder layers in its backward (bf16 from autograd
    and FSDP2's fp32 copy for the reduce-scatter), the part of `unit_grad_bytes` alive while the
    other layers' activations still are (the last layer's backward). `model` has no layer unit
    of its own (its gradients come at the end of backward)."""
    if sharding is not Sharding.FSDP2 or wrap == "model":
        return 0.0
    per_layer = s.lora_params(lora_rank, targets) / s.layers if lora_rank else s.layer_params
    k = max(1, min(wrap_group_size(wrap, s.layers), s.layers))
    return k * per_layer * (BF16 + FP32)


def autocast_copy_bytes(s: Structure, lora_rank: int, autocast: bool,
                        targets: Targets = None) -> float:  # fmt: skip
    """bf16 copies autocast makes of fp32 trainable weights for its matmuls, cached for the whole
    autocast region and then kept by autograd for backward (torch.amp autocast weight cache):
    every matrix a token multiplies by in a full fine-tune (projections, router, experts, the LM
    head, tied or not; the embedding lookup is not autocast), or the LoRA adapters. Only the
    plain module and DDP autocast (`autofit.config.uses_autocast`)."""
    if not autocast:
        return 0.0
    if lora_rank:
        return s.lora_params(lora_rank, targets) * BF16
    matrices = s.linear_params + s.layers * (s.layer_router_params + s.layer_expert_params)
    return (matrices + s.vocab * s.hidden) * BF16


def optimizer_temp_bytes(s: Structure, lora_rank: int, precision: str, optimizer: str,
                         device: str, shard: int, targets: Targets = None) -> float:  # fmt: skip
    """Transient tensors of the optimizer step. On CUDA torch AdamW is fused (none); CPU trials run
    the single-tensor AdamW, which allocates two temporaries the size of each (local) parameter in
    turn, so the largest trainable tensor's shard sets them (measured: 2 x the fp32 embedding of
    llama-mini on the plain module)."""
    if device != "cpu":
        return 0.0
    if lora_rank:
        largest = s.largest_lora_matrix(targets) * lora_rank
    else:
        largest = s.largest_param
    return 2 * largest * master_bytes(precision, optimizer) / shard


# ----- activations ------------------------------------------------------------------------------
def activation_bytes(
    model: ModelSpec, s: Structure, micro_batch: int, seq_len: int, lora_rank: int,
    checkpointing: str, autocast: bool, targets: Targets = None, dropout: float = 0.0,
    loss: str = "standard",
) -> tuple[float, float]:  # fmt: skip
    """(decoder layers, outside the layers) activation bytes of one micro-batch at the peak of
    forward, from one layer of the real architecture traced at real width
    (`autofit.arch.activations_of`: what it keeps for backward, per checkpointing policy, LoRA
    rank, targets and dropout, and whether it runs under autocast). Per layer:

    - none: what the layer keeps;
    - full: its checkpointed input;
    - every-2: `autofit.recipe.checkpointed_layers` (the builder's list) checkpointed, the rest
      kept;
    - selective: what op-level checkpointing saves (matmul and attention outputs).
    Outside the layers: embedding side, shared rotary tables and masks, final norm, and the
    logits and loss at their peak over the vocabulary (forward, and the start of backward), as
    the `loss` knob computes them (`traced_loss`: the whole batch's logits, or one chunk's beside
    the hidden states' gradient).
    The layer backward recomputes is `recomputed_layer_bytes`: it is never alive together with
    the loss's tensors (CPU trials of every family: counting both over-estimated checkpointed
    runs by 10-44%, bench/accuracy.py --families)."""
    kept, ckpt = _layer_traces(model, seq_len, lora_rank, checkpointing, autocast, targets,
                               dropout, loss)  # fmt: skip
    n = s.layers
    fixed = head_grad_sum_bytes(model, lora_rank, loss)
    if ckpt is None:
        return micro_batch * n * kept.layer, _outside(kept.root, micro_batch, fixed)
    k = len(recipe.checkpointed_layers(checkpointing, n))
    per_seq = k * ckpt.layer + (n - k) * kept.layer
    return micro_batch * per_seq, _outside(ckpt.root, micro_batch, fixed)


def head_grad_sum_bytes(model: ModelSpec, lora_rank: int, loss: str) -> float:
    """The chunked loss's fp32 sum of the LM head's gradient in a full fine-tune (4 B x vocab x
    hidden, `autofit.build.loss`), allocated once per micro-step whatever the micro-batch: the
    part of the traced root (one sequence) that does not scale with it (at Llama 3 8B's width,
    2 GiB that micro-batch 8 would otherwise count eight times). Liger's kernel sums it in the
    weight's dtype (an upper bound)."""
    if lora_rank or traced_loss(loss) != "chunked":
        return 0.0
    return FP32 * model.vocab * model.hidden


def _outside(root: float, micro_batch: int, fixed: float) -> float:
    """Bytes outside the layers for `micro_batch` sequences from the one-sequence trace."""
    return micro_batch * (root - fixed) + fixed


def loss_forward_bytes(
    model: ModelSpec, micro_batch: int, seq_len: int, lora_rank: int, checkpointing: str,
    autocast: bool, targets: Targets = None, dropout: float = 0.0, loss: str = "standard",
) -> float:  # fmt: skip
    """What lives outside the layers at the peak of forward alone, the loss computed but its
    backward not begun (`LayerActivations.root_forward`): for `standard` the bf16 logits, their
    fp32 copy and log-softmax's output (less than at the start of its backward); for `chunked`
    and `fused` the whole loss, whose gradients are computed in forward. FSDP2 still holds its
    last all-gather output then (`forward_gather_buffer_bytes`)."""
    kept, ckpt = _layer_traces(model, seq_len, lora_rank, checkpointing, autocast, targets,
                               dropout, loss)  # fmt: skip
    fixed = head_grad_sum_bytes(model, lora_rank, loss)
    return _outside((ckpt or kept).root_forward, micro_batch, fixed)


def forward_gather_buffer_bytes(
    s: Structure, quant: str, lora_rank: int, wrap: str, sharding: Sharding,
    targets: Targets = None,
) -> float:  # fmt: skip
    """The all-gather output of the last unit FSDP2 gathered in forward, which it keeps beside
    that unit's unsharded parameters until the next all-gather in forward or the root's
    post-forward (`AllGatherState`, "free the last all-gather result", torch 2.13
    `_fsdp_param_group.wait_for_unshard`, `_fsdp_state._post_forward`). A HF causal LM computes
    its loss inside the root's forward, so through the loss's forward this is a second copy of
    `[norm, head]` (untied), or of the last unit of decoder layers (a tied head lives in the
    root). Measured on CPU trials (two gloo ranks, 128K vocabulary): without it, `loss: chunked`,
    whose whole working set is in forward, was under-estimated by 29%. `model` (the root's own
    buffer, alive through forward) is the `gather` phase's (`root_all_gather_buffer_bytes`)."""
    if sharding is not Sharding.FSDP2 or wrap == "model":
        return 0.0
    if not s.tied_embeddings:
        return head_unit_bytes(s)
    k = max(1, min(wrap_group_size(wrap, s.layers), s.layers))
    return k * gathered_layer_bytes(s, quant, lora_rank, targets)


def recomputed_layer_bytes(
    model: ModelSpec, micro_batch: int, seq_len: int, lora_rank: int, checkpointing: str,
    autocast: bool, targets: Targets = None, dropout: float = 0.0,
) -> float:  # fmt: skip
    """With checkpointing, backward recomputes one checkpointed layer at a time, all its
    activations alive then besides what the checkpoint kept (under `selective`, the element-wise
    tensors it recomputes): the traced layer without checkpointing less the checkpointed one.
    By then the loss's tensors over the vocabulary have been freed (`estimate` takes the larger
    moment)."""
    kept, ckpt = _layer_traces(model, seq_len, lora_rank, checkpointing, autocast, targets,
                               dropout)  # fmt: skip
    if ckpt is None:
        return 0.0
    return micro_batch * max(kept.layer - ckpt.layer, 0.0)


def traced_loss(loss: str) -> str:
    """The loss a trace runs for the `loss` knob: Liger's kernel (`fused`, CUDA only, so never
    traced) is counted as `chunked`, the same computation in pure torch: Liger's chunk rule and
    hidden-state gradient, with its chunk's logits held in bf16 and overwritten by their gradient
    in place where `chunked` has fp32 copies, so the count is an upper bound of a few chunk-sized
    tensors (Liger `fused_linear_cross_entropy_forward`)."""
    return "chunked" if loss == "fused" else loss


@lru_cache(maxsize=4096)
def _layer_traces(
    model: ModelSpec, seq_len: int, lora_rank: int, checkpointing: str, autocast: bool,
    targets: Targets, dropout: float, loss: str = "standard",
) -> tuple[LayerActivations, LayerActivations | None]:  # fmt: skip
    """The traced layer without checkpointing, and checkpointed as `checkpointing` does it
    (op-level for `selective`, the whole layer otherwise; None without checkpointing): the two
    traces `activation_bytes`, `loss_forward_bytes` and `recomputed_layer_bytes` read (memoised:
    a space asks for the same few thousands of times)."""
    key = ActivationKey(seq_len, lora_rank, targets, dropout, "none", autocast, traced_loss(loss))
    kept = activations_of(model, key)
    if checkpointing == "none":
        return kept, None
    policy = "selective" if checkpointing == "selective" else "full"
    return kept, activations_of(model, replace(key, policy=policy))


def int8_saved_weight_bytes(s: Structure, checkpointing: str) -> float:
    """torchao's int8 weight-only linear computes `mm(x, qdata.t().to(bf16)) * scale`
    (torchao `Int8Tensor` linear, per-row path), so autograd saves the bf16 copy of every
    projection weight for the input gradient: 2 B per base weight of every layer whose
    activations are kept (one layer at a time inside checkpointed layers). Measured on CPU trials
    (docs/accuracy.md): without this term int8 runs were under-estimated by 20-28%."""
    return layers_keeping_activations(s, checkpointing) * s.layer_linear_params * BF16


def layers_keeping_activations(s: Structure, checkpointing: str) -> int:
    """Decoder layers whose every saved tensor is alive at once: all without checkpointing, the
    uncheckpointed half plus the one being recomputed with `every-2`, only the one being
    recomputed with `full` or op-level `selective` (which recomputes the pointwise ops). The
    checkpointed layers are `autofit.recipe.checkpointed_layers`, the builder's list."""
    checkpointed = len(recipe.checkpointed_layers(checkpointing, s.layers))
    kept = s.layers - checkpointed + (1 if checkpointed else 0)
    return min(kept, s.layers)


# ----- overheads --------------------------------------------------------------------------------
def allocator_overhead(allocated: float) -> float:
    """Caching-allocator slack, reserved minus allocated. With
    `expandable_segments:True` fragmentation is small; PyTorch's allocator rounds blocks to 512 B
    and grows segments by 2/20 MiB. Assumed: 5% + 256 MiB (not yet calibrated on a GPU; see
    docs/accuracy.md)."""
    return 0.05 * allocated + 256 * MiB


CUDA_CONTEXT_BYTES = 512 * MiB
"""CUDA context, cuBLAS workspaces and NCCL buffers outside PyTorch's allocator: ~300-600 MiB on
Ampere/Hopper with CUDA 12 lazy loading (PyTorch CUDA semantics notes; NCCL docs). Counted against
capacity but not in `max_memory_reserved`."""


def cuda_context_bytes(device: str) -> int:
    """The CUDA context on a GPU; nothing on CPU trials, which count tensor bytes only."""
    return 0 if device == "cpu" else CUDA_CONTEXT_BYTES


def usable_bytes(capacity: float, device: str) -> float:
    """What `max_memory_reserved` may reach on a GPU of `capacity`: capacity minus context."""
    return capacity - cuda_context_bytes(device)


HOST_RAM_USABLE = 0.8
"""Share of host RAM that offloaded state (and pinned copies) may take: the rest is the OS, the
data loader and the Python processes themselves."""


def usable_host_bytes(host_capacity: float) -> float:
    """What offloaded state may take of a host with `host_capacity` bytes of RAM."""
    return HOST_RAM_USABLE * host_capacity
