"""The builder: a config applied to a model in the order it must happen.

dtypes, quantize, LoRA, checkpoint, shard: the trial builds its random-weight model with exactly
these steps, and `autofit.apply` runs them on a user's model, so a user's run is what was measured.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autofit.config import Config
from autofit.models import ModelSpec
from autofit.trial.build import build_meta_model, has_meta, init_weights, materialize
from autofit.trial.checkpoint import apply_checkpointing
from autofit.trial.dtypes import base_dtype, train_dtype
from autofit.trial.fsdp import apply_fsdp, make_mesh
from autofit.trial.lora import apply_lora
from autofit.trial.quantize import quantize_base


def cast_base(model: nn.Module, config: Config) -> None:
    """Before LoRA: a LoRA base is frozen bf16; a full fine-tune is all in the train dtype."""
    dtype = base_dtype(config)
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
        p.requires_grad_(not config.is_lora)


def cast_trainable(model: nn.Module, config: Config) -> None:
    """After LoRA: adapters in the train dtype (peft creates them in the base weight's dtype)."""
    dtype = train_dtype(config)
    for p in model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)


def parallelize(model: nn.Module, config: Config, mesh: DeviceMesh | None) -> nn.Module:
    """dtypes, quantize (already materialised weights), LoRA, checkpoint, then FSDP2."""
    model = apply_lora(model, config.lora_rank, config.alpha)
    cast_trainable(model, config)
    apply_checkpointing(model, config.checkpointing)
    if mesh is not None:
        apply_fsdp(model, config, mesh)
    return model


def apply(model: nn.Module, config: Config, *, mesh: DeviceMesh | None = None) -> nn.Module:
    """Apply `config` to a user's model: quantize, LoRA, checkpointing, FSDP2, as trials do.

    `mesh`: the FSDP2 device mesh; when None and torch.distributed is initialised, one is made
    over all ranks (per `config.wrap`); without a process group the model is not sharded.
    Returns the model to train (a peft model when `lora_rank > 0`). Build the optimizer over its
    parameters that require grad.
    """
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False  # a KV cache changes state between forward and recompute
    cast_base(model, config)
    device = next(model.parameters()).device
    quantize_base(model, config.quant, device)
    if mesh is None and dist.is_available() and dist.is_initialized():
        device_type = "cuda" if device.type == "cuda" else "cpu"
        mesh = make_mesh(device_type, dist.get_world_size(), config.wrap)
    return parallelize(model, config, mesh)


def build_for_trial(
    spec: ModelSpec, config: Config, device: torch.device, mesh: DeviceMesh
) -> nn.Module:
    """The trial's model: meta build, then the same steps as `apply`, then materialise shards.

    Without quantization nothing is allocated until after `fully_shard`, so each rank allocates
    only its shards. With quantization, each decoder layer is materialised and quantized in turn
    (the base must hold real values to be quantized), then sharded.
    """
    model = build_meta_model(spec)
    cast_base(model, config)
    if config.quant != "none":
        quantize_base(model, config.quant, device)
        materialize_rest(model, device)
    model = parallelize(model, config, mesh)
    if has_meta(model):
        materialize(model, device)
    return model


def materialize_rest(model: nn.Module, device: torch.device) -> None:
    """Materialise the modules still on meta (embeddings, norms, head, rotary)."""
    for mod in model.modules():
        own = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            mod.to_empty(device=device, recurse=False)
            init_weights(mod)
