"""The builder: a config applied to a model in the order it must happen.

dtypes, LoRA, checkpoint, compile (each decoder layer, `compile: true`), then layer by layer
materialise, quantize and shard, then the optimizer: the trial builds its random-weight model
with exactly these steps, and `autofit.apply` runs them on a user's model, so a user's run is
what was measured. How the model is held is the config's `autofit.layout.Layout` (world size,
ranks per node, decoder layers), which the estimator reads too: the plain module on one GPU
(`wrap: none`), DDP replicas on several, FSDP2 laid out as torchtitan does otherwise, on the
layout's mesh and units (HSDP with `shard: node` across several nodes).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from autofit.builder.batching import Inputs, collate
from autofit.builder.checkpoint import apply_checkpointing
from autofit.builder.compile import apply_compile
from autofit.builder.ddp import apply_ddp
from autofit.builder.dtypes import TORCH_DTYPES, compute_dtype
from autofit.builder.fsdp import apply_fsdp, fsdp_root, make_mesh
from autofit.builder.lora import apply_lora
from autofit.builder.loss import apply_loss
from autofit.builder.model import (
    build_meta_model,
    decoder_layers,
    has_meta,
    layer_projections,
    materialize,
    model_parts,
    trainable_copy,
)
from autofit.builder.optim import LR, build_optimizer
from autofit.builder.quantize import quantize_layer
from autofit.config import Config
from autofit.layout import Layout, Sharding, layout_of
from autofit.models import ModelSpec
from autofit.values import Launch, Offload, Shard, Wrap

Batch = torch.Tensor | Mapping[str, torch.Tensor]
"""One micro-batch: token ids (batch x seq) or the model's keyword inputs."""


