"""The model at its real size with random weights, never materialised full-size on the host.

`build_meta_model` creates HF `LlamaForCausalLM` on the meta device (no memory). The builder then
casts dtypes on meta, and `materialize` gives a module real (empty) storage on the target device
with `to_empty` and initialises it. With FSDP2 this runs after `fully_shard`, so each rank only
ever allocates its own shards.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from autofit.models import ModelSpec

INIT_STD = 0.02  # HF Llama `initializer_range`


def build_meta_model(spec: ModelSpec) -> nn.Module:
    """`LlamaForCausalLM` for `spec` on the meta device (fp32 until the builder casts it)."""
    from transformers import LlamaForCausalLM

    hf_config = spec.to_hf_config()
    hf_config._attn_implementation = "sdpa"
    hf_config.use_cache = False
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config)
    return model


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """`to_empty` on `device`, then initialise (normal(0.02) linears and embeddings, unit norms,
    LoRA A kaiming / B zero, RoPE frequencies recomputed)."""
    module.to_empty(device=device)
    init_weights(module)
    return module


@torch.no_grad()
def init_weights(module: nn.Module) -> None:
    for name, mod in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if hasattr(mod, "inv_freq") and hasattr(mod, "compute_default_rope_parameters"):
            _init_rope(mod)
            continue
        weight = getattr(mod, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            continue
        if parent == "lora_A" or leaf == "lora_A":
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        elif parent == "lora_B" or leaf == "lora_B":
            nn.init.zeros_(weight)
        elif isinstance(mod, nn.Linear | nn.Embedding):
            nn.init.normal_(weight, mean=0.0, std=INIT_STD)
        elif "norm" in type(mod).__name__.lower():
            nn.init.ones_(weight)


def _init_rope(mod: nn.Module) -> None:
    inv_freq, scaling = mod.compute_default_rope_parameters(mod.config)
    mod.inv_freq.copy_(inv_freq.to(mod.inv_freq.device))
    if hasattr(mod, "original_inv_freq"):
        mod.original_inv_freq.copy_(inv_freq.to(mod.original_inv_freq.device))
    mod.attention_scaling = scaling


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The `ModuleList` of decoder layers of a HF causal LM (also under a peft wrapper)."""
    best: nn.ModuleList | None = None
    for name, mod in model.named_modules():
        is_layers = isinstance(mod, nn.ModuleList) and name.endswith("layers") and len(mod) > 0
        if is_layers and (best is None or len(mod) > len(best)):
            best = mod
    if best is None:
        raise ValueError(
            f"Cannot find the decoder layers of {type(model).__name__}: autofit expects a HF "
            "causal LM with a `layers` ModuleList (Llama, Mistral, Qwen2 and relatives)."
        )
    return best
