"""One resolved layout: how a run of a config holds the model on its GPUs, resolved once from the
config's knobs, the GPUs (how many, how many a node) and the model's decoder layers, and read by
the builder, the estimator and the exports alike, as every step of torchtitan reads its
`ParallelDims`.

The rules it applies are written here, once (`resolve_wrap`, `sharding_for`, `mesh_shape`,
`wrap_units`, `uses_autocast`), in `autofit.recipe` (the dtypes, `adamw_impl`, which layers are
checkpointed: `checkpointed_layers`) and in `autofit.settings` (which projections `lora_targets`
names: `targeted`); a reader takes the resolved values from `Layout` instead of applying them
again. Plain data, no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from autofit.recipe import (
    COMPUTE_DTYPE,
    FP32,
    FROZEN_DTYPE,
    Bnb4bit,
    adamw_impl,
    bnb_of,
    checkpointed_layers,
    fp32_trainable,
    reduce_dtype,
    trainable_dtype,
)
from autofit.rules import fsdp2_only_knob
from autofit.settings import BNB_SETTINGS, HF_LAUNCHES, targeted, trained_token_count
from autofit.values import (
    Checkpointing,
    Launch,
    Offload,
    Optimizer,
    OptimizerImpl,
    Precision,
    Quant,
    Shard,
    Wrap,
)

if TYPE_CHECKING:
    from autofit.config import Config

__all__ = [
    "AUTO_WRAP", "LAYOUT_KNOBS", "Layout", "Sharding", "ddp_grad_views", "embedding_precision",
    "embeddings_cast", "layout_of", "mesh_shape", "resolve_wrap", "sharding_for", "uses_autocast",
    "wrap_group_size", "wrap_unit_count", "wrap_units",
]  # fmt: skip


def wrap_group_size(wrap: str, n_layers: int) -> int:
    """Decoder layers per FSDP2 unit for a `wrap` value (`none` -> no units)."""
    if wrap == Wrap.LAYER:
        return 1
    if wrap.startswith("every-"):
        return int(wrap.split("-")[1])
    if wrap == Wrap.MODEL:
        return n_layers
    return 0


@lru_cache(maxsize=256)
def wrap_units(wrap: str, n_layers: int) -> tuple[tuple[int, ...], ...]:
    """The FSDP2 units `wrap` produces, as lists of decoder-layer indices.

    Besides these, FSDP2 runs shard the token embeddings and `[final norm, LM head]` as units of
    their own (torchtitan's `apply_fsdp`), and the root unit takes whatever no unit claims (with
    `model`, every decoder layer). `none` is not FSDP2 at all (`sharding_for`). The trial builder
    calls `fully_shard` on exactly these groups, and the estimator sizes the all-gather buffers
    from them, so the two cannot disagree.
    """
    if not wrap_unit_count(wrap, n_layers):
        return ()
    k = wrap_group_size(wrap, n_layers)
    return tuple(tuple(range(i, min(i + k, n_layers))) for i in range(0, n_layers, k))


def wrap_unit_count(wrap: str, n_layers: int) -> int:
    """How many FSDP2 units of decoder layers `wrap` makes (`len(wrap_units(...))`), counted,
    not listed: what the estimator reads, in a time that does not grow with the layers."""
    k = wrap_group_size(wrap, n_layers)
    return 0 if k == 0 or k >= n_layers else -(-n_layers // k)


class Sharding(str, enum.Enum):
    """How a run holds the model across its GPUs (what a trial reports as `sharding`)."""

    NONE = "none"  # one GPU, the plain module (train.py, torchtune single-device, HF Trainer)
    DDP = "ddp"  # replicas holding the weights once, gradients all-reduced (PyTorch DDP)
    FSDP2 = "fsdp2"  # `fully_shard` units laid out as torchtitan does

    def __str__(self) -> str:
        return self.value


AUTO_WRAP = Wrap.AUTO.value
"""`wrap`'s default: how the best recipes hold the model on the GPUs at hand (`resolve_wrap`)."""


def resolve_wrap(
    wrap: str, n_gpus: int, offload: str = Offload.NONE, shard: str = Shard.ALL,
    launch: str = Launch.AUTOFIT,
) -> str:  # fmt: skip
    """The wrap `wrap: auto` stands for on `n_gpus` GPUs: the plain module (`none`) on one GPU,
    as torchtune's single-device recipes and HF Trainer run it, and FSDP2 per decoder layer
    (`layer`, torchtitan's layout) on several; also `layer` where a knob needs FSDP2 (`offload:
    params`, `shard: node`). Under `launch: trainer` or `trl` it is `none` on any number of GPUs:
    a Trainer script started by `torchrun` runs DDP replicas unless its arguments name FSDP
    (`autofit.rules.launch_unavailable`). Any other value is itself. The estimator, the builder,
    a trial and a space resolve `auto` with this before anything reads the wrap
    (`Config.resolved`)."""
    if wrap != AUTO_WRAP:
        return wrap
    needs_fsdp = fsdp2_only_knob(offload, shard) is not None
    replicas = n_gpus <= 1 or launch in HF_LAUNCHES
    return Wrap.NONE.value if replicas and not needs_fsdp else Wrap.LAYER.value