@dataclass
class Applied:
    """A model set up for training as a trial measured it, with what its training loop needs.

    ```
    run = autofit.apply(model, plan.best.config)
    for step_batches in batches:                 # `grad_accum` micro-batches per optimizer step
        loss = run.train_step(step_batches)      # forward, backward, optimizer step: as measured
    ```
    `train_step` is `backward` (the micro-steps, gradients synced on the last) then the optimizer
    step; a loop of your own can call `backward`, or `loss`, `autocast` and `gradient_sync`.
    """

    model: nn.Module  # the module to call: plain (peft) model, DDP wrapper, or FSDP2 root
    optimizer: torch.optim.Optimizer
    config: Config
    layout: Layout  # how the run holds the model, as the estimator counted it
    device: torch.device

    @property
    def sharding(self) -> Sharding:
        """The plain module, DDP or FSDP2 (`Layout.sharding`)."""
        return self.layout.sharding

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """bf16 autocast where the plain module or DDP hold fp32 trainable params (bf16-mixed);
        FSDP2 casts through its `MixedPrecisionPolicy` instead, pure bf16 needs nothing
        (`Layout.autocast`)."""
        if not self.layout.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=compute_dtype())

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Wrap forward and backward of a micro-step: sync gradients only when `enabled` (the last
        micro-step of an optimizer step). DDP `no_sync`; FSDP2 `set_requires_gradient_sync`."""
        if self.sharding is Sharding.DDP and not enabled:
            with self.model.no_sync():  # type: ignore[operator]
                yield
            return
        if self._fsdp_root is not None:
            self._fsdp_root.set_requires_gradient_sync(enabled)
        yield

    def loss(self, batch: Batch) -> torch.Tensor:
        """The training loss of one micro-batch, its forward under `autocast`: token ids (a causal
        LM's loss, the ids as labels, as trials run it) or the model's keyword inputs."""
        inputs = {"input_ids": batch, "labels": batch} if torch.is_tensor(batch) else dict(batch)
        with self.autocast():
            return self.model(**{"use_cache": False, **inputs}).loss

    def backward(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        """Forward and backward of one optimizer step's micro-batches (`config.grad_accum` of
        them), gradients synced on the last only; returns their mean loss (detached)."""
        n = len(micro_batches)
        if n != self.config.grad_accum:
            raise ValueError(
                f"{n} micro-batch(es) given for one optimizer step; this config accumulates "
                f"grad_accum={self.config.grad_accum}. Pass that many."
            )
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            with self.gradient_sync(i == n - 1):
                loss = self.loss(batch)
                (loss / n).backward()
            total += loss.detach().float()
        return total / n

    def train_step(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        """One optimizer step: `backward` over the micro-batches, the optimizer step, the
        gradients freed. Returns the mean loss (detached)."""
        loss = self.backward(micro_batches)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def collate(self, examples: Sequence[Sequence[int]], pad_id: int = 0) -> Inputs:
        """One micro-batch of `examples` (token id lists) as this config's `batching` makes it,
        on the run's device: what `loss`, `backward` and `train_step` take
        (`autofit.builder.batching.collate`: padded to the longest, or packed into rows of
        `seq_len` with position ids reset per document; `grouped` wants its examples in
        length-grouped order, e.g. from transformers' `LengthGroupedSampler`)."""
        made = collate(examples, self.config.batching, self.config.seq_len, pad_id)
        return {k: v.to(self.device) for k, v in made.items()}

    @functools.cached_property
    def _fsdp_root(self) -> FSDPModule | None:
        return fsdp_root(self.model) if self.sharding is Sharding.FSDP2 else None


def cast_base(model: nn.Module, layout: Layout) -> None:
    """Before LoRA: a LoRA base is frozen bf16; a full fine-tune (`Layout.trains_all`) is all in
    the train dtype and trains (`Layout.base_dtype`)."""
    dtype = TORCH_DTYPES[layout.base_dtype]
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
        p.requires_grad_(layout.trains_all)


def cast_trainable(model: nn.Module, layout: Layout) -> None:
    """After LoRA: adapters, and the embedding and head weights `train_embeddings` trains, in the
    train dtype (peft creates them in the base weight's dtype, or casts its adapters to fp32);
    the original token rows peft keeps beside trained rows (for unmerging) in the frozen dtype,
    as the weight they were read from (`Layout.param_dtype`, `Layout.base_dtype`)."""
    dtype = TORCH_DTYPES[layout.param_dtype]
    for p in model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)
    frozen = TORCH_DTYPES[layout.base_dtype]
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] == TOKEN_ORIGINALS:
            for key, buf in list(mod._buffers.items()):
                if buf is not None and buf.is_floating_point():
                    mod._buffers[key] = buf.to(frozen)


TOKEN_ORIGINALS = "trainable_tokens_original"
"""peft's buffers of the original values of trained token rows (`TrainableTokensLayer`)."""


def adapt(model: nn.Module, config: Config, layout: Layout) -> nn.Module:
    """The builder's steps before any weight exists: dtypes, LoRA (on `Layout.adapted`, with
    its dropout), the loss (`autofit.builder.loss`), and activation checkpointing
    (`Layout.checkpointed`); under `Layout.autocast` the run autocasts fp32 adapters
    (`keep_lora_inputs`; not for `launch: trainer`, whose peft model, a Trainer script's, keeps
    peft's casts: the one-layer trace of that launch builds it so). `prepare` runs them before
    sharding, and the one-layer trace (`autofit.builder.trace`) on the layers it measures."""
    cast_base(model, layout)
    model = apply_lora(
        model, config.lora_rank, config.alpha, layout.adapted, config.lora_dropout,
        config.train_embeddings,
    )  # fmt: skip
    cast_trainable(model, layout)
    if layout.autocast:
        if config.launch == Launch.AUTOFIT:  # a Trainer script's peft model casts them (the trace)
            keep_lora_inputs(model)
        embeddings_in_compute_dtype(model)
    apply_loss(model, config.loss)
    apply_checkpointing(model, layout.checkpointed, layout.selective)
    return model


def model_layout(
    model: nn.Module, config: Config, world: int = 1, local_world: int | None = None,
    device_type: str = "cuda",
) -> Layout:  # fmt: skip
    """`config`'s layout for this model on `world` ranks, `local_world` a node (default: one
    node): its decoder layers and their projections read off the model (`layout_of`)."""
    n_layers = len(decoder_layers(model))
    projections = layer_projections(model)
    return layout_of(config, world, local_world or world, n_layers, device_type, projections)


