"""Trace one decoder layer of the real architecture at real width: the bytes it keeps for backward.

"Measure one layer and extrapolate" (answer.ai, "Napkin Math for Fine Tuning"): the model of
`spec` is built with one layer of each layer type its config declares, then again with two, with
the builder's own steps (dtypes, peft LoRA with the plan's targets and dropout, activation
checkpointing of every layer), and one forward with the loss runs under `FakeTensorMode` (no
memory, no compute: shapes, dtypes and the real dispatch, so SDPA saves what it saves on the
device, soft-capped eager attention its scores, grouped-mm experts their routed tokens).

What is counted: every tensor storage created during forward that is still alive when forward
has returned the loss: exactly what autograd (and selective checkpointing's cache, which
`saved_tensors_hooks` cannot see) keeps for backward, each storage once however many views
point at it, by its own dtype. Parameters, buffers, the token ids and the bf16 copies autocast
makes of weights (counted by the estimator from the weights themselves) are not activations.
The difference between the two-layer and the one-layer model is one layer of each type; the
rest of the one-layer model is what lives outside the layers (embedding side, rotary tables and
masks the layers share, final norm, logits and loss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from autofit.builder.dtypes import TORCH_DTYPES
from autofit.builder.loss import per_step_loss_tensors
from autofit.builder.model import (
    build_layers_model,
    decoder_layers,
    decoder_projections,
    layer_types,
    materialize,
)
from autofit.config import Config
from autofit.models import ModelSpec
from autofit.recipe import COMPUTE_DTYPE
from autofit.structure import TRL_LOSS, ActivationKey, LayerActivations, StepEvents
from autofit.values import Launch, Loss, Precision

_CASTS = {torch.ops.aten._to_copy.default}


class _Births(TorchDispatchMode):
    """Records the storage of every tensor an op creates (weakly), which are casts of a
    parameter (autocast's weight copies), and the peak of their live bytes after each op.
    With `series`, also the live bytes after every op, the op at which each storage was born (so
    that storages known only later, parameters' gradients, can be taken out) and the log of
    births and deaths in order (`log`: (id, bytes) for a birth, (id, 0) for a death), which the
    allocator model replays (`autofit.estimate.slack`)."""

    def __init__(self, kept: set[StorageWeakRef], *, series: bool = False) -> None:
        super().__init__()
        self.kept = kept
        # every storage an op has returned and that may still live -> the bytes it counts: its
        # size, or 0 for a parameter's (an op's view of it) and a weight copy
        self.born: dict[StorageWeakRef, int] = {}
        self.peak = 0
        self.series: list[int] | None = [] if series else None
        self.birth_op: dict[StorageWeakRef, int] = {}
        self.log: list[tuple[int, int]] = []
        self.ids: dict[StorageWeakRef, int] = {}
        self.copy_ids: set[int] = set()
        self._next_id = 0

    def sweep(self) -> int:
        """Forget the storages that died since the last look (logging their deaths), and return
        the bytes alive, in one pass."""
        live, gone = 0, []
        for ref, nbytes in self.born.items():
            if ref.expired():
                gone.append(ref)
            else:
                live += nbytes
        for ref in gone:
            del self.born[ref]
            if self.series is not None and ref in self.ids:
                self.log.append((self.ids.pop(ref), 0))
        return live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.series is not None:
            self.sweep()  # deaths before this op (a Python name rebound between two ops)
        out = func(*args, **(kwargs or {}))
        copy_of_param = (
            func in _CASTS
            and isinstance(args[0], torch.Tensor)
            and StorageWeakRef(args[0].untyped_storage()) in self.kept
        )
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref not in self.born:
                    kept = ref in self.kept
                    self.born[ref] = 0 if kept else storage.nbytes()
                    if self.series is not None and not kept:
                        self.birth_op[ref] = len(self.series)
                        self.ids[ref] = self._next_id
                        self._next_id += 1
                        self.log.append((self.ids[ref], storage.nbytes()))
                        if copy_of_param:
                            self.copy_ids.add(self.ids[ref])
                if copy_of_param:
                    self.born[ref] = 0  # a weight copy: counted from the weights
        live = self.sweep()
        self.peak = max(self.peak, live)
        if self.series is not None:
            self.series.append(live)
        return out


def trace_activations(spec: ModelSpec, key: ActivationKey) -> LayerActivations:
    """Bytes one decoder layer of `spec` keeps for backward per sequence (mean over its layer
    types, weighted by how many layers of each the model has), and those outside the layers."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # an op refused under fake tensors is handled below
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # HF's deprecations, not the user's
            return _trace_or_bf16(spec, key)
    finally:
        fake_log.setLevel(level)


def _trace_or_bf16(spec: ModelSpec, key: ActivationKey) -> LayerActivations:
    try:
        return _trace(spec, key)
    except RuntimeError:
        if not key.autocast:
            raise
        # fp32 weights under autocast that an op refuses (HF's grouped-mm MoE experts want
        # bf16): the layer's bf16 activations are the closest measure there is
        return _trace(spec, dataclasses.replace(key, autocast=False))


def _trace(spec: ModelSpec, key: ActivationKey) -> LayerActivations:
    types = layer_types(spec)
    kinds = list(dict.fromkeys(types)) if types else [None]
    per_kind = _per_layer_kind(spec, dataclasses.replace(key, loss=Loss.STANDARD), tuple(kinds))
    _, forward_peak, peak = _live_bytes(spec, key, tuple(kinds))
    # outside the layers: the peak over the loss (standard, forward: bf16 logits, their fp32 copy
    # and log-softmax's output; the start of backward: log-softmax's output and two fp32
    # gradients over the vocabulary; chunked: one chunk's logits and their gradient beside the
    # hidden states' gradient) less what the layers keep
    root = peak - sum(per_kind.values())
    root_forward = forward_peak - sum(per_kind.values())
    if types:
        counts = Counter(types)  # layers of each type, counted once (a model may have many)
        layer = sum(per_kind[t] * n for t, n in counts.items()) / len(types)
    else:
        layer = per_kind[None]
    # the layer whose backward holds the most, of each type the model has (the peak is there)
    standard = dataclasses.replace(key, loss=Loss.STANDARD)
    backward = max(traced_step(spec, standard, (kind,))[0] - per_kind[kind] for kind in kinds)
    return LayerActivations(
        layer=float(layer),
        root=float(max(root, 0.0)),
        root_forward=float(max(root_forward, 0.0)),
        backward=float(max(backward, 0.0)),
    )


@functools.lru_cache(maxsize=64)
def _per_layer_kind(
    spec: ModelSpec, key: ActivationKey, kinds: tuple[Any, ...]
) -> dict[Any, float]:
    """What one layer of each type keeps: the two-layer model less the one-layer one. The loss
    does not change it (it runs after the layers), so every loss reads the standard one's."""
    per_kind: dict[Any, float] = {}
    for kind in kinds:
        one = _live_bytes(spec, key, (kind,))[0]
        two = _live_bytes(spec, key, (kind, kind))[0]
        per_kind[kind] = two - one
    return per_kind


@functools.lru_cache(maxsize=64)
def _live_bytes(
    spec: ModelSpec, key: ActivationKey, kinds: tuple[Any, ...]
) -> tuple[float, float, float]:
    """Bytes alive when forward has returned the loss, the peak of forward (the loss included),
    and the peak from the forward through the loss's backward (up to the LM head's output
    gradient). Memoised: a one-layer model's run serves both the per-layer difference and the
    trace's peaks."""
    model = _prepare(build_layers_model(spec, kinds), key)
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model, torch.device("cpu"))
        ids = torch.randint(0, spec.vocab, (1, key.seq_len))
        kept = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(),
                                                               *model.buffers(), ids)}  # fmt: skip
        births = _Births(kept)
        autocast = torch.autocast("cpu", dtype=TORCH_DTYPES[COMPUTE_DTYPE], enabled=key.autocast)
        if key.loss == TRL_LOSS:
            return _live_bytes_fused(model, ids, births, autocast)
        with births:
            with autocast, unpacked_sequences(), _stop_at_the_logits(model) as logits_grad:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            end, forward_peak = births.sweep(), births.peak
            with contextlib.suppress(_LogitsGradReady):
                loss.backward()
            if not logits_grad:  # pragma: no cover - every causal LM has an LM head
                raise RuntimeError("the trace's backward never reached the LM head's output")
        del loss
    return float(end), float(forward_peak), float(births.peak)


