"""The model at its real size with random weights, never materialised full-size on the host.

`build_meta_model` creates the family's HF causal LM (`AutoModelForCausalLM.from_config`) on the
meta device (no memory). The builder then
casts dtypes, adds LoRA and checkpointing on meta, and `materialize` gives modules real (empty)
storage on the target device with `to_empty` and initialises them: a quantized decoder layer just
before it is quantized and sharded, everything else after `fully_shard`, so each rank only ever
allocates its own shards plus one layer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autofit.models import ModelSpec

INIT_STD = 0.02  # HF `initializer_range` of every supported family


def build_meta_model(spec: ModelSpec, hf_config: Any = None) -> nn.Module:
    """The family's HF causal LM for `spec` (`AutoModelForCausalLM.from_config`) on the meta
    device, fp32 until the builder casts it. Attention and MoE experts are the implementations HF
    picks for the family by default (SDPA; eager for Gemma 2, whose soft-capping SDPA lacks;
    grouped-mm experts), which is what a user's `from_pretrained` runs. `hf_config`: a config of
    the same architecture to build instead (the one-layer trace builds fewer layers)."""
    from transformers import AutoModelForCausalLM

    config = hf_config if hf_config is not None else spec.to_hf_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model


def layer_types(spec: ModelSpec) -> list[str] | None:
    """The type of each layer (sliding or full attention) where the family has several."""
    types = getattr(spec.to_hf_config(), "layer_types", None)
    return list(types) if types and len(set(types)) > 1 else None


def build_layers_model(spec: ModelSpec, kinds: tuple[Any, ...]) -> nn.Module:
    """`spec`'s model on the meta device with one decoder layer per entry of `kinds` (a layer
    type of `layer_types`, or None where the family has one), whatever its real layer count: what
    the one-layer traces run and the structure is read from, in a time that does not grow with
    the layers."""
    overrides: dict[str, Any] = {"num_hidden_layers": len(kinds)}
    if kinds[0] is not None:
        overrides["layer_types"] = list(kinds)
    return build_meta_model(spec, spec.to_hf_config(**overrides))


def decoder_projections(layer: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear projections of one decoder layer, by their path inside it (`self_attn.q_proj`,
    `mlp.gate_up_proj`): every `nn.Linear` of the block, peft's `all-linear` rule. What LoRA
    targets and quantization touches, and what the estimator counts as projections
    (`autofit.builder.structure`). Under peft the frozen `base_layer` is returned under the
    wrapped module's name; the adapters themselves are not projections."""
    found: list[tuple[str, nn.Linear]] = []
    for name, mod in layer.named_modules():
        parts = name.split(".")
        if not isinstance(mod, nn.Linear) or not name:
            continue
        if any(p in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B") for p in parts):
            continue
        if parts[-1] == "base_layer":
            name = ".".join(parts[:-1])
        found.append((_logical(name), mod))
    return found


def layer_projections(model: nn.Module) -> tuple[str, ...]:
    """The paths of the decoder layers' projections (`decoder_projections` of every layer, each
    path once, in order: a model whose layers differ, dense and MoE layers mixed, has them all):
    what `autofit.layout.Layout` resolves the quantized and adapted ones from."""
    found = (name for layer in decoder_layers(model) for name, _ in decoder_projections(layer))
    return tuple(dict.fromkeys(found))


def _logical(name: str) -> str:
    """A module path without the wrappers the builder adds (activation checkpointing's)."""
    return ".".join(p for p in name.split(".") if p != "_checkpoint_wrapped_module")


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(
    module: nn.Module,
    device: torch.device,
    *,
    prefix: str = "",
    param_device: torch.device | None = None,
) -> nn.Module:
    """Give every submodule still on meta real storage on `device` (`to_empty`) and initialise it
    as HF does for every supported family (normal(0.02) matrices, zero biases, norms at their
    family's neutral value, LoRA A kaiming / B zero, rotary frequencies recomputed). Modules
    already materialised (quantized layers, say) are left as they are, and after `fully_shard`
    `to_empty` allocates only this rank's shards. `prefix` is the module's name in its model, so
    a LoRA adapter is recognised by its path. A parameter two modules share (a tied LM head) is
    materialised once, by the first, and the second is given that same parameter: `to_empty` on
    each module would untie them.

    `param_device`: where parameters go when not `device` (the host, for parameters FSDP2
    offloads: `CPUOffloadPolicy` wants them there when it first runs, and only moves those that
    were real when `fully_shard` ran); buffers always go to `device`, as torchtitan materialises
    an offloaded model (`to_empty(device="cpu")`, buffers on `buffer_device`)."""
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta original) -> (it, real)
    for name, mod in module.named_modules(prefix=prefix):
        for pname, param in list(mod._parameters.items()):
            if param is not None and id(param) in made:
                mod._parameters[pname] = made[id(param)][1]
        own = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            on_meta = {n: p for n, p in mod._parameters.items() if p is not None and p.is_meta}
            on_meta_buffers = [n for n, b in mod._buffers.items() if b is not None and b.is_meta]
            mod.to_empty(device=param_device or device, recurse=False)
            for bname in on_meta_buffers if param_device not in (None, device) else ():
                mod._buffers[bname] = torch.empty_like(mod._buffers[bname], device=device)
            for pname, original in on_meta.items():
                made[id(original)] = (original, mod._parameters[pname])  # type: ignore[assignment]
            _init_module(name, mod)
    return module


