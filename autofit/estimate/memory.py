"""Napkin memory: bytes per GPU, part by part. Pure arithmetic: no torch, no tensors.

Each function is one term, with a comment naming where its number comes from. `docs/accuracy.md`
records how these terms compare with measured peaks and which were calibrated by measurement.
"""

from __future__ import annotations

from functools import lru_cache

import autofit.recipe as recipe
from autofit.config import Sharding, wrap_group_size
from autofit.models import ModelSpec

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
def trainable_params(model: ModelSpec, lora_rank: int) -> int:
    return model.lora_params(lora_rank) if lora_rank > 0 else model.n_params


def base_weight_bytes(model: ModelSpec, quant: str) -> float:
    """All frozen projection weights of a LoRA run at their storage width (unsharded)."""
    total = model.linear_params * base_bytes_per_param(quant)
    if quant == "int8":
        rows = sum(out for _, out in model.projection_shapes().values())
        total += model.layers * rows * BF16
    return total


def frozen_other_bytes(model: ModelSpec) -> int:
    """Embeddings, norms and LM head of a LoRA run: frozen, bf16."""
    return (model.root_params + model.layers * model.layer_norm_params) * BF16


def shard_degree(sharding: Sharding, n_gpus: int) -> int:
    """FSDP2 shards over all GPUs; the plain module and DDP replicas hold everything."""
    return n_gpus if sharding is Sharding.FSDP2 else 1


# ----- all-gather buffers -----------------------------------------------------------------------
def gathered_layer_bytes(model: ModelSpec, quant: str, lora_rank: int) -> float:
    """One decoder layer's parameters as FSDP2 all-gathers them: in bf16 (MixedPrecisionPolicy
    param_dtype, or bf16 storage); NF4 gathers its packed codes and scales (torchao NF4Tensor
    implements fsdp_pre_all_gather); int8 is not sharded so never gathered."""
    if lora_rank == 0:
        return model.layer_params * BF16
    lora = model.lora_params(lora_rank) / model.layers * BF16
    norms = model.layer_norm_params * BF16
    if quant == "int8":
        return lora + norms
    return model.layer_linear_params * base_bytes_per_param(quant) + lora + norms


def embed_unit_bytes(model: ModelSpec) -> float:
    """The token-embedding unit gathered in bf16 (its own FSDP2 unit, as torchtitan shards it)."""
    return model.embedding_params * BF16


def head_unit_bytes(model: ModelSpec) -> float:
    """The `[final norm, LM head]` unit gathered in bf16 (a tied head is the embedding's weight,
    which then stays in the root unit with the embedding)."""
    return (model.lm_head_params + model.hidden) * BF16


def gathered_bytes(
    model: ModelSpec, quant: str, lora_rank: int, wrap: str, reshard: bool, sharding: Sharding
) -> float:
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
    layer = gathered_layer_bytes(model, quant, lora_rank)
    k = wrap_group_size(wrap, model.layers)
    if wrap == "model" or k >= model.layers or not reshard:
        layers = model.layers * layer
    else:
        layers = 2 * k * layer
    if model.tied_embeddings:  # embedding, norm and the tied head live in the root unit
        return embed_unit_bytes(model) + model.hidden * BF16 + layers
    embed = 0.0 if reshard else embed_unit_bytes(model)
    return head_unit_bytes(model) + embed + layers


def root_all_gather_buffer_bytes(
    model: ModelSpec, quant: str, lora_rank: int, wrap: str, sharding: Sharding
) -> float:
    """With `wrap: model` the root unit is every layer, and its first all-gather in forward holds
    the all-gather output buffer beside the unsharded params until the copy-out is done (FSDP2
    `AllGatherState`, `_fsdp_param_group.py`): a second whole-model copy at that moment, while
    activations are still few (FSDPMemTracker at 7B: 12.38 + 12.14 GiB). Smaller units make this
    one unit's worth, inside the prefetch allowance of `gathered_bytes`."""
    if sharding is not Sharding.FSDP2 or wrap != "model":
        return 0.0
    return model.layers * gathered_layer_bytes(model, quant, lora_rank)