def _live_bytes_fused(
    model: nn.Module, ids: torch.Tensor, births: _Births, autocast: Any
) -> tuple[float, float, float]:
    """`_live_bytes` of a model whose loss is TRL's fused LM head (`TRL_LOSS`), run around its
    stand-in (`autofit.builder.trl.traced_fused_head`): the bytes alive when forward has returned
    the loss (twice: the head's own forward peak is the estimator's, on top of them) and when the
    head's backward begins (the head's backward peak is the estimator's, on top of them)."""
    from autofit.builder.trl import fused_head_loss, traced_fused_head

    at_stop: list[int] = []

    def stop() -> None:
        at_stop.append(births.sweep())
        raise _LogitsGradReady

    with births, traced_fused_head(stop):
        with autocast, unpacked_sequences():
            loss = fused_head_loss(model, ids)
        end = births.sweep()
        with contextlib.suppress(_LogitsGradReady):
            loss.backward()
        del loss
    if not at_stop:  # pragma: no cover - the loss is the head's
        raise RuntimeError("the trace's backward never reached TRL's fused LM head")
    return float(end), float(end), float(at_stop[0])


@functools.lru_cache(maxsize=64)
def traced_step(
    spec: ModelSpec, key: ActivationKey, kinds: tuple[Any, ...]
) -> tuple[float, StepEvents]:
    """The peak of live bytes in a decoder layer's backward, per sequence, and the births and
    deaths of a whole micro-step in order (`StepEvents`, what the allocator model replays).

    The model of `kinds` (one layer, or more for a check of how layers compose) runs forward and
    its whole backward, the first layer's input made to
    need a gradient as every layer's but the first does (a LoRA model's embedding output does not,
    and the layer would skip its input gradient). The peak is read from the moment the layer's
    output has its gradient on: what the layer kept for backward (the caller takes that out:
    `per_kind`), the gradient flowing in, every transient of the layer's backward (the gradients
    of its activations in flight, the SwiGLU and attention backward's temporaries, under
    checkpointing the layer recomputed with all its activations) and what the layers share
    (rotary tables). Parameters' gradients are left out: the estimator counts them from the
    parameters (each unit's unsharded gradients, `layer_unit_grad_bytes`). The loss does not
    change it (the loss's tensors are freed before the layer's backward begins); the births and
    deaths between the layer's forward and its backward are the key's loss's, and what the
    chunked loss keeps once per micro-step (a trained head's gradient sum,
    `per_step_loss_tensors`) is among the `fixed` ones, which do not scale with the
    micro-batch."""
    model = _prepare(build_layers_model(spec, kinds), key)
    marks: dict[str, int] = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model, torch.device("cpu"))
        ids = torch.randint(0, spec.vocab, (1, key.seq_len))
        params = list(model.parameters())
        kept = {StorageWeakRef(t.untyped_storage()) for t in (*params, *model.buffers(), ids)}
        births = _Births(kept, series=True)
        series = births.series
        assert series is not None
        handles = _mark_the_layers(model, births, series, marks)
        autocast = torch.autocast("cpu", dtype=TORCH_DTYPES[COMPUTE_DTYPE], enabled=key.autocast)
        try:
            per_step = _forward_and_backward(model, ids, births, autocast, key)
        finally:
            for handle in handles:
                handle.remove()
        grads = _ParamGrads.of(params, births)
    if "backward_op" not in marks:  # pragma: no cover - every layer's output is in the loss
        raise RuntimeError("the trace's backward never reached the decoder layer's output")
    peak = grads.peak_without(series, marks["backward_op"])
    end = len(births.log)
    events = StepEvents(
        log=tuple(births.log),
        marks=(marks["forward"], marks["mid"], marks["backward"], marks.get("post", end)),
        fixed=frozenset(births.copy_ids | grads.ids | per_step),
        grads=frozenset(grads.ids),
    )
    return float(peak), events


