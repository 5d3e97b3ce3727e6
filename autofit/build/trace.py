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
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autofit.arch import ActivationKey, LayerActivations
from autofit.build.dtypes import TORCH_DTYPES
from autofit.build.model import build_meta_model, materialize
from autofit.config import Config
from autofit.models import ModelSpec
from autofit.recipe import COMPUTE_DTYPE

_CASTS = {torch.ops.aten._to_copy.default}


class _Births(TorchDispatchMode):
    """Records the storage of every tensor an op creates (weakly), which are casts of a
    parameter (autocast's weight copies), and the peak of their live bytes after each op."""

    def __init__(self, kept: set[StorageWeakRef]) -> None:
        super().__init__()
        self.kept = kept
        self.born: dict[StorageWeakRef, int] = {}
        self.weight_copies: set[StorageWeakRef] = set()
        self.peak = 0

    def live(self) -> int:
        return sum(
            nbytes
            for ref, nbytes in self.born.items()
            if not ref.expired() and ref not in self.kept and ref not in self.weight_copies
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
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
                    self.born[ref] = storage.nbytes()
                if copy_of_param:
                    self.weight_copies.add(ref)
        self.born = {ref: n for ref, n in self.born.items() if not ref.expired()}
        self.peak = max(self.peak, self.live())
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
    types = _layer_types(spec)
    kinds = list(dict.fromkeys(types)) if types else [None]
    per_kind = _per_layer_kind(spec, dataclasses.replace(key, loss="standard"), tuple(kinds))
    _, forward_peak, peak = _live_bytes(spec, key, kinds)
    # outside the layers: the peak over the loss (standard, forward: bf16 logits, their fp32 copy
    # and log-softmax's output; the start of backward: log-softmax's output and two fp32
    # gradients over the vocabulary; chunked: one chunk's logits and their gradient beside the
    # hidden states' gradient) less what the layers keep
    root = peak - sum(per_kind.values())
    root_forward = forward_peak - sum(per_kind.values())
    if types:
        layer = sum(per_kind[t] for t in types) / len(types)
    else:
        layer = per_kind[None]
    return LayerActivations(
        layer=float(layer), root=float(max(root, 0.0)), root_forward=float(max(root_forward, 0.0))
    )


@functools.lru_cache(maxsize=64)
def _per_layer_kind(
    spec: ModelSpec, key: ActivationKey, kinds: tuple[Any, ...]
) -> dict[Any, float]:
    """What one layer of each type keeps: the two-layer model less the one-layer one. The loss
    does not change it (it runs after the layers), so every loss reads the standard one's."""
    per_kind: dict[Any, float] = {}
    for kind in kinds:
        one = _live_bytes(spec, key, [kind])[0]
        two = _live_bytes(spec, key, [kind, kind])[0]
        per_kind[kind] = two - one
    return per_kind


def _layer_types(spec: ModelSpec) -> list[str] | None:
    """The type of each layer (sliding or full attention) where the family has several."""
    config = spec.to_hf_config()
    types = getattr(config, "layer_types", None)
    return list(types) if types and len(set(types)) > 1 else None


def _live_bytes(
    spec: ModelSpec, key: ActivationKey, kinds: list[Any]
) -> tuple[float, float, float]:
    """Bytes alive when forward has returned the loss, the peak of forward (the loss included),
    and the peak from the forward through the loss's backward (up to the LM head's output
    gradient)."""
    overrides: dict[str, Any] = {"num_hidden_layers": len(kinds)}
    if kinds[0] is not None:
        overrides["layer_types"] = kinds
    model = build_meta_model(spec, spec.to_hf_config(**overrides))
    model = _prepare(model, key)
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model, torch.device("cpu"))
        ids = torch.randint(0, spec.vocab, (1, key.seq_len))
        kept = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(),
                                                               *model.buffers(), ids)}  # fmt: skip
        births = _Births(kept)
        autocast = torch.autocast("cpu", dtype=TORCH_DTYPES[COMPUTE_DTYPE], enabled=key.autocast)
        with births:
            with autocast, unpacked_sequences(), _stop_at_the_logits(model) as logits_grad:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            end, forward_peak = births.live(), births.peak
            with contextlib.suppress(_LogitsGradReady):
                loss.backward()
            if not logits_grad:  # pragma: no cover - every causal LM has an LM head
                raise RuntimeError("the trace's backward never reached the LM head's output")
        del loss
    return float(end), float(forward_peak), float(births.peak)


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
    """The builder's steps up to sharding (`autofit.build.apply.adapt`), with the dtypes a
    micro-step computes in: bf16 everywhere (FSDP2 gathers in bf16, pure bf16 stores it: the
    `bf16` precision), or under autocast fp32 trainable weights beside a bf16 frozen base (the
    plain module and DDP under `bf16-mixed`)."""
    from autofit.build.apply import adapt

    config = Config(
        lora_rank=key.lora_rank,
        precision="bf16-mixed" if key.autocast else "bf16",
        checkpointing=key.policy,
        lora_targets=key.lora_targets,
        lora_dropout=key.lora_dropout,
        loss=key.loss,
    )
    model = adapt(model, config, autocast=key.autocast)
    model.train()
    return model
