"""Napkin memory: bytes per GPU, part by part. Pure arithmetic: no torch, no tensors.

Each function is one term, with a comment naming where its number comes from. `docs/accuracy.md`
records how these terms compare with measured peaks and which were calibrated by measurement.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import autofit.recipe as recipe
from autofit.arch import activations_of
from autofit.config import (
    Sharding,
    mesh_shape,
    trained_token_count,
    trained_tokens_error,
    wrap_group_size,
)
from autofit.errors import ConfigError
from autofit.models import ModelSpec
from autofit.structure import ActivationKey, LayerActivations, Structure

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
# `s` is the model's structure read from the model itself (`autofit.structure.Structure`): exact
# counts by role for any family.
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
    forward, for FSDP2 laid out as torchtitan does (autofit/builder/fsdp.py):

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


def head_grad_bytes(
    s: Structure, lora_rank: int, train_embeddings: str, precision: str, optimizer: str,
    sharding: Sharding, offload: str = "none",
) -> float:  # fmt: skip
    """A trained LM head's weight gradient, born in the head's backward beside its output's
    bf16 gradient (the loss's fp32 tensors over the vocabulary freed by then): the plain
    module's and DDP's `.grad` of the head (a full fine-tune, or `train_embeddings`; tied, the
    shared weight's), in the trainable dtype. With gradient accumulation the earlier
    micro-steps' `.grad` is there already and autograd's `AccumulateGrad` adds the new one into
    it, so it is a transient beside it. The loss's trace stops at the logits' gradient, before
    any weight gradient; FSDP2's unit gradients are counted per unit (`unit_grad_bytes`)."""
    if sharding is Sharding.FSDP2 or offload == "params":
        return 0.0
    if lora_rank == 0:
        params = s.head_params or s.embedding_params
    elif train_embeddings != "none":
        params = trained_module_params(s, train_embeddings)
    else:
        return 0.0
    return params * grad_bytes(precision, optimizer)


OPTIMIZER_INTERMEDIATES = {"fused": 0, "foreach": 1, "foreach-2.0": 2}
"""How torch's AdamW runs its step on CUDA, and how many parameter-sized intermediates the step
holds at once: `fused` (one kernel per group, none: what autofit's build and every export pin,
`fused=True`, Trainer `optim: adamw_torch_fused`); `foreach` (torch's default when `fused` is not
set, HF Trainer's `adamw_torch`, since torch 2.1: one, `foreach_temp_bytes`); `foreach-2.0`
(torch 2.0's foreach step, two: `_multi_tensor_adamw` kept `exp_avg_sq_sqrt =
torch._foreach_sqrt(...)` alive beside `denom = torch._foreach_add(exp_avg_sq_sqrt, eps)` until
`_foreach_addcdiv_`; pytorch/pytorch#97712, cut to one by #104898 for 2.1). An estimate of a
launch autofit did not set up can name the others (`bench/published.py` does)."""

OPTIMIZER_IMPLS = tuple(OPTIMIZER_INTERMEDIATES)


def foreach_temp_bytes(trainable: float, master: int, shard: int, impl: str = "foreach") -> float:
    """The foreach AdamW step's intermediates: `torch/optim/adamw.py` `_multi_tensor_adam` takes
    `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)` over every parameter of a
    (device, dtype) group at once, a new list as large as the (local) trainable parameters in
    their own dtype, and frees it after `_foreach_addcdiv_`; the other updates are in place.
    `impl` counts them (`OPTIMIZER_INTERMEDIATES`)."""
    return OPTIMIZER_INTERMEDIATES[impl] * trainable * master / shard


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
    The last layer's backward is `layer_backward_bytes`: it is never alive together with
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
    hidden, `autofit.builder.loss`), allocated once per micro-step whatever the micro-batch: the
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


def layer_backward_bytes(
    model: ModelSpec, micro_batch: int, seq_len: int, lora_rank: int, checkpointing: str,
    autocast: bool, targets: Targets = None, dropout: float = 0.0,
) -> float:  # fmt: skip
    """What the last decoder layer's backward holds at its peak besides the activations the
    layers kept (`LayerActivations.backward`, traced as its own moment: the one-layer model's
    whole backward): the gradient flowing in, the gradients of the layer's activations in flight
    and its backward's temporaries (SwiGLU's, attention's), and under checkpointing the layer
    recomputed with all its activations. Parameters' gradients are counted from the parameters.
    By then the loss's tensors over the vocabulary have been freed (`estimate` takes the larger
    moment). With `every-2` the larger of a checkpointed and a kept layer's (the peak is at
    whichever backward holds more)."""
    kept, ckpt = _layer_traces(model, seq_len, lora_rank, checkpointing, autocast, targets,
                               dropout)  # fmt: skip
    if ckpt is None:
        return micro_batch * kept.backward
    if checkpointing == "every-2":
        return micro_batch * max(kept.backward, ckpt.backward)
    return micro_batch * ckpt.backward


def compiled_fusion_applies(lora_rank: int, checkpointing: str) -> bool:
    """Whether `compile` makes a config hold more than its eager twin (`compiled_mlp_fusion_bytes`):
    LoRA with whole-layer recomputation."""
    return bool(lora_rank) and checkpointing in ("full", "every-2")


def compiled_mlp_fusion_bytes(
    s: Structure, micro_batch: int, seq_len: int, targets: Targets = None
) -> float:
    """What a compiled, recomputed LoRA layer's MLP backward holds beyond the eager one's: Inductor
    fuses the recomputed SwiGLU with its backward into one kernel whose inputs keep the base and
    LoRA partial products of gate and up apart (`base + scale x LoRA` is never materialised) and
    of down's input gradient, beside its outputs once per branch: a token-width tensor per adapted
    MLP output and per adapted MLP input more than eager holds. Measured on CPU trials
    (`bench/compile_memory.py`, llama-debug and llama-mini LoRA r16 `ckpt=full`, seq 128): the
    compiled peak 11-13% above eager, +4.5 x micro_batch x seq x intermediate x 2 B in one layer
    (this counts 5 for Llama's all-linear targets); without recomputation compiling keeps less
    (the partitioner recomputes element-wise results), which the estimate does not count."""
    width = sum(
        2 * p.out_features if p.in_features == s.hidden else p.in_features
        for p in s.targets(targets)
        if p.name.startswith("mlp.")
    )
    return micro_batch * seq_len * BF16 * width


NF4_DEQUANT_TRANSIENT_BYTES = 14.0
"""Bytes per weight alive while torchao 0.18 dequantizes an NF4 weight for a matmul
(`NF4Tensor.get_original_weight` in `linear_nf4`'s forward, and again in its backward): the
unpacked codes, their looked-up values, the scales and the bf16 weight, freed after the matmul.
Measured with the trials' tensor tracker on a 4096 x 1024 and an 11008 x 4096 weight: 14.02-14.05
B per weight in forward and in backward (the same aten ops run on CUDA)."""


def dequant_transient_bytes(s: Structure, quant: str) -> float:
    """The working memory of dequantizing the largest NF4 projection (one matmul at a time, in a
    layer's forward and again in its backward). int8 keeps its bf16 copy for backward instead
    (`int8_saved_weight_bytes`) and holds nothing more (measured: 2.0 B per weight kept, 0.03 B
    more in backward)."""
    if quant != "nf4":
        return 0.0
    return NF4_DEQUANT_TRANSIENT_BYTES * max(p.weight_params for p in s.projections)


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
    traces `activation_bytes`, `loss_forward_bytes` and `layer_backward_bytes` read (memoised:
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


# ----- trainable embeddings and LM head (`train_embeddings`) -------------------------------------
# The builder trains the modules `autofit.recipe.trained_embedding_modules` names (the input
# embedding, and the LM head unless it is tied to it), the rows `trained_token_ids` says, with
# peft beside the frozen LoRA base (`autofit.builder.lora.embedding_options`). The frozen originals
# stay (counted with the base, `frozen_other_bytes`); the trained weights are trainable
# parameters like the adapters (fp32 masters, gradients and optimizer state by `trainable`).
def trained_rows(s: Structure, train_embeddings: str) -> int:
    """Token rows trained in each trained module; `tokens:N` beyond the vocabulary is a
    `ConfigError`."""
    problem = trained_tokens_error(train_embeddings, s.vocab)
    if problem is not None:
        raise ConfigError(problem)
    return len(recipe.trained_token_ids(train_embeddings, s.vocab))


def trained_module_params(s: Structure, train_embeddings: str) -> int:
    """Trained parameters of one trained module (the embedding's, or the head's: both are
    vocab x hidden): its trained rows x its width."""
    if train_embeddings == "none":
        return 0
    return trained_rows(s, train_embeddings) * (s.embedding_params // max(s.vocab, 1))


def trained_embedding_params(s: Structure, train_embeddings: str) -> int:
    """Trainable parameters `train_embeddings` adds to a LoRA run: `full` a trainable copy of the
    embedding and of an untied head (Qwen-7B: 2 x 151,936 x 4,096 = 1.24 B; its README's "LoRA
    (emb)" run measures 13.6 GB more than its LoRA run, 33.7 vs 20.1 GB at seq 256 on one A100);
    `tokens:N` N rows of each. A tied head's trained weight is the embedding's: counted once."""
    modules = recipe.trained_embedding_modules(train_embeddings, s.tied_embeddings)
    return len(modules) * trained_module_params(s, train_embeddings)


def trained_token_buffer_bytes(s: Structure, train_embeddings: str) -> float:
    """`tokens:N`: peft keeps the original values of the trained rows as a buffer beside each
    trained module's rows (`TrainableTokensLayer.trainable_tokens_original`, in the frozen dtype:
    the builder casts it); a buffer is whole on every GPU (FSDP2 shards parameters only)."""
    if trained_token_count(train_embeddings) is None:
        return 0.0
    return trained_embedding_params(s, train_embeddings) * BF16


def trained_unit_grad_bytes(s: Structure, train_embeddings: str, sharding: Sharding) -> float:
    """Under FSDP2 the embedding unit and `[norm, head]` (or, tied, the root) hold the trained
    weights, so the unit reduced at the end of its backward has their unsharded gradients, bf16
    from autograd and FSDP2's fp32 copy for the reduce-scatter (`unit_grad_bytes`' rule for the
    units of the embedding and head of a full fine-tune); the largest unit sets the peak."""
    if sharding is not Sharding.FSDP2:
        return 0.0
    return trained_module_params(s, train_embeddings) * (BF16 + FP32)


def trained_head_autocast_bytes(s: Structure, train_embeddings: str, autocast: bool) -> float:
    """Under autocast (the plain module and DDP, bf16-mixed) the head's fp32 trainable copy
    (`full`; tied: the embedding's copy) is multiplied through autocast's cached bf16 copy, kept
    for backward (`autocast_copy_bytes`' rule for the head of a full fine-tune). The embedding
    lookup is not autocast. `tokens:N` merges its rows into the bf16 weight instead
    (`trained_head_loss_bytes`)."""
    if not autocast or train_embeddings != "full":
        return 0.0
    return trained_module_params(s, train_embeddings) * BF16


def trained_largest_tensor(s: Structure, train_embeddings: str) -> int:
    """Elements of the largest trainable tensor `train_embeddings` adds (one module's trained
    weight): what CPU AdamW's temporaries are sized by (`optimizer_temp_bytes`)."""
    return trained_module_params(s, train_embeddings)


def trained_head_loss_bytes(
    s: Structure, micro_batch: int, seq_len: int, train_embeddings: str, loss: str
) -> tuple[float, float]:
    """What a trained LM head adds outside the layers that a frozen one's traced loss does not
    keep, (at the loss's peak through the start of its backward, at the peak of its forward):

    - `standard`: the head's input (the final norm's bf16 output, tokens x hidden), which the
      head's matmul saves for its weight gradient (a frozen head saves only its weight);
    - `tokens:N`: the merged weight peft builds at each forward (`get_merged_weights`: the frozen
      weight with the trained rows copied in, vocab x hidden in bf16), which the head's matmul
      saves for the input gradient (`standard`), or which the chunked loss reads through its
      forward;
    - `chunked` (and Liger's `fused`, counted as it): the fp32 sum of the head weight's gradient,
      vocab x hidden, from the loss's forward through its backward (`autofit.builder.loss`; as
      `head_grad_sum_bytes` for a full fine-tune)."""
    if train_embeddings == "none":
        return 0.0, 0.0
    head = trained_module_params(s, "full")  # the head's whole weight, vocab x hidden
    merged = head * BF16 if trained_token_count(train_embeddings) is not None else 0.0
    if traced_loss(loss) == "chunked":
        grad_sum = head * FP32
        return grad_sum, grad_sum + merged
    kept = micro_batch * seq_len * s.hidden * BF16 + merged
    return kept, kept


def trained_head_grad_bytes(
    s: Structure, train_embeddings: str, sharding: Sharding, shard: int, precision: str,
    optimizer: str, accumulates: bool,
) -> float:  # fmt: skip
    """The trained head's gradient in the last decoder layer's backward (the head's backward ran
    first): the plain module's `.grad` in the trainable dtype. Under FSDP2, the `[norm, head]`
    unit's reduce-scattered shard, and the reduce-scatter's input (the unit's unsharded gradients
    in the reduce dtype), which FSDP2 keeps until the next unit's reduce-scatter
    (`reduce_scatter_states`, torch 2.13 `_fsdp_param_group.post_backward`; measured on CPU
    trials: +1.5 MiB at llama-debug's last layer's backward for a 1 MiB fp32 head copy on 2
    ranks); with a tied head, the root unit's unsharded bf16 gradient, which the root reduces
    only at the end of backward. DDP's buckets and accumulated gradients are counted whole from
    the start of forward already."""
    head = trained_module_params(s, train_embeddings)
    if not head or accumulates or sharding is Sharding.DDP:
        return 0.0
    if sharding is Sharding.FSDP2 and s.tied_embeddings:
        return head * BF16
    if sharding is Sharding.FSDP2:
        reduce_input = recipe.DTYPE_BYTES[recipe.reduce_dtype(precision)]
        return head * (grad_bytes(precision, optimizer) / shard + reduce_input)
    return head * grad_bytes(precision, optimizer)


def trained_token_grad_bytes(s: Structure, train_embeddings: str) -> float:
    """`tokens:N`: the embedding's backward makes the gradient of the whole merged weight
    (dense, vocab x hidden, in its bf16 dtype) before peft keeps its trained rows: a transient at
    the end of backward (beside the gradients then alive: the optimizer step's moment)."""
    if trained_token_count(train_embeddings) is None:
        return 0.0
    return trained_module_params(s, "full") * BF16


# ----- overheads --------------------------------------------------------------------------------
def allocator_overhead(allocated: float) -> float:
    """Caching-allocator slack, reserved minus allocated, where no allocation sequence was
    replayed (`autofit.estimate.slack` replays one for the configs that matter, and the others
    take the replayed configs' share): 5% + 256 MiB, assumed. Replays of 7B steps with
    expandable segments give 1.3-6% (docs/estimator.md)."""
    return 0.05 * allocated + 256 * MiB


CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
"""cuBLAS's workspace per (handle, stream) before Hopper: `:4096:2:16:8`, 8 MiB + 128 KiB
(torch `aten/src/ATen/cuda/CublasHandlePool.cpp` `parseChosenWorkspaceSize`;
`CUBLAS_WORKSPACE_CONFIG` overrides it)."""
CUBLAS_WORKSPACE_BYTES_SM90 = 4096 * 8 * 1024
"""The same on compute capability 9.0 (H100, H200): 32 MiB."""
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024
"""cuBLASLt's own workspace per (handle, stream), 1024 KiB (`parseCUDABlasLtWorkspaceSize`,
`CUBLASLT_WORKSPACE_SIZE`; not unified with cuBLAS's unless
`TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`)."""
BLAS_HANDLES = 2
"""cuBLAS handles that run a training step's matmuls on the compute stream: one per thread
(`getCurrentCUDABlasHandle` reserves a handle from a thread-local pool window), and a step's
matmuls run on two threads, the Python thread's forward and the autograd engine's device thread's
backward (torch `autograd/engine.cpp`: one worker thread per device)."""


def workspace_bytes(device: str, compute_capability: tuple[int, int] = (8, 0)) -> int:
    """cuBLAS and cuBLASLt workspaces: allocated through PyTorch's caching allocator
    (`getNewWorkspace`, `getNewCUDABlasLtWorkspace`), once per handle and stream and kept, so they
    are part of the allocated (and reserved) bytes from the first matmul on; none on CPU."""
    if device == "cpu":
        return 0
    cublas = (
        CUBLAS_WORKSPACE_BYTES_SM90
        if tuple(compute_capability) == (9, 0)
        else (CUBLAS_WORKSPACE_BYTES)
    )
    return BLAS_HANDLES * (cublas + CUBLASLT_WORKSPACE_BYTES)


CUDA_CONTEXT_BYTES = 512 * MiB
"""The CUDA context of a training process, outside PyTorch's allocator: the driver's state and
the kernels loaded into device memory. With lazy module loading (PyTorch's default since 1.13,
`CUDA_MODULE_LOADING=LAZY`) a bare context is 287 MB (pytorch/pytorch#86509, CUDA 11.7) to
426 MiB (unslothai/unsloth-zoo#1053: torch 2.10, CUDA 13, RTX 6000 Ada); a training step then
loads its kernels (cuBLAS GEMMs, attention, the fused optimizer, NCCL's), which is not measured
here: 512 MiB is assumed until a GPU session measures the device-level peak
(`bench/gpu_trials.py`)."""

NCCL_CONNECTION_BYTES = (1 << 22) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
"""NCCL's buffers for one connection of one channel, one per protocol: Simple 4 MiB
(`DEFAULT_BUFFSIZE`, `NCCL_BUFFSIZE`), LL128 4,915,200 B (`NCCL_LL128_ELEMS_PER_THREAD` 120 x
`NCCL_LL128_MAX_NTHREADS` 640 x `NCCL_STEPS` 8 x 8 B) and LL 524,288 B (8 lines per thread x 512
threads x 8 steps x 16 B): NCCL `src/init.cc` `DEFAULT_*BUFFSIZE`. Allocated with cudaMalloc or
cuMem, outside PyTorch's allocator."""
NCCL_CHANNELS = {"nvlink": 32, "pcie": 4}
"""Ring channels NCCL opens between the GPUs of a node: up to 32 over NVLink/NVSwitch (NCCL's
`MAXCHANNELS`-bound ring search; 8 x H100 logs show "32 coll channels"), 2-4 over PCIe. NCCL's
memory is linear in its channels, and a ring has two connections per GPU whatever the scale
(NVIDIA/nccl#864, #986); a GPU holds one connection's buffers per channel (it receives on one and
sends on the other). The upper ends: an under-estimate is the error a planner may not make."""


def nccl_bytes(device: str, n_gpus: int, link: str, communicators: int = 1) -> int:
    """NCCL's buffers on each GPU: channels x one connection's buffers, per communicator (the
    process group's: FSDP2's all-gathers and reduce-scatters and DDP's all-reduce share it; HSDP
    has a second, across the replicas). Nothing on one GPU (no collective runs) or on CPU (gloo)."""
    if device == "cpu" or n_gpus <= 1:
        return 0
    return communicators * NCCL_CHANNELS.get(link, NCCL_CHANNELS["pcie"]) * NCCL_CONNECTION_BYTES


def outside_allocator_bytes(
    device: str, n_gpus: int = 1, link: str = "pcie", communicators: int = 1
) -> dict[str, int]:
    """Device memory a training process holds outside PyTorch's caching allocator, by part:
    the CUDA context and NCCL's buffers. What runs out on a card is the reserved bytes plus
    these (`Estimate.device_bytes`); none on CPU trials, which count tensor bytes only."""
    if device == "cpu":
        return {"cuda_context": 0, "nccl": 0}
    return {
        "cuda_context": CUDA_CONTEXT_BYTES,
        "nccl": nccl_bytes(device, n_gpus, link, communicators),
    }


def usable_bytes(
    capacity: float, device: str, n_gpus: int = 1, link: str = "pcie", communicators: int = 1
) -> float:
    """What `max_memory_reserved` may reach on a GPU of `capacity`: the capacity less what sits
    outside the allocator (`outside_allocator_bytes`)."""
    return capacity - sum(outside_allocator_bytes(device, n_gpus, link, communicators).values())


HOST_RAM_USABLE = 0.8
"""Share of host RAM that offloaded state (and pinned copies) may take: the rest is the OS, the
data loader and the Python processes themselves."""


def usable_host_bytes(host_capacity: float) -> float:
    """What offloaded state may take of a host with `host_capacity` bytes of RAM."""
    return HOST_RAM_USABLE * host_capacity