def prepare(
    model: nn.Module,
    config: Config,
    device: torch.device,
    world: int,
    local_world: int | None = None,
) -> tuple[nn.Module, Layout]:
    """dtypes, LoRA, checkpointing, `torch.compile` of each decoder layer (`compile: true`; after
    checkpointing, before sharding, as torchtitan), then unit by unit: materialise (if on meta),
    quantize one projection at a time, shard; then the rest. A rank holds its shards plus the
    projection being quantized; only with `wrap: model` (every layer in the root unit, sharded last)
    does a quantized base exist whole on each rank before it is sharded. `local_world`: ranks per
    node (default `world`: one node). Returns the model to call and its layout."""
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False  # a KV cache changes state between forward and recompute
    layout = model_layout(model, config, world, local_world, device.type)
    sharding = layout.sharding
    model = adapt(model, config, layout)
    apply_compile(model, config)
    parts = model_parts(model)

    if sharding is Sharding.FSDP2:
        mesh = make_mesh(device.type, layout)

        def build_layers(layers: list[nn.Module]) -> None:
            if layout.quant is None:
                return  # left on meta: `fully_shard` first, so only shards are ever allocated
            for layer in layers:
                quantize_layer(
                    layer, layout.quant, layout.quantized, device, layout.shard, layout.bnb
                )
                materialize(layer, device)

        apply_fsdp(model, parts, config, mesh, layout, before_unit=build_layers)
        # what FSDP2 offloads must be on the host when it first runs; the rest on the device
        materialize(model, device, param_device=offloaded_param_device(config, device))
        return model, layout
    for layer in parts.layers:
        if not has_meta(layer):
            layer.to(device)  # a user's model may arrive on the host
        quantize_layer(layer, layout.quant, layout.quantized, device, bnb=layout.bnb)
        materialize(layer, device)
    materialize(model, device)
    model.to(device)
    if sharding is Sharding.DDP:
        return apply_ddp(model, device), layout
    return model, layout


def offloaded_param_device(config: Config, device: torch.device) -> torch.device | None:
    """Where the parameters FSDP2 manages are materialised: the host under `offload: params`
    (FSDP2's `CPUOffloadPolicy` refuses a parameter left on the GPU when it first runs, and moves
    to the host only those that were real when `fully_shard` ran); None: on `device`."""
    return torch.device("cpu") if config.offload == Offload.PARAMS else None


def keep_lora_inputs(model: nn.Module) -> None:
    """Under autocast, stop peft casting each adapter's input to the adapter's fp32 dtype (the
    public `cast_input_dtype_enabled` of each `LoraLayer`): autocast casts it back to bf16 for the
    matmul anyway, and autograd would keep that extra bf16 copy of every adapted layer's input for
    backward (+40% activations at 7B). The adapter then saves the very input tensor the base
    projection saves.

    peft's `disable_input_dtype_casting` sets the same flag, but only while its context is open:
    activation checkpointing re-runs the forward inside backward, after a context around the
    forward has closed, and a user's own loop calls the model outside any context of ours. The
    flag must hold for the model's lifetime, so it is set once here."""
    from peft.tuners.lora import LoraLayer

    for mod in model.modules():
        if isinstance(mod, LoraLayer):
            mod.cast_input_dtype_enabled = False


def embeddings_in_compute_dtype(model: nn.Module) -> None:
    """Under autocast, the trainable copy of the input embedding (`train_embeddings: full`, fp32
    under bf16-mixed) hands the decoder its output in the compute dtype (bf16), as FSDP2's
    `param_dtype` gathers it: an embedding lookup is not autocast, and an fp32 output would turn
    the whole residual stream fp32 (every norm and residual add saving fp32 tensors, each
    projection its own bf16 cast of its input) while the frozen bf16 base computes in bf16."""
    embeddings = getattr(model, "get_input_embeddings", None)
    copy = trainable_copy(embeddings()) if embeddings is not None else None
    if copy is not None:
        copy.register_forward_hook(_to_compute_dtype)