@torch.no_grad()
def _init_module(name: str, mod: nn.Module) -> None:
    parts = name.split(".")
    if any("inv_freq" in b for b, _ in mod.named_buffers(recurse=False)):
        _init_rope(mod)
        return
    lora = "lora_A" in parts[-2:] or "lora_B" in parts[-2:]
    for pname, param in mod.named_parameters(recurse=False):
        if not param.is_floating_point():
            continue
        if lora:
            if "lora_A" in parts[-2:]:
                nn.init.kaiming_uniform_(param, a=math.sqrt(5))
            else:
                nn.init.zeros_(param)
        elif pname == "bias":
            nn.init.zeros_(param)
        elif param.dim() >= 2:  # linears, embeddings, MoE experts and routers
            nn.init.normal_(param, mean=0.0, std=INIT_STD)
        else:  # a norm's scale: 1, or 0 where the family computes (1 + weight) (Gemma)
            nn.init.constant_(param, _norm_neutral(type(mod), param.shape[0]))
    for bname, buf in mod.named_buffers(recurse=False):
        # a constant kept as a buffer beside the float HF initialises it from (Gemma 2/3's
        # embedding scale, sqrt(hidden): `embed_scale` and `scalar_embed_scale`); `to_empty`
        # leaves it uninitialised memory otherwise
        value = getattr(mod, f"scalar_{bname}", None)
        if isinstance(value, int | float) and buf.is_floating_point():
            nn.init.constant_(buf, value)


@functools.lru_cache(maxsize=64)
def _norm_neutral(cls: type, dim: int) -> float:
    """The value a norm class initialises its scale to, read from a small instance of it built
    on the CPU outside any dispatch mode: under the trace's FakeTensorMode the value cannot be
    read, and the fallback, cached, gave every later real Gemma model norms of (1 + 1)."""
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes(), torch.device("cpu"):
            fresh = cls(dim)
            return float(next(fresh.parameters()).reshape(-1)[0])
    except (TypeError, AttributeError):  # it wants more than its width (a config, say): HF's
        return 1.0  # common neutral scale; any other failure is a real error and surfaces


def _init_rope(mod: nn.Module) -> None:
    """Rotary frequencies (`inv_freq`, per layer type in Gemma 3) from a fresh instance of the
    module on the CPU, built from the same config."""
    fresh = type(mod)(mod.config)
    for bname, buf in fresh.named_buffers(recurse=False):
        getattr(mod, bname).copy_(buf.to(getattr(mod, bname).device))
    for attr, value in vars(fresh).items():
        if "scaling" in attr:  # attention_scaling (a float per layer type in Gemma 3)
            setattr(mod, attr, value)


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
    tied = head is not None and frozen_weight(head) is frozen_weight(embed)
    return ModelParts(embed=embed, layers=layers, norm=norm, head=head, tied=tied)


def frozen_weight(module: nn.Module) -> nn.Parameter:
    """The weight of the embedding or LM head the model was given: under peft's wrappers that
    `train_embeddings` adds (`ModulesToSaveWrapper`, `TrainableTokensWrapper`), the frozen
    original's (their `.weight` is the trainable copy, or a merged tensor made at each call)."""
    return getattr(module, "original_module", module).weight


def trainable_copy(module: nn.Module) -> nn.Module | None:
    """The trainable copy peft's `modules_to_save` keeps beside the frozen original (the module
    the wrapper's forward calls), or None for any other module."""
    copies = getattr(module, "modules_to_save", None)
    if not isinstance(copies, nn.ModuleDict) or not hasattr(module, "original_module"):
        return None
    active = getattr(module, "active_adapters", None) or list(copies)
    return copies[active[0]] if active and active[0] in copies else None


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