def _mark_the_layers(
    model: nn.Module, births: _Births, series: list[int], marks: dict[str, int]
) -> list[RemovableHandle]:
    """Hooks that record in `marks` where in `births`' log the first layer's forward starts
    (`forward`), the last layer's forward ends (`mid`), the last layer's output gets its
    gradient (`backward`, and the op `backward_op` in `series`) and the first layer's input gets
    its gradient (`post`); and that make the embedding's output need a gradient. The caller
    removes them."""

    def mark(name: str) -> Any:
        def hook(*_: Any) -> None:
            marks.setdefault(name, len(births.log))
            if name == "backward":
                marks.setdefault("backward_op", len(series))

        return hook

    def needs_grad(_mod: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return out if out.requires_grad else out.detach().requires_grad_()

    def on_input(_mod: nn.Module, args: Any, kwargs: Any) -> None:
        marks.setdefault("forward", len(births.log))
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(mark("post"))

    def on_output(_mod: nn.Module, _args: Any, out: Any) -> None:
        marks.setdefault("mid", len(births.log))
        hidden = out[0] if isinstance(out, tuple) else out
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(mark("backward"))

    layers = decoder_layers(model)
    return [
        model.get_input_embeddings().register_forward_hook(needs_grad),
        layers[0].register_forward_pre_hook(on_input, with_kwargs=True),
        layers[-1].register_forward_hook(on_output),
    ]


def _forward_and_backward(
    model: nn.Module, ids: torch.Tensor, births: _Births, autocast: torch.autocast,
    key: ActivationKey,
) -> set[int]:  # fmt: skip
    """One micro-step (forward with the key's loss, its whole backward) recorded by `births`;
    the ids of the storages the loss keeps once per micro-step (`per_step_loss_tensors`)."""
    with births, _loss_context(key):
        with autocast, unpacked_sequences():
            loss = _loss(model, ids, key)
        per_step = {
            births.ids[ref]
            for t in per_step_loss_tensors(loss)
            if (ref := StorageWeakRef(t.untyped_storage())) in births.ids
        }
        loss.backward()
        del loss
        births.sweep()
    return per_step


@dataclasses.dataclass(frozen=True)
class _ParamGrads:
    """The parameters' gradients of a traced step: the op each was born at, its bytes, and the
    ids of those in the log."""

    born_at: list[int]
    sizes: list[int]
    ids: set[int]

    @classmethod
    def of(cls, params: list[nn.Parameter], births: _Births) -> _ParamGrads:
        """The gradients `params` hold after the step `births` recorded."""
        grads = [p.grad.untyped_storage() for p in params if p.grad is not None]
        born_at = [births.birth_op.get(StorageWeakRef(g), 0) for g in grads]
        sizes = [g.nbytes() for g in grads]
        ids = {births.ids[StorageWeakRef(g)] for g in grads if StorageWeakRef(g) in births.ids}
        return cls(born_at, sizes, ids)

    def peak_without(self, series: list[int], start: int) -> int:
        """The peak of the live bytes in `series` from op `start` on, less the gradients born by
        then (the estimator counts those from the parameters)."""
        peak = 0
        for t in range(start, len(series)):
            grad_bytes = sum(n for b, n in zip(self.born_at, self.sizes, strict=True) if b <= t)
            peak = max(peak, series[t] - grad_bytes)
        return peak


def step_events(spec: ModelSpec, key: ActivationKey) -> StepEvents:
    """The births and deaths of one micro-step of the one-layer model (`traced_step`), of the
    model's last layer type, per sequence, with the key's loss: what `autofit.estimate.slack`
    composes into a step (the layers' allocations do not depend on the loss, but the head's and
    the loss's between the layers' forward and backward do: the standard loss's tensors over the
    whole batch's vocabulary, or the chunked loss's one chunk at a time)."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # HF's deprecations, not the user's
            types = layer_types(spec)
            kind = types[-1] if types else None
            return traced_step(spec, key, (kind,))[1]
    finally:
        fake_log.setLevel(level)


def _loss_context(key: ActivationKey) -> contextlib.AbstractContextManager[None]:
    """What the key's loss runs inside: TRL's fused head around its stand-in (`TRL_LOSS`)."""
    if key.loss != TRL_LOSS:
        return contextlib.nullcontext()
    from autofit.builder.trl import traced_fused_head

    return traced_fused_head()


def _loss(model: nn.Module, ids: torch.Tensor, key: ActivationKey) -> torch.Tensor:
    """One sequence's loss as the key's loss computes it."""
    if key.loss == TRL_LOSS:
        from autofit.builder.trl import fused_head_loss

        return fused_head_loss(model, ids)
    return model(input_ids=ids, labels=ids, use_cache=False).loss


class _LogitsGradReady(Exception):
    """Raised in backward once the LM head's output has its gradient: the loss is done (with
    `chunked`, whose head returns the loss, before its backward hands on the hidden states'
    gradient computed in forward)."""


@contextlib.contextmanager
def _stop_at_the_logits(model: nn.Module) -> Iterator[list[bool]]:
    """Backward of the loss only: its start holds log-softmax's saved output beside the fp32
    gradients of the loss and of log-softmax, over the whole vocabulary, more than the forward's
    peak (measured: 12 B vs 10 B per logit). Backward stops when the LM head's output has its
    gradient, before any weight gradient or recomputed layer (counted elsewhere)."""
    reached: list[bool] = []

    def stop(_grad: torch.Tensor) -> None:
        reached.append(True)
        raise _LogitsGradReady

    def on_output(_mod: nn.Module, _args: Any, out: torch.Tensor) -> None:
        out.register_hook(stop)

    handle = model.get_output_embeddings().register_forward_hook(on_output)
    try:
        yield reached
    finally:
        handle.remove()


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Tell HF's mask code that the trace's ids are one sequence per row, as a trial's are.

    HF takes FakeTensors for a graph being traced (`is_tracing`), where it cannot read the
    position ids to rule out packed sequences (`find_packed_sequence_indices`), so it builds a
    causal mask that a real run skips (SDPA's `is_causal`, grouped-query attention inside the
    kernel): with the mask, every SDPA layer saves its k and v repeated per query head and a
    float copy of the seq x seq mask (+2-11% per layer without checkpointing at the debug
    presets' widths, measured against real tensors: bench/accuracy.py --trace). A real run of
    unpacked rows finds no packing and returns None: so does this."""
    from transformers import masking_utils

    if not hasattr(masking_utils, "find_packed_sequence_indices"):  # no packing detection
        yield
        return
    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda _ids: None):
        yield


