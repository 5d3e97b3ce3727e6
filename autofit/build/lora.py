"""LoRA (peft) on all attention and MLP projections; the base stays frozen."""

from __future__ import annotations

from torch import nn

from autofit.models import PROJECTIONS


def apply_lora(model: nn.Module, rank: int, alpha: int) -> nn.Module:
    """Wrap `model` with peft LoRA of `rank` and `alpha` on q/k/v/o and gate/up/down projections.

    Runs before quantization and before any weight exists (on the meta model of a trial):
    peft puts the adapters on the base weight's device, the builder materialises and initialises
    them layer by layer (A kaiming-uniform, B zero, as peft does), and quantization then replaces
    each wrapped projection's `base_layer.weight`, as QLoRA recipes (torchtune, answer.ai) do.
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