def sharding_for(wrap: str, n_gpus: int) -> Sharding:
    """`wrap: none` is the plain module on one GPU and DDP replicas on several; any other wrap is
    FSDP2 (on one GPU a one-rank mesh, which only param offload or a measured win justifies).
    The builder and the estimator both read this rule; `auto` must be resolved first
    (`resolve_wrap`), and is refused here so that nothing reads it unresolved."""
    if wrap == AUTO_WRAP:
        raise ValueError(
            "internal error: wrap 'auto' reached the builder or the estimator unresolved "
            "(Config.resolved(n_gpus) resolves it)"
        )
    if wrap == Wrap.NONE:
        return Sharding.NONE if n_gpus <= 1 else Sharding.DDP
    return Sharding.FSDP2


def mesh_shape(shard: str, n_gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(replicas, shard degree) of the FSDP2 mesh: `shard: all` shards over every GPU (one
    replica); `shard: node` is HSDP, torchtitan's `dp_replicate` x `dp_shard` mesh with the shard
    dimension inside a node and a replica per node. The builder's `init_device_mesh` and the
    estimator's shard degree and collectives read this. On one node both are the same mesh."""
    if shard == Shard.NODE and n_gpus > gpus_per_node >= 1 and n_gpus % gpus_per_node == 0:
        return n_gpus // gpus_per_node, gpus_per_node
    return 1, n_gpus


def ddp_grad_views(launch: str) -> bool:
    """Whether DDP's gradients are views into its all-reduce buckets, so that they exist once:
    autofit's DDP sets `gradient_as_bucket_view=True` (`autofit.builder.ddp`); HF Trainer's DDP
    is Accelerate's, whose `DistributedDataParallelKwargs` leave it False (accelerate 1.15
    utils/dataclasses.py) and which `TrainingArguments` cannot set, so each gradient is copied
    into a bucket of its own beside `.grad` (the PyTorch DDP notes)."""
    return launch not in HF_LAUNCHES


def embeddings_cast(launch: str, train_embeddings: str) -> bool:
    """Whether what `train_embeddings` trains is held in the run's trainable dtype: under
    autofit's builder, which casts every trainable parameter to it (`builder.apply.cast_trainable`),
    and for `tokens:N`'s rows under `launch: trainer`/`trl` too, where peft does the casting: its
    `autocast_adapter_dtype` upcasts the adapter layers (peft 0.21 `cast_adapter_dtype` walks
    `BaseTunerLayer`s), a `TrainableTokensLayer` among them. Not `full`'s copies there: peft
    deep-copies them from the bf16 modules into `modules_to_save` and they stay pure bf16 beside
    fp32 adapters (tests/builder/test_embeddings.py reads the dtypes peft gives)."""
    return launch not in HF_LAUNCHES or trained_token_count(train_embeddings) is not None


def embedding_precision(precision: str, launch: str, train_embeddings: str) -> str:
    """The precision what `train_embeddings` trains is held in (its weights, gradients and AdamW
    moments): the run's `precision` where it is cast to the trainable dtype (`embeddings_cast`),
    else pure bf16 (peft's copies under Trainer)."""
    return precision if embeddings_cast(launch, train_embeddings) else Precision.BF16.value


def uses_autocast(precision: str, optimizer: str, sharding: Sharding) -> bool:
    """bf16 autocast runs where fp32 trainable params are held by the plain module or DDP (HF
    Trainer's `bf16=True`, torchtune's single-device recipes); FSDP2 casts the gathered params
    through its `MixedPrecisionPolicy` instead, and bf16 params need no cast."""
    return sharding is not Sharding.FSDP2 and fp32_trainable(precision, optimizer)


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
    # what is checkpointed, quantized and trained (decoder-layer projections named by their path
    # inside a layer, `self_attn.q_proj`: every layer has the same, `builder.model`'s rule)
    checkpointed: tuple[int, ...] = ()  # decoder layers checkpointed (`recipe.checkpointed_layers`)
    selective: bool = False  # op-level: inside them, matmul and attention outputs are saved
    quant: str | None = None  # how the frozen base projections are stored (`nf4`, `int8`)
    bnb: Bnb4bit | None = None  # NF4 by bitsandbytes (`quant_backend`); None: torchao's
    quantized: tuple[str, ...] = ()  # the projections stored so: every one with `quant`
    adapted: tuple[str, ...] = ()  # the projections with LoRA adapters (`settings.targeted`)
    trains_all: bool = True  # a full fine-tune; else the adapters and `train_embeddings`' modules
    grad_views: bool = True  # DDP's gradients are views into its buckets (`ddp_grad_views`)

    @property
    def fsdp(self) -> bool:
        return self.sharding is Sharding.FSDP2

    @property
    def communicators(self) -> int:
        """The process groups (NCCL communicators on GPUs) a rank of this run holds: none for the
        plain module on one GPU (the job starts no process group), one for DDP and for FSDP2 (a
        one-rank mesh on one GPU included: `fully_shard` needs a process group), two for HSDP
        (torchtitan's `dp_replicate` x `dp_shard` mesh: a shard group and a replicate group).
        The trial launcher starts a group where this is not 0, and the estimator counts NCCL's
        buffers per communicator (`estimate.memory.outside_allocator_bytes`)."""
        if self.sharding is Sharding.NONE:
            return 0
        return 2 if self.fsdp and self.replicas > 1 else 1

    @property
    def base_dtype(self) -> str:
        """The base weights before any quantization: frozen in `recipe.FROZEN_DTYPE` under LoRA,
        the trainable dtype in a full fine-tune."""
        return self.param_dtype if self.trains_all else FROZEN_DTYPE

    @property
    def fp32_trainable(self) -> bool:
        """Trainable (master) params in fp32 (`recipe.fp32_trainable`)."""
        return self.param_dtype == FP32

    @property
    def mesh(self) -> tuple[int, int]:
        """FSDP2's data-parallel mesh, (replicas, shard degree): torchtitan's `dp_replicate` x
        `dp_shard` (`autofit.layout.mesh_shape`); (1, 1) when the run is not FSDP2."""
        return (self.replicas, self.shard) if self.fsdp else (1, 1)

    @classmethod
    def of(
        cls, *, wrap: str, shard: str, n_gpus: int, gpus_per_node: int | None = None,
        n_layers: int = 0, precision: str = Precision.BF16_MIXED,
        optimizer: str = Optimizer.ADAMW, offload: str = Offload.NONE,
        optimizer_impl: str = OptimizerImpl.AUTO, device: str = "cuda",
        checkpointing: str = Checkpointing.NONE, quant: str = Quant.NONE, lora_rank: int = 0,
        lora_targets: tuple[str, ...] | None = None, projections: tuple[str, ...] = (),
        bnb: Bnb4bit | None = None, launch: str = Launch.AUTOFIT,
    ) -> Layout:  # fmt: skip
        """The layout of a run of these knob values on `n_gpus` GPUs, `gpus_per_node` a node
        (default: one node), of a model of `n_layers` decoder layers (0: units and checkpointed
        layers not needed) whose layers have `projections` (paths inside a layer; (): the
        quantized and adapted ones not needed). `wrap` is resolved (`Config.resolved`): `auto`
        is refused (`sharding_for`), as by every term that reads the wrap."""
        n = max(n_gpus, 1)
        sharding = sharding_for(wrap, n)
        if sharding is Sharding.FSDP2:
            replicas, degree = mesh_shape(shard, n, gpus_per_node or n)
            units = wrap_units(wrap, n_layers) if n_layers else ()
        else:
            replicas, degree, units = (n if sharding is Sharding.DDP else 1), 1, ()
        lora = lora_rank > 0
        stored = quant if quant != Quant.NONE else None
        return cls(
            sharding, replicas, degree, units, uses_autocast(precision, optimizer, sharding),
            trainable_dtype(precision, optimizer), COMPUTE_DTYPE, reduce_dtype(precision),
            adamw_impl(optimizer_impl, optimizer, device, offload, launch in HF_LAUNCHES),
            checkpointed=checkpointed_layers(checkpointing, n_layers),
            selective=checkpointing == Checkpointing.SELECTIVE,
            quant=stored,
            bnb=bnb if stored == Quant.NF4 else None,
            quantized=projections if stored is not None else (),
            adapted=tuple(p for p in projections if targeted(p, lora_targets)) if lora else (),
            trains_all=not lora,
            grad_views=ddp_grad_views(launch),
        )  # fmt: skip


def layout_of(
    config: Config, n_gpus: int, gpus_per_node: int | None = None, n_layers: int = 0,
    device: str = "cuda", projections: tuple[str, ...] = (),
) -> Layout:  # fmt: skip
    """The layout of `config` on `n_gpus` GPUs (`Layout.of`), of a model of `n_layers` decoder
    layers whose layers have `projections` (`autofit.builder.model.decoder_projections`'s paths,
    `autofit.structure.Structure.projections`' names); `wrap: auto` is what it stands for on
    `n_gpus` (`Config.resolved`)."""
    config = config.resolved(n_gpus)
    return Layout.of(
        wrap=config.wrap, shard=config.shard, n_gpus=n_gpus, gpus_per_node=gpus_per_node,
        n_layers=n_layers, precision=config.precision, optimizer=config.optimizer,
        offload=config.offload, optimizer_impl=config.optimizer_impl, device=device,
        checkpointing=config.checkpointing, quant=config.quant, lora_rank=config.lora_rank,
        lora_targets=config.lora_targets, projections=projections,
        bnb=bnb_of(config), launch=config.launch,
    )  # fmt: skip


LAYOUT_KNOBS = (
    "wrap", "shard", "precision", "optimizer", "offload", "optimizer_impl", "checkpointing",
    "quant", "lora_rank", "lora_targets", "quant_backend", *BNB_SETTINGS, "launch",
)  # fmt: skip
"""The knobs and settings `layout_of` reads: with the GPUs, the model's layers and the device, a
config's layout is a function of these alone (a test varies every other one), so the estimator
keys the layouts it resolves by them (`autofit.estimate.terms`)."""
