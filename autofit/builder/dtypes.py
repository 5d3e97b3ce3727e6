"""The dtypes by name (`autofit.recipe`'s, resolved per run into `autofit.layout.Layout`: the
estimator counts bytes from the same names) as torch dtypes.
"""

from __future__ import annotations

import torch

import autofit.recipe as recipe

TORCH_DTYPES: dict[str, torch.dtype] = {recipe.BF16: torch.bfloat16, recipe.FP32: torch.float32}


def compute_dtype() -> torch.dtype:
    """Matmuls in bf16 (`autofit.recipe.COMPUTE_DTYPE`): autocast's and FSDP2's `param_dtype`."""
    return TORCH_DTYPES[recipe.COMPUTE_DTYPE]
