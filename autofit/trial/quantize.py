"""Frozen base weights stored in NF4 (`to_nf4`) or int8 weight-only (torchao), layer by layer.

Quantizing one decoder layer at a time (materialise it from meta, quantize, move on) keeps the
transient full-precision copy to one layer, so a 70B base never needs its bf16 size anywhere.
NF4 weights shard under FSDP2 (NF4Tensor implements the FSDP2 all-gather extension); torchao's
`Int8Tensor` cannot (no `aten.split`), so `int8_params` lists them for `fully_shard`'s
`ignored_params`: they stay replicated on every GPU, as Accelerate does for bitsandbytes weights.
"""

from __future__ import annotations

import torch
from torch import nn

from autofit.trial.build import decoder_layers, has_meta, materialize

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_projection(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS


def quantize_base(model: nn.Module, quant: str, device: torch.device | None = None) -> nn.Module:
    """Quantize the attention and MLP projection weights of every decoder layer in place."""
    if quant == "none":
        return model
    for layer in decoder_layers(model):
        if has_meta(layer):
            materialize(layer, device or torch.device("cpu"))
        if quant == "nf4":
            _to_nf4(layer)
        elif quant == "int8":
            _to_int8(layer)
        else:
            raise ValueError(f"unknown quant {quant!r}")
    return model


def _to_nf4(layer: nn.Module) -> None:
    from torchao.quantization import to_nf4

    for name, mod in layer.named_modules():
        if is_projection(mod, name):
            weight = mod.weight.detach().to(torch.bfloat16)
            nf4 = to_nf4(weight, NF4_BLOCK, nf4_scaler_block(weight.numel(), _world_size()))
            mod.weight = nn.Parameter(nf4, requires_grad=False)


NF4_BLOCK = 64  # QLoRA's block of 64 weights per absmax scale (torchao's default)


def nf4_scaler_block(numel: int, shards: int = 1, preferred: int = 256) -> int:
    """torchao's default of 256 scales per double-quantization block, halved until it divides
    the number of scales into a number of blocks FSDP2 can split over `shards` ranks (real models
    keep 256; small test shapes such as llama-debug's 256 x 688 on 2 ranks need 32)."""
    scalers = numel // NF4_BLOCK
    block = preferred
    while block > 1 and (scalers % block or (scalers // block) % shards):
        block //= 2
    return block


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _to_int8(layer: nn.Module) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    for mod in layer.modules():
        if isinstance(mod, nn.Linear):
            mod.weight.data = mod.weight.data.to(torch.bfloat16)
    quantize_(layer, Int8WeightOnlyConfig(set_inductor_config=False), filter_fn=is_projection)
    for name, mod in layer.named_modules():
        if is_projection(mod, name):
            mod.weight.requires_grad_(False)


def int8_params(model: nn.Module) -> set[nn.Parameter]:
    """Parameters held as torchao `Int8Tensor`: FSDP2 cannot shard them (no `aten.split`)."""
    return {p for p in model.parameters() if type(p.data).__name__ == "Int8Tensor"}
