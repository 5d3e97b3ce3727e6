"""Which dtype each kind of parameter is stored in, decided once for the builder and FSDP2."""

from __future__ import annotations

import torch

from autofit.config import Config


def train_dtype(config: Config) -> torch.dtype:
    """Trainable (master) params: fp32 under bf16-mixed, bf16 under pure bf16.

    Exception: torchao's low-bit AdamW (8-bit, 4-bit) under FSDP2 fails on bf16 params (its
    compiled step hits `lerp`/`view(dtype)` on the quantized state with bf16), and works with fp32
    master params; so with `optimizer=adamw8bit|adamw4bit` trainable params stay fp32 even under
    `precision=bf16` (compute is still bf16 through FSDP2's MixedPrecisionPolicy).
    """
    if config.precision == "bf16-mixed" or config.optimizer != "adamw":
        return torch.float32
    return torch.bfloat16


def base_dtype(config: Config) -> torch.dtype:
    """Frozen LoRA base: bf16 (before any quantization); a full fine-tune has no frozen base."""
    return torch.bfloat16 if config.is_lora else train_dtype(config)