def _prepare(model: nn.Module, key: ActivationKey) -> nn.Module:
    """The builder's steps up to sharding (`autofit.builder.apply.adapt`), with the dtypes a
    micro-step computes in: bf16 everywhere (FSDP2 gathers in bf16, pure bf16 stores it: the
    `bf16` precision), or under autocast fp32 trainable weights beside a bf16 frozen base (the
    plain module and DDP under `bf16-mixed`)."""
    from autofit.builder.apply import adapt, model_layout

    fused = key.loss == TRL_LOSS  # TRL's fused head replaces the model's own loss (after peft)
    config = Config(
        lora_rank=key.lora_rank,
        precision=Precision.BF16_MIXED if key.autocast else Precision.BF16,
        checkpointing=key.policy,
        lora_targets=key.lora_targets,
        lora_dropout=key.lora_dropout,
        loss=Loss.STANDARD if fused else key.loss,
        launch=Launch.TRAINER if key.adapter_casts else Launch.AUTOFIT,
    )
    layout = model_layout(model, config)  # one GPU, the plain module: autocast under bf16-mixed
    with torch.device("meta"):  # peft makes the adapters on the CPU, then moves them to meta
        model = adapt(model, config, layout)
    if fused:
        from autofit.builder.trl import add_fused_head

        add_fused_head(model)
    if key.kbit:
        as_kbit_prepared(model)
    model.train()
    return model


