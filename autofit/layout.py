"""One resolved layout: how a run of a config holds the model on its GPUs, resolved once from the
config's knobs, the GPUs (how many, how many a node) and the model's decoder layers, and read by
the builder, the estimator and the exports alike, as every step of torchtitan reads its
`ParallelDims`.

The rules it applies are written once, in `autofit.config` (`sharding_for`, `mesh_shape`,
`wrap_units`, `uses_autocast`) and `autofit.recipe` (the dtypes, `adamw_impl`); a reader takes the
resolved values from here instead of applying them again. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from autofit.config import Config, Sharding, mesh_shape, sharding_for, uses_autocast, wrap_units
from autofit.recipe import COMPUTE_DTYPE, adamw_impl, reduce_dtype, trainable_dtype

__all__ = ["Layout", "layout_of"]


@dataclass(frozen=True)
class Layout:
    """How a run holds the model, per GPU."""

    sharding: Sharding  # the plain module (one GPU), DDP replicas or FSDP2
    replicas: int  # copies of each state: HSDP's replicate dimension, DDP's ranks; else 1
    shard: int  # the GPUs each state is split over: FSDP2's shard dimension; else 1
    units: tuple[tuple[int, ...], ...]  # FSDP2's units of decoder layers (`wrap_units`)
    autocast: bool  # bf16 autocast around fp32 trainable params (the plain module, DDP)
    param_dtype: str  # trainable (master) params and their sharded gradients
    compute_dtype: str  # matmuls: autocast's dtype, FSDP2's `param_dtype`
    reduce_dtype: str  # gradients reduced (and accumulated unsharded under FSDP2)
    adamw: str | None  # torch AdamW's implementation (`recipe.adamw_impl`); None: torchao's

    @property
    def fsdp(self) -> bool:
        return self.sharding is Sharding.FSDP2

    @property
    def mesh(self) -> tuple[int, int]:
        """FSDP2's data-parallel mesh, (replicas, shard degree): torchtitan's `dp_replicate` x
        `dp_shard` (`autofit.config.mesh_shape`); (1, 1) when the run is not FSDP2."""
        return (self.replicas, self.shard) if self.fsdp else (1, 1)

    @classmethod
    def of(
        cls, *, wrap: str, shard: str, n_gpus: int, gpus_per_node: int | None = None,
        n_layers: int = 0, precision: str = "bf16-mixed", optimizer: str = "adamw",
        offload: str = "none", optimizer_impl: str = "auto", device: str = "cuda",
    ) -> Layout:  # fmt: skip
        """The layout of a run of these knob values on `n_gpus` GPUs, `gpus_per_node` a node
        (default: one node), of a model of `n_layers` decoder layers (0: units not needed)."""
        n = max(n_gpus, 1)
        sharding = sharding_for(wrap, n)
        if sharding is Sharding.FSDP2:
            replicas, degree = mesh_shape(shard, n, gpus_per_node or n)
            units = wrap_units(wrap, n_layers) if n_layers else ()
        else:
            replicas, degree, units = (n if sharding is Sharding.DDP else 1), 1, ()
        return cls(
            sharding, replicas, degree, units, uses_autocast(precision, optimizer, sharding),
            trainable_dtype(precision, optimizer), COMPUTE_DTYPE, reduce_dtype(precision),
            adamw_impl(optimizer_impl, optimizer, device, offload),
        )  # fmt: skip


def layout_of(
    config: Config, n_gpus: int, gpus_per_node: int | None = None, n_layers: int = 0,
    device: str = "cuda",
) -> Layout:  # fmt: skip
    """The layout of `config` on `n_gpus` GPUs (`Layout.of`)."""
    return Layout.of(
        wrap=config.wrap, shard=config.shard, n_gpus=n_gpus, gpus_per_node=gpus_per_node,
        n_layers=n_layers, precision=config.precision, optimizer=config.optimizer,
        offload=config.offload, optimizer_impl=config.optimizer_impl, device=device,
    )  # fmt: skip
