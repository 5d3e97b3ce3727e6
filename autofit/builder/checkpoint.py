"""Activation checkpointing of decoder layers: `full`, `every-2`, or `selective` (op-level).

`selective` wraps each layer with a selective-checkpoint context (torch.utils.checkpoint
`create_selective_checkpoint_contexts`) that saves every matmul and attention output and recomputes
the cheap element-wise ops. (torchtitan's op-level SAC saves only every other matmul, trading some
recompute for memory; autofit saves them all.) LoRA's rank-r -> d expansions (lora_B) are
recomputed too (`autofit.recipe.is_low_rank_expansion`, which the estimator counts by), since
storing their full-width outputs would cost as much as the base's.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autofit.builder.model import decoder_layers
from autofit.recipe import is_low_rank_expansion

aten = torch.ops.aten

# Ops whose outputs selective checkpointing keeps (the expensive ones to recompute).
_SAVE_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._grouped_mm.default,  # MoE experts (HF's grouped-mm implementation)
}


def _is_low_rank_expansion(op: Any, args: tuple[Any, ...]) -> bool:
    if op not in (aten.mm.default, aten.addmm.default):
        return False
    a, b = (args[1], args[2]) if op is aten.addmm.default else (args[0], args[1])
    return is_low_rank_expansion(a.shape[-1], b.shape[-1])


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in _SAVE_OPS and not _is_low_rank_expansion(op, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)


def apply_checkpointing(
    model: nn.Module, checkpointed: Sequence[int], selective: bool
) -> nn.Module:
    """Wrap the decoder layers `checkpointed` (`Layout.checkpointed`, of
    `autofit.recipe.checkpointed_layers`) in place, op-level (`selective`: `Layout.selective`) or
    whole."""
    if not checkpointed:
        return model
    layers = decoder_layers(model)
    for i in checkpointed:
        layer = layers[i]
        kwargs: dict[str, Any] = {"preserve_rng_state": False}
        if selective:
            kwargs["context_fn"] = partial(_selective_context)
        layers[i] = checkpoint_wrapper(layer, **kwargs)
    return model