def as_kbit_prepared(model: nn.Module) -> None:
    """The traced model (bf16 projections on meta) computing as bitsandbytes QLoRA does once
    peft's `prepare_model_for_kbit_training` has run (`autofit.builder.trainer.trainer_model`):
    every parameter but the projections' base weights and the adapters upcast to fp32 (peft casts
    each fp16/bf16 parameter that is not a `Params4bit`: the embeddings, the norms, the LM head),
    and each base projection as `Linear4bit.forward` computes: its input cast to bf16 (the
    `compute_dtype`), the matmul in bf16 (`MatMul4Bit` saves none of its input and dequantizes
    the NF4 weight again in backward), the output cast back to the input's dtype. With an
    fp32 embedding output and fp32 norms the residual stream runs in fp32. The weight
    `MatMul4Bit`'s backward dequantizes is made there (`_Dequantizing`), so the estimate adds no
    `dequant_transient_bytes` to such a layer's backward (`autofit.estimate.peak`)."""
    compute = TORCH_DTYPES[COMPUTE_DTYPE]
    bases = {id(mod) for layer in decoder_layers(model) for _, mod in decoder_projections(layer)}
    for mod in model.modules():
        if id(mod) in bases:
            mod.forward = functools.partial(_bnb_forward, mod, compute)
    for name, param in model.named_parameters():
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if id(owner) in bases or "lora_" in name or param.dtype == torch.float32:
            continue
        param.data = param.data.to(torch.float32)


def _bnb_forward(linear: nn.Linear, compute: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes `Linear4bit.forward` of a plain `linear` (its NF4 weight dequantized to the
    weight's bf16): in `compute` (`_Dequantizing`, as `MatMul4Bit`), returned in the input's
    dtype."""
    out = _Dequantizing.apply(x.to(compute), linear.weight)
    if linear.bias is not None:
        out = out + linear.bias.to(compute)
    return out.to(x.dtype)


class _Dequantizing(torch.autograd.Function):
    """`x @ weight.T` of a frozen NF4 weight as bitsandbytes 0.50's `MatMul4Bit` runs it: it saves
    none of the input, and its backward dequantizes the weight (a bf16 copy, alive through the
    input gradient's matmul) before `grad @ weight`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight  # a parameter: alive anyway
        return nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        dequantized = torch.empty_like(ctx.weight, dtype=grad.dtype)
        out = grad @ ctx.weight.to(grad.dtype)
        del dequantized
        return out, None
