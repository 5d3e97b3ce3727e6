"""Which dtype each kind of parameter is stored in, decided once for the builder and FSDP2.

The rules are `autofit.recipe`'s (the estimator counts bytes from the same names); this module only
maps them to torch dtypes.
"""

from __future__ import annotations

import torch

import autofit.recipe as recipe
from autofit.config import Config

TORCH_DTYPES: dict[str, torch.dtype] = {recipe.BF16: torch.bfloat16, recipe.FP32: torch.float32}


def train_dtype(config: Config) -> torch.dtype:
    """Trainable (master) params: fp32 or bf16 per `autofit.recipe.trainable_dtype` (bf16-mixed,
    or a torchao low-bit AdamW), compute in bf16 either way."""
    return TORCH_DTYPES[recipe.trainable_dtype(config.precision, config.optimizer)]


def base_dtype(config: Config) -> torch.dtype:
    """Frozen LoRA base: `autofit.recipe.FROZEN_DTYPE` (bf16, before any quantization); a full
    fine-tune has no frozen base."""
    return TORCH_DTYPES[recipe.FROZEN_DTYPE] if config.is_lora else train_dtype(config)


def compute_dtype() -> torch.dtype:
    """Matmuls in bf16 (`autofit.recipe.COMPUTE_DTYPE`): autocast's and FSDP2's `param_dtype`."""
    return TORCH_DTYPES[recipe.COMPUTE_DTYPE]


def reduce_dtype(config: Config) -> torch.dtype:
    """Gradient reduction: fp32 under bf16-mixed, else bf16 (`autofit.recipe.reduce_dtype`)."""
    return TORCH_DTYPES[recipe.reduce_dtype(config.precision)]
