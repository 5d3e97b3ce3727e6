"""FSDP2 laid out as torchtitan's `apply_fsdp`: token embeddings, each unit of the layout
(`autofit.layout.Layout.units`), `[final norm, LM head]`, then the root.

bf16-mixed: fp32 (trainable) params sharded, gathered in bf16, gradients reduced in fp32
(`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`). bf16: everything bf16, no policy.
`[norm, head]` is not resharded after forward: backward needs it first (torchtitan's default),
nor is the root. With `wrap: model` every decoder layer lives in the root unit. A tied LM head
shares the embedding's weight, so both stay in the root unit. With `train_embeddings: full`, the
embedding and `[norm, head]` units hold peft's trainable copies, and the frozen originals beside
them are a unit of their own that forward never gathers (`frozen_originals`).

`shard: node` is HSDP on a 2-D mesh (`make_mesh`), which `fully_shard` reads as `dp_replicate` x
`dp_shard`: each parameter `(Replicate(), Shard(0))`, gathered and reduce-scattered within a node,
its gradient shard then all-reduced across nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from autofit.builder.dtypes import TORCH_DTYPES
from autofit.builder.model import ModelParts, trainable_copy
from autofit.config import Config
from autofit.layout import Layout
from autofit.recipe import QUANT_TENSOR_CLASS, base_stays_whole
from autofit.values import Offload

SHARD_DIM = "dp_shard"
REPLICATE_DIM = "dp_replicate"


def make_mesh(device_type: str, layout: Layout) -> DeviceMesh:
    """The data-parallel mesh FSDP2 shards over (one rank on one GPU), of the layout's
    (replicas, shard degree) (`Layout.mesh`): 1-D `("dp_shard",)` for one replica; else
    torchtitan's 2-D `("dp_replicate", "dp_shard")` mesh, which `fully_shard` reads as HSDP.
    `init_device_mesh` lays ranks out row-major, so each shard group is a node's consecutive
    ranks under torchrun."""
    replicas, degree = layout.mesh
    if replicas == 1:
        return init_device_mesh(device_type, (degree,), mesh_dim_names=(SHARD_DIM,))
    return init_device_mesh(
        device_type, (replicas, degree), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM)
    )


def mp_policy(layout: Layout) -> MixedPrecisionPolicy:
    """Gather in the compute dtype, reduce in `Layout.reduce_dtype` (fp32 under bf16-mixed);
    params already in the compute dtype (pure bf16) need no policy."""
    if layout.param_dtype == layout.compute_dtype:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[layout.compute_dtype],
        reduce_dtype=TORCH_DTYPES[layout.reduce_dtype],
    )


def offload_policy(offload: str, device_type: str) -> OffloadPolicy:
    if offload == Offload.PARAMS:
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return OffloadPolicy()


def apply_fsdp(
    model: nn.Module,
    parts: ModelParts,
    config: Config,
    mesh: DeviceMesh,
    layout: Layout,
    *,
    before_unit: Callable[[list[nn.Module]], None] | None = None,
) -> nn.Module:
    """Shard `model` over `mesh` (`make_mesh(layout)`) into the layout's units, per `config`'s
    `reshard`, `offload` and `precision`; returns the root.

    `before_unit(modules)` runs just before each unit of decoder layers is sharded: the builder
    materialises and quantizes those layers there, so a rank holds its shards plus one unit.
    """
    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy(layout),
        "offload_policy": offload_policy(config.offload, mesh.device_type),
    }

    def shard(modules: nn.Module | list[nn.Module], reshard: bool | None) -> None:
        group = modules if isinstance(modules, list) else [modules]
        params = [p for m in group for p in m.parameters()]
        ignored = unshardable_params(params, layout.shard) or None
        fully_shard(modules, reshard_after_forward=reshard, ignored_params=ignored, **kwargs)

    originals = frozen_originals(parts)
    if originals:  # never called, so never gathered: each rank holds its shards only
        shard(originals, True)
    if not parts.tied:
        shard(parts.embed, config.reshard)
    for unit in layout.units:
        modules = [parts.layers[i] for i in unit]
        if before_unit is not None:
            before_unit(modules)
        shard(modules if len(modules) > 1 else modules[0], config.reshard)
    if before_unit is not None and not layout.units:
        before_unit(list(parts.layers))  # `model`: the layers belong to the root unit
    if not parts.tied and parts.head is not None:
        shard([m for m in (parts.norm, parts.head) if m is not None], False)
    # The root as torchtitan shards it: `reshard_after_forward` left unset, so FSDP2 keeps the root
    # gathered after forward (backward needs it at once; `_fsdp_state.py` `_lazy_init` only does
    # this when the argument is None).
    shard(model, None)
    return model


def frozen_originals(parts: ModelParts) -> list[nn.Module]:
    """The frozen embedding and LM head that peft keeps beside their trainable copies
    (`train_embeddings: full`, `modules_to_save`), which forward never calls. They form one FSDP2
    unit of their own, which is never gathered, so that the embedding unit and `[norm, head]` hold
    the copies alone, as the estimator counts them (and a tied head's original, which shares the
    embedding's weight, is in the same unit as it)."""
    return [
        m.original_module  # type: ignore[misc]
        for m in (parts.embed, parts.head)
        if m is not None and trainable_copy(m) is not None
    ]


def unshardable_params(params: Iterable[nn.Parameter], shards: int) -> set[nn.Parameter]:
    """Those of `params` FSDP2 must leave alone (`ignored_params`): they stay whole on every GPU.

    Quantized base weights per `autofit.recipe.base_stays_whole` (torchao `Int8Tensor` always,
    `NF4Tensor` on a one-rank shard dimension, where it loses nothing but CPU offload); `shards`:
    the layout's shard degree (`Layout.shard`).
    """
    whole = {cls for quant, cls in QUANT_TENSOR_CLASS.items() if base_stays_whole(quant, shards)}
    return {p for p in params if any(c.__name__ in whole for c in type(p.data).__mro__)}


def fsdp_root(model: nn.Module) -> FSDPModule | None:
    """The outermost FSDP2 module (its `set_requires_gradient_sync` recurses to every unit)."""
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            return mod
    return None
