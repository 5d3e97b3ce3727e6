"""Frozen base weights stored in NF4 (`to_nf4`) or int8 weight-only (torchao), layer by layer.

Quantizing one decoder layer at a time (materialise it from meta, quantize, shard, move on: the
builder in `apply.py`) keeps the transient full-precision copy to one layer, so a 70B base never
needs its bf16 size anywhere. The projections may already be wrapped by peft LoRA: then the
weight quantized is the wrapped `base_layer`'s.
NF4 weights shard under FSDP2 on any number of ranks (`autofit.builder.nf4`); torchao's
`Int8Tensor` cannot (no `aten.split`), so `autofit.builder.fsdp.unshardable_params` lists them for
`fully_shard`'s `ignored_params`: they stay replicated on every GPU, as Accelerate does for
bitsandbytes weights.
With `quant_backend: bitsandbytes` (`Layout.bnb`) an NF4 projection is replaced by a bitsandbytes
`Linear4bit` instead (HF Trainer's QLoRA: `BitsAndBytesConfig`), quantized where it is
materialised: the plain module only (`autofit.rules`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

import autofit.recipe as recipe
from autofit.builder.dtypes import TORCH_DTYPES
from autofit.builder.model import decoder_projections, materialize
from autofit.values import Quant

_FROZEN = TORCH_DTYPES[recipe.FROZEN_DTYPE]  # what a base weight is quantized from


def quantize_layer(
    layer: nn.Module,
    quant: str | None,
    quantized: Collection[str],
    device: torch.device | None = None,
    shards: int = 1,
    bnb: recipe.Bnb4bit | None = None,
) -> nn.Module:
    """Store the projections `quantized` of one decoder layer (paths inside it,
    `Layout.quantized`: every `decoder_projections` one, the set the estimator counts) as `quant`
    (`Layout.quant`; None: leave them), in place, one projection at a time: a projection still on
    meta is materialised (on `device`) just before it is quantized, so the transient
    full-precision copy is one weight, not the layer. `shards`: the ranks FSDP2 will shard each
    weight over (the mesh's `dp_shard` size; 1 when nothing shards it), which NF4's blocks are
    sized for (`autofit.builder.nf4.nf4_block_sizes`). `bnb` (`Layout.bnb`): NF4 by
    bitsandbytes, each projection replaced by a `Linear4bit` (peft's `base_layer` where LoRA
    wraps it)."""
    if quant not in (None, Quant.NF4, Quant.INT8):
        raise ValueError(f"unknown quant {quant!r}")
    if quant is None:
        return layer
    parents = {
        id(m): (parent, attr) for parent in layer.modules() for attr, m in parent.named_children()
    }
    for name, mod in decoder_projections(layer):
        if name not in quantized:
            continue
        if mod.weight.is_meta:
            materialize(mod, device or torch.device("cpu"), prefix=name)
        if quant == Quant.NF4 and bnb is not None:
            parent, attr = parents[id(mod)]
            setattr(parent, attr, _to_bnb_nf4(mod, bnb))
        elif quant == Quant.NF4:
            _to_nf4(mod, shards)
        else:
            _to_int8(mod)
    return layer


def _to_nf4(linear: nn.Linear, shards: int) -> None:
    from autofit.builder.nf4 import to_shardable_nf4

    weight = linear.weight.detach().to(_FROZEN)
    linear.weight = nn.Parameter(to_shardable_nf4(weight, shards), requires_grad=False)


BNB_STORAGE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, torch_name) for name, torch_name in recipe.TORCH_NAMES.items()
}
"""`recipe.BNB_QUANT_STORAGE`'s names as torch dtypes (`recipe.TORCH_NAMES`)."""


def _to_bnb_nf4(linear: nn.Linear, bnb: recipe.Bnb4bit) -> nn.Module:
    """`linear` as a bitsandbytes `Linear4bit` of its weight in NF4 (blocks of
    `recipe.NF4_BLOCK`, bf16 compute), quantized on the weight's device; its bias kept."""
    try:
        import bitsandbytes as bnb_lib
    except ImportError:
        from autofit.errors import ConfigError

        raise ConfigError(
            "quant_backend=bitsandbytes needs bitsandbytes: pip install 'autofit[bnb]' (or use "
            "quant_backend=torchao, the default)."
        ) from None
    storage = BNB_STORAGE_DTYPES[bnb.quant_storage]
    out = bnb_lib.nn.Linear4bit(
        linear.in_features, linear.out_features, bias=linear.bias is not None,
        compute_dtype=TORCH_DTYPES[recipe.COMPUTE_DTYPE], compress_statistics=bnb.double_quant,
        quant_type="nf4", quant_storage=storage, device="meta",
    )  # fmt: skip
    weight = linear.weight.detach().to(_FROZEN)
    out.weight = bnb_lib.nn.Params4bit(
        weight, requires_grad=False, blocksize=recipe.NF4_BLOCK,
        compress_statistics=bnb.double_quant, quant_type="nf4", quant_storage=storage,
    ).to(weight.device)  # quantized here  # fmt: skip
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach().to(_FROZEN), requires_grad=False)
    return out


def _to_int8(linear: nn.Linear) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    linear.weight.data = linear.weight.data.to(_FROZEN)
    config = Int8WeightOnlyConfig(set_inductor_config=False)
    quantize_(linear, config, filter_fn=lambda mod, _fqn: mod is linear)
    linear.weight.requires_grad_(False)