def gathered_at_reduce_bytes(model: ModelSpec, wrap: str, sharding: Sharding, device: str,
                             gathered: float) -> float:  # fmt: skip
    """Gathered params while the last gradients are reduced (end of backward). The embedding unit
    is unsharded for its backward, the last to run; every other unit was resharded after its own
    backward. With `model` on CUDA the root reshards before it reduces (FSDPMemTracker at 7B); on
    CPU trials gloo's reduce-scatter path keeps the forward's buffers (measured)."""
    if sharding is not Sharding.FSDP2:
        return 0.0
    if wrap == "model" and device == "cpu":
        return gathered
    return embed_unit_bytes(model)


def unit_grad_bytes(model: ModelSpec, lora_rank: int, wrap: str, sharding: Sharding) -> float:
    """Unsharded gradients of the unit being reduced at the end of its backward: bf16 from
    autograd plus the fp32 copy FSDP2 makes for `reduce_dtype=fp32` (6 B per trainable parameter
    of the unit; the largest unit sets the peak). `model` is one unit of every layer; the
    embedding and `[norm, head]` are units of their own. The plain module and DDP accumulate
    straight into `.grad` (DDP's bucket views): nothing extra.
    Calibrated on CPU trials (docs/accuracy.md)."""
    if sharding is not Sharding.FSDP2:
        return 0.0
    if lora_rank:
        per_layer = model.lora_params(lora_rank) / model.layers
        edges = 0.0
    else:
        per_layer = model.layer_params
        edges = max(model.embedding_params, model.lm_head_params + model.hidden)
    k = max(1, min(wrap_group_size(wrap, model.layers), model.layers))  # `model`: every layer
    return max(k * per_layer, edges) * (BF16 + FP32)


def autocast_copy_bytes(model: ModelSpec, lora_rank: int, autocast: bool) -> float:
    """bf16 copies autocast makes of fp32 trainable weights for its matmuls, cached for the whole
    autocast region and then kept by autograd for backward (torch.amp autocast weight cache): every
    projection and the LM head of a full fine-tune (the embedding lookup is not autocast), or the
    LoRA adapters. Only the plain module and DDP autocast (`autofit.config.uses_autocast`)."""
    if not autocast:
        return 0.0
    if lora_rank:
        return model.lora_params(lora_rank) * BF16
    return (model.linear_params + model.lm_head_params) * BF16


def fp32_residual_bytes_per_token(model: ModelSpec, lora_rank: int, autocast: bool) -> float:
    """Extra bytes per token per layer when the residual stream is fp32: a full fine-tune under
    autocast keeps fp32 embeddings, so each HF RMSNorm saves its fp32 input and fp32 normalised
    output (4h + 4h instead of 4h + 2h), and autocast casts that fp32 output to bf16 once per
    consuming projection (q, k, v after the first norm, gate and up after the second: 5 x 2h saved
    instead of 2 x 2h). 2 x 2h + 3 x 2h = 10h. A LoRA base is bf16, so its stream is bf16."""
    if not autocast or lora_rank:
        return 0.0
    return 10 * model.hidden


def optimizer_temp_bytes(model: ModelSpec, lora_rank: int, precision: str, optimizer: str,
                         device: str, shard: int) -> float:  # fmt: skip
    """Transient tensors of the optimizer step. On CUDA torch AdamW is fused (none); CPU trials run
    the single-tensor AdamW, which allocates two temporaries the size of each (local) parameter in
    turn, so the largest trainable tensor's shard sets them (measured: 2 x the fp32 embedding of
    llama-mini on the plain module)."""
    if device != "cpu":
        return 0.0
    if lora_rank:
        largest = max(max(shape) for shape in model.projection_shapes().values()) * lora_rank
    else:
        largest = model.embedding_params
    return 2 * largest * master_bytes(precision, optimizer) / shard


# ----- activations ------------------------------------------------------------------------------
@lru_cache(maxsize=4096)
def layer_activation_bytes_per_token(model: ModelSpec, lora_rank: int) -> float:
    """Bytes one decoder layer saves for backward per token (no checkpointing).

    Counted tensor by tensor for the HF Llama layer in bf16 (the method of Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", adapted to RMSNorm, SwiGLU,
    GQA and fused SDPA, which saves no s x s scores):
    - 2 RMSNorms: the fp32 upcast input (4h) and the bf16 normalised output (2h) each -> 12h
    - attention: q and k after RoPE, v (SDPA inputs), SDPA output, o_proj input copy
      -> 2q + 2kv + 2kv + 2q + 2q = 6q + 4kv, plus fp32 log-sum-exp per head (4 x heads)
    - SwiGLU MLP: gate, silu(gate), up, and their product (down_proj input) -> 8i
    - LoRA: the rank-r output of each of the 7 lora_A (2r each) -> 14r
    """
    h, q, kv, i = model.hidden, model.q_dim, model.kv_dim, model.intermediate
    lora_a_outputs = len(model.projection_shapes()) * 2 * max(lora_rank, 0)
    return 12 * h + 6 * q + 4 * kv + 4 * model.heads + 8 * i + lora_a_outputs


