"""The model at its real size with random weights, never materialised full-size on the host.

`build_meta_model` creates HF `LlamaForCausalLM` on the meta device (no memory). The builder then
casts dtypes, adds LoRA and checkpointing on meta, and `materialize` gives modules real (empty)
storage on the target device with `to_empty` and initialises them: a quantized decoder layer just
before it is quantized and sharded, everything else after `fully_shard`, so each rank only ever
allocates its own shards plus one layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def materialize(module: nn.Module, device: torch.device, *, prefix: str = "") -> nn.Module:
    """Give every submodule still on meta real storage on `device` (`to_empty`) and initialise it
    (normal(0.02) linears and embeddings, unit norms, LoRA A kaiming / B zero, RoPE frequencies
    recomputed). Modules already materialised (quantized layers, say) are left as they are, and
    after `fully_shard` `to_empty` allocates only this rank's shards. `prefix` is the module's
    name in its model, so a LoRA adapter is recognised by its path."""
    for name, mod in module.named_modules(prefix=prefix):
        own = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            mod.to_empty(device=device, recurse=False)
            _init_module(name, mod)
    return module


@torch.no_grad()
def _init_module(name: str, mod: nn.Module) -> None:
    parts = name.split(".")
    if hasattr(mod, "inv_freq") and hasattr(mod, "compute_default_rope_parameters"):
        _init_rope(mod)
        return
    weight = getattr(mod, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return
    if "lora_A" in parts[-2:]:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    elif "lora_B" in parts[-2:]:
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


@dataclass
class ModelParts:
    """The pieces of a HF causal LM that the builder treats apart (torchtitan's layout)."""

    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module | None
    head: nn.Module | None
    tied: bool  # the LM head shares the embedding's weight


def model_parts(model: nn.Module) -> ModelParts:
    """Token embeddings, decoder layers, final norm and LM head (also under a peft wrapper)."""
    layers = decoder_layers(model)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    norm = None
    for mod in model.modules():
        if getattr(mod, "layers", None) is layers:
            norm = getattr(mod, "norm", None)
            break
    tied = head is not None and head.weight is embed.weight
    return ModelParts(embed=embed, layers=layers, norm=norm, head=head, tied=tied)


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
