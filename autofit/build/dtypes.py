"""Which dtype each kind of parameter is stored in, decided once for the builder and FSDP2."""

from __future__ import annotations

import torch

from autofit.config import Config, Sharding, fp32_trainable, uses_autocast


def train_dtype(config: Config) -> torch.dtype:
    """Trainable (master) params: fp32 or bf16 per `autofit.config.fp32_trainable` (bf16-mixed, or a
    torchao low-bit AdamW), compute in bf16 either way."""
    return torch.float32 if fp32_trainable(config.precision, config.optimizer) else torch.bfloat16


def base_dtype(config: Config) -> torch.dtype:
    """Frozen LoRA base: bf16 (before any quantization); a full fine-tune has no frozen base."""
    return torch.bfloat16 if config.is_lora else train_dtype(config)


def autocast_dtype(config: Config, sharding: Sharding) -> torch.dtype | None:
    """bf16 where `autofit.config.uses_autocast` says the run autocasts, else None."""
    return torch.bfloat16 if uses_autocast(config.precision, config.optimizer, sharding) else None