@lru_cache(maxsize=4096)
def selective_layer_bytes_per_token(model: ModelSpec, lora_rank: int) -> float:
    """Op-level selective checkpointing keeps matmul and attention outputs and recomputes the
    pointwise ops (torch `create_selective_checkpoint_contexts` with a policy that saves every
    mm/SDPA output; torchtitan's op-level SAC saves only every other matmul): the checkpointed
    layer input (2h), the seven projection outputs, the SDPA output and LSE. With LoRA, the rank-r
    lora_A outputs (2r each) are saved; lora_B's r -> d expansions are recomputed unless d < 8r
    (`autofit.recipe.is_low_rank_expansion`, the rule autofit/build/checkpoint.py applies), in
    which case their outputs are saved too."""
    h, q = model.hidden, model.q_dim
    outs = tuple(out for _, out in model.projection_shapes().values())
    lora = 0
    if lora_rank > 0:
        lora = len(outs) * 2 * lora_rank + sum(
            2 * d for d in outs if not recipe.is_low_rank_expansion(lora_rank, d)
        )
    return 2 * h + 2 * sum(outs) + 2 * q + 4 * model.heads + lora


def activation_bytes(model: ModelSpec, cfg_micro_batch: int, seq_len: int, lora_rank: int,
                     checkpointing: str) -> float:  # fmt: skip
    """Saved activations of one micro-batch at the end of forward, plus the one layer being
    recomputed during backward when checkpointing (its full activations are live then)."""
    tokens = cfg_micro_batch * seq_len
    full = layer_activation_bytes_per_token(model, lora_rank)
    ckpt_input = 2 * model.hidden  # a checkpointed layer keeps only its bf16 input
    n = model.layers
    if checkpointing == "full":
        per_token = n * ckpt_input + full
    elif checkpointing == "every-2":
        k = len(recipe.checkpointed_layers(checkpointing, n))
        per_token = k * ckpt_input + (n - k) * full + full
    elif checkpointing == "selective":
        per_token = n * selective_layer_bytes_per_token(model, lora_rank)
    else:
        per_token = n * full
    final_norm = 6 * model.hidden  # fp32 input + bf16 output of the last RMSNorm
    return tokens * (per_token + final_norm)


def int8_saved_weight_bytes(model: ModelSpec, checkpointing: str) -> float:
    """torchao's int8 weight-only linear computes `mm(x, qdata.t().to(bf16)) * scale`
    (torchao `Int8Tensor` linear, per-row path), so autograd saves the bf16 copy of every
    projection weight for the input gradient: 2 B per base weight of every layer whose
    activations are kept (one layer at a time inside checkpointed layers). Measured on CPU trials
    (docs/accuracy.md): without this term int8 runs were under-estimated by 20-28%."""
    return layers_keeping_activations(model, checkpointing) * model.layer_linear_params * BF16


def layers_keeping_activations(model: ModelSpec, checkpointing: str) -> int:
    """Decoder layers whose every saved tensor is alive at once: all without checkpointing, the
    uncheckpointed half plus the one being recomputed with `every-2`, only the one being
    recomputed with `full` or op-level `selective` (which recomputes the pointwise ops). The
    checkpointed layers are `autofit.recipe.checkpointed_layers`, the builder's list."""
    checkpointed = len(recipe.checkpointed_layers(checkpointing, model.layers))
    kept = model.layers - checkpointed + (1 if checkpointed else 0)
    return min(kept, model.layers)


def logits_loss_bytes(model: ModelSpec, micro_batch: int, seq_len: int) -> float:
    """LM head output and cross-entropy over the vocabulary: bf16 logits (2V), their fp32 copy
    (HF `ForCausalLMLoss` upcasts: 4V) and log_softmax's fp32 output saved for backward (4V)
    -> 10 V bytes per token, all live at the end of forward."""
    return micro_batch * seq_len * 10 * model.vocab


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
