"""LoRA (peft) on the decoder layers' linear projections; the base stays frozen."""

from __future__ import annotations

from torch import nn

from autofit.build.model import decoder_layers, decoder_projections


def lora_target_modules(model: nn.Module, targets: tuple[str, ...] | None) -> list[str]:
    """The full module names LoRA adapts: each decoder layer's projections
    (`decoder_projections`, the rule the estimator counts by), all of them or those `targets`
    names by leaf (`q_proj`) or by path inside the layer (`self_attn.q_proj`)."""
    prefix = next(name for name, mod in model.named_modules() if mod is decoder_layers(model))
    names, seen = [], set()
    for i, layer in enumerate(decoder_layers(model)):
        for name, _ in decoder_projections(layer):
            leaf = name.rsplit(".", 1)[-1]
            seen.add(leaf)
            if targets is None or leaf in targets or name in targets:
                names.append(f"{prefix}.{i}.{name}")
    if not names:
        raise ValueError(
            f"lora_targets {list(targets or ())} names none of this model's projections; its "
            f"decoder layers have: {', '.join(sorted(seen))}."
        )
    return names


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: int,
    targets: tuple[str, ...] | None = None,
    dropout: float = 0.0,
) -> nn.Module:
    """Wrap `model` with peft LoRA of `rank` and `alpha` on the projections `targets` names
    (None: every linear projection of the decoder layers, any family), with `dropout` on each
    adapter's input (peft keeps the dropped-out copy for backward).

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
        lora_dropout=dropout,
        target_modules=lora_target_modules(model, targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora_config)
