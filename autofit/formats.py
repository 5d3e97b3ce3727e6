"""Storage formats of frozen base weights: the facts the builder and the estimator both read.

Plain data, no torch: the estimator imports this, and so do the quantizers in `autofit.build`.
"""

from __future__ import annotations

NF4_BLOCK = 64
"""Weights per absmax scale: QLoRA's block of 64 (Dettmers et al. 2023; torchao `to_nf4`)."""

NF4_SCALER_BLOCK = 256
"""int8 scales per double-quantization block (torchao `to_nf4` default)."""


def nf4_bytes_per_param(block: int = NF4_BLOCK, scaler_block: int = NF4_SCALER_BLOCK) -> float:
    """torchao `NF4Tensor`: 4-bit codes (0.5 B), one int8 scale per `block` weights, and one
    quantization factor in the weight's dtype (bf16, 2 B) per `block x scaler_block` weights."""
    return 0.5 + 1 / block + 2 / (block * scaler_block)


NF4_QUANTIZE_CHUNK = 1024**2
"""torchao quantizes to NF4 in chunks of this many weights (`nf4_tensor.CHUNK_SIZE`); each chunk
briefly holds its distance to all 16 NF4 levels in the weight's dtype (~32 B per weight)."""
