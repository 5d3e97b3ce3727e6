"""Bytes per parameter of each stored copy (weights by quantization, masters, gradients, optimizer
state) and the parameter groups they apply to.
"""

from __future__ import annotations

import autofit.recipe as recipe
from autofit.structure import TRL_LOSS, Structure
from autofit.values import Launch, Loss, Optimizer, Quant

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
    if quant == Quant.NF4:
        return recipe.nf4_bytes_per_param()
    if quant == Quant.INT8:
        return 1.0
    return float(recipe.DTYPE_BYTES[recipe.FROZEN_DTYPE])


def bnb_nf4_weight_bytes(
    out_features: int, in_features: int, double_quant: bool = False, quant_storage: str = "uint8"
) -> int:
    """Bytes bitsandbytes stores for one NF4 weight of shape (`out_features`, `in_features`):
    the packed codes in `quant_storage`, the fp32 absmax per 64-weight block (double quantization:
    uint8 codes, an fp32 absmax per 256 of them, their offset and code map) and the NF4 levels;
    `autofit.recipe.bnb_nf4_bytes` reads the layout from bitsandbytes 0.50's `quantize_4bit`."""
    return recipe.bnb_nf4_bytes(out_features * in_features, double_quant, quant_storage)


def master_bytes(precision: str, optimizer: str = Optimizer.ADAMW) -> int:
    """Bytes per trainable parameter: fp32 master weights under bf16-mixed (FSDP2
    `MixedPrecisionPolicy(param_dtype=bf16)` keeps the sharded originals in fp32; the plain module
    and DDP keep fp32 params under bf16 autocast), else bf16; the rule is
    `autofit.recipe.trainable_dtype`, which the builder reads too."""
    return recipe.DTYPE_BYTES[recipe.trainable_dtype(precision, optimizer)]


def grad_bytes(precision: str, optimizer: str = Optimizer.ADAMW) -> int:
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


def base_weight_bytes(s: Structure, quant: str, bnb: recipe.Bnb4bit | None = None) -> float:
    """All frozen projection weights of a LoRA run at their storage width (unsharded); with
    `bnb` (NF4 by bitsandbytes) each weight's exact `recipe.bnb_nf4_bytes`."""
    if quant == Quant.NF4 and bnb is not None:
        return float(s.layers * sum(bnb.weight_bytes(p.weight_params) for p in s.projections))
    total = s.linear_params * base_bytes_per_param(quant)
    if quant == Quant.INT8:
        rows = sum(p.out_features for p in s.projections)
        total += s.layers * rows * BF16
    return total


def frozen_other_bytes(s: Structure, kbit: bool = False) -> int:
    """Everything but the projections in a LoRA run (embedding, head, norms, biases, MoE router
    and experts): frozen, bf16, never quantized; fp32 under `kbit` (`kbit_prepared`: peft's
    `prepare_model_for_kbit_training` upcasts every fp16/bf16 parameter but the NF4 ones)."""
    return (s.root_params + s.layers * s.layer_frozen_other_params) * (FP32 if kbit else BF16)


def kbit_prepared(quant: str, bnb: recipe.Bnb4bit | None, launch: str) -> bool:
    """Whether the model is bitsandbytes QLoRA as a Trainer script prepares it: `launch: trainer`
    with NF4 by bitsandbytes (`autofit.builder.trainer.trainer_model`), after peft 0.21's
    `prepare_model_for_kbit_training`, which upcasts every non-NF4 parameter to fp32 (so the
    embedding output, the norms and the residual stream are fp32; `ActivationKey.kbit`).
    autofit's own launch runs bitsandbytes NF4 without it."""
    return launch == Launch.TRAINER and quant == Quant.NF4 and bnb is not None


def traced_loss(loss: str, launch: str = Launch.AUTOFIT) -> str:
    """The loss a trace runs for the `loss` knob: Liger's kernel (`fused`, CUDA only, so never
    traced) is counted as `chunked`, the same computation in pure torch: Liger's chunk rule and
    hidden-state gradient, with its chunk's logits held in bf16 and overwritten by their gradient
    in place where `chunked` has fp32 copies, so the count is an upper bound of a few chunk-sized
    tensors (Liger `fused_linear_cross_entropy_forward`). Under `launch: trl` the loss is TRL's
    fused LM head whatever the knob (`TRL_LOSS`; the rules keep the knob at `standard`)."""
    if launch == Launch.TRL:
        return TRL_LOSS
    return Loss.CHUNKED if loss == Loss.FUSED else loss
