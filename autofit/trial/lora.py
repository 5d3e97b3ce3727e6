"""LoRA (peft) on all attention and MLP projections; the base stays frozen."""

from __future__ import annotations

from torch import nn

from autofit.trial.quantize import PROJECTIONS


def apply_lora(model: nn.Module, rank: int, alpha: int) -> nn.Module:
    """Wrap `model` with peft LoRA of `rank` and `alpha` on q/k/v/o and gate/up/down projections.

    Works on a meta-device model too: peft puts the adapters on the base weight's device, and the
    builder initialises them after `to_empty` (A kaiming-uniform, B zero, as peft does).
    """
    if rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    lora_config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=list(PROJECTIONS),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora_config)