def _to_compute_dtype(_mod: nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
    dtype = compute_dtype()
    if out.dtype == torch.float32 and torch.is_autocast_enabled(out.device.type):
        return out.to(dtype)
    return out


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


LOCAL_WORLD_ENV = "LOCAL_WORLD_SIZE"
"""Ranks on this node, as torchrun sets it (so do `accelerate launch` and the trials, which run
torchrun): the shard dimension of `shard: node`."""


def _local_world(config: Config, world: int) -> int:
    """Ranks per node for the mesh: torchrun's `LOCAL_WORLD_SIZE`; without it, one node. A
    `shard: node` config on several ranks needs it: without it HSDP would silently be flat FSDP."""
    text = os.environ.get(LOCAL_WORLD_ENV, "").strip()
    if text:
        return int(text)
    if config.shard == Shard.NODE and world > 1 and config.wrap != Wrap.NONE:
        raise ValueError(
            f"shard=node (HSDP: shard within a node, replicate across nodes) needs the ranks per "
            f"node, which autofit reads from {LOCAL_WORLD_ENV}; it is not set. Launch with "
            f"torchrun (or accelerate launch), or set {LOCAL_WORLD_ENV} to the ranks on each node."
        )
    return world


def apply(
    model: nn.Module,
    config: Config,
    *,
    lr: float = LR,
    device: torch.device | str | None = None,
) -> Applied:
    """Apply `config` to a user's model as trials do: LoRA, checkpointing, compile (each decoder
    layer, compiled on its first forward), quantization, then the plain module, DDP or FSDP2
    (inside an initialised process group of several ranks; with `shard: node` across nodes, HSDP,
    the ranks per node read from torchrun's `LOCAL_WORLD_SIZE`), and the optimizer (torch AdamW,
    torchao low-bit AdamW, or CPU-offloaded).

    `device`: where the model trains (default: where its parameters are; a model on meta is
    materialised there with random weights, as trials do). Returns `Applied`:
    `.model` to call, `.optimizer`, `.autocast()` and `.gradient_sync(last_micro_step)`.

    What it changes on your objects, besides wrapping them: with `loss: chunked` or `fused` it
    sets `forward` on two instances, the causal LM and its LM head (`builder.loss.apply_loss`;
    their classes are untouched), so that the head, still called as a module (FSDP2's hooks on
    its unit run as for the standard loss), returns the loss chunk by chunk when given labels.
    Called without labels both compute what they did before. Trials measure these very objects.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            "autofit.apply(model, config): model must be a torch.nn.Module, e.g. "
            f"AutoModelForCausalLM.from_pretrained(...) or .from_config(...); got "
            f"{type(model).__name__} {model!r:.60}."
        )
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError(
            f"autofit.apply(model, config): the {type(model).__name__} has no parameters, so "
            "there is nothing to train; pass the model to fine-tune."
        )
    dev = torch.device(device) if device is not None else first.device
    if dev.type == "meta":
        raise ValueError(
            "The model is on the meta device: pass device='cuda' (or 'cpu') to autofit.apply so "
            "its weights are materialised there, or load real weights first."
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    world = _world()
    config = config.resolved(world)  # `wrap: auto`: the plain module on one rank, FSDP2 on several
    built, layout = prepare(model, config, dev, world, _local_world(config, world))
    optimizer = build_optimizer(
        built, config, layout.adamw, dev.type, keep_gradients=layout.sharding is Sharding.DDP,
        lr=lr,
    )  # fmt: skip
    return Applied(model=built, optimizer=optimizer, config=config, layout=layout, device=dev)


def build_for_trial(spec: ModelSpec, config: Config, device: torch.device) -> Applied:
    """The trial's model: a meta build of `spec`, then exactly what `apply` does."""
    return apply(build_meta_model(spec), config, device=device)
