"""FSDP2: `fully_shard` each unit of `wrap_units(config.wrap)`, then the root.

bf16-mixed: fp32 (trainable) params sharded, gathered in bf16, gradients reduced in fp32
(`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`). bf16: everything bf16, no policy.
`wrap=none`: one root unit over a 2-D mesh (replicate x shard of size 1): HSDP with no sharding,
i.e. a full replica per GPU with gradients all-reduced (DDP semantics).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from autofit.config import Config, wrap_units
from autofit.trial.build import decoder_layers
from autofit.trial.dtypes import train_dtype
from autofit.trial.quantize import int8_params


def make_mesh(device_type: str, world_size: int, wrap: str) -> DeviceMesh:
    if wrap == "none":
        return init_device_mesh(
            device_type, (world_size, 1), mesh_dim_names=("dp_replicate", "dp_shard")
        )
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_shard",))


def mp_policy(config: Config) -> MixedPrecisionPolicy:
    """bf16 compute; reduce in fp32 under bf16-mixed. Pure bf16 params need no policy."""
    if train_dtype(config) == torch.bfloat16:
        return MixedPrecisionPolicy()
    reduce = torch.float32 if config.precision == "bf16-mixed" else torch.bfloat16
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)


def offload_policy(offload: str, device_type: str) -> OffloadPolicy:
    if offload == "params":
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return OffloadPolicy()


def apply_fsdp(model: nn.Module, config: Config, mesh: DeviceMesh) -> nn.Module:
    """Shard `model` per `config.wrap`, `reshard`, `offload` and `precision`; returns the root."""
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": config.reshard,
        "mp_policy": mp_policy(config),
        "offload_policy": offload_policy(config.offload, mesh.device_type),
        "ignored_params": int8_params(model) or None,
    }
    layers = decoder_layers(model)
    for unit in wrap_units(config.wrap, len(layers)):
        modules = [layers[i] for i in unit]
        fully_shard(modules if len(modules) > 1 else modules[0], **kwargs)
    fully_shard(model, **kwargs)
    return model


def fsdp_root(model: nn.Module) -> FSDPModule | None:
    """The outermost FSDP2 module (its `set_requires_gradient_sync` recurses to every unit)."""
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            return mod
    return None
