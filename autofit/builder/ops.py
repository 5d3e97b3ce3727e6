"""Count the ops one micro-step dispatches: what the host issues, one kernel launch (or more) each.

At a small micro-batch a GPU step is bound by the host issuing kernels (issue 33: a 7B LoRA r64
step at micro-batch 1 took as long as its ~20,700 dispatched ops at ~18 us each, an NF4 one its
~37,200). The count is read from the real model as the layer traces are (`autofit.builder.trace`):
the model of `spec` with one decoder layer of each type, then two, set up by the builder's own
steps (`autofit.builder.apply.prepare`: dtypes, quantization, LoRA and its dropout, the loss,
checkpointing), runs one forward with the loss and its backward (recomputation included) under a
`TorchDispatchMode` that counts every aten op it sees. The difference between the two models is
one layer; the rest is the root (embedding, rotary tables, masks, final norm, head, loss).

An op of a dense layer is one op whatever its shapes, so the count runs at a reduced width
(`reduced`: two key-value heads, head_dim 8, MLP 64, vocab 128, 16 tokens) on real CPU tensors, a
second or two per key; `tests/builder/test_ops.py` holds it to a count at the real width. A
family whose op count follows its shapes (HF's MoE loop over the experts a token is routed to) is
counted as the reduced model routes its tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autofit.builder.dtypes import TORCH_DTYPES
from autofit.builder.model import build_layers_model, layer_types
from autofit.config import Config
from autofit.models import ModelSpec
from autofit.recipe import COMPUTE_DTYPE
from autofit.structure import OpsKey, StepOps
from autofit.values import Precision, Wrap

__all__ = ["OpCounter", "count_step_ops", "reduced"]

# The reduced width the ops are counted at (`reduced`): small enough to run in milliseconds, large
# and even enough for every block size (NF4's blocks of 64, RoPE's halves).
REDUCED_HIDDEN = 64
REDUCED_HEAD_DIM = 8
REDUCED_MLP = 64
REDUCED_VOCAB = 128
SEQ_LEN = 16
LORA_RANK = 4  # any rank > 0: the rank shapes LoRA's matmuls, not their number
LORA_DROPOUT = 0.1  # any p > 0: peft's `nn.Dropout` instead of `nn.Identity`


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active (`ops`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def reduced(spec: ModelSpec) -> ModelSpec:
    """`spec` at a reduced width: two key-value heads (one would make some of HF's reshapes of a
    size-1 dimension views, not copies: a layer one op short) and as many query heads per
    key-value head as it has (whether HF repeats the keys and values is kept: `repeat_kv` is an op
    only then), 8 values per head, a width of at least `REDUCED_HIDDEN` that is a multiple of the
    heads (HF checks it), its layer types and family keys kept: the ops a layer dispatches, not
    their shapes. Named for none of them, so presets of one family share their counts."""
    heads = 2 * max(spec.heads // max(spec.kv_heads, 1), 1)
    return dataclasses.replace(
        spec,
        name="reduced",
        description="",
        layers=1,
        heads=heads,
        kv_heads=2,
        hidden=heads * REDUCED_HEAD_DIM * -(-REDUCED_HIDDEN // (heads * REDUCED_HEAD_DIM)),
        intermediate=REDUCED_MLP,
        vocab=REDUCED_VOCAB,
        head_dim_override=REDUCED_HEAD_DIM,
        max_position=4096,
        rope_theta=10000.0,
        norm_eps=1e-5,
    )


def step_config(key: OpsKey) -> Config:
    """The config whose micro-step the count of `key` runs: one GPU, the plain module."""
    return Config(
        quant=key.quant,
        lora_rank=LORA_RANK if key.lora else 0,
        lora_targets=key.lora_targets,
        lora_dropout=LORA_DROPOUT if key.dropout else 0.0,
        precision=Precision.BF16_MIXED if key.autocast else Precision.BF16,
        checkpointing=key.policy,
        loss=key.loss,
        wrap=Wrap.NONE,
    )


def count_step_ops(spec: ModelSpec, key: OpsKey, *, width: str = "reduced") -> StepOps:
    """The ops one micro-step of `spec` dispatches for `key`, per decoder layer (the mean over its
    layer types, weighted by their counts) and outside the layers; `width="real"` counts at the
    model's own width (what the test of the reduced count compares with)."""
    if width == "reduced":
        return _count_reduced(reduced(spec), key)
    return _count(spec, key)


@functools.lru_cache(maxsize=256)
def _count_reduced(spec: ModelSpec, key: OpsKey) -> StepOps:
    """`_count` of a reduced spec, once per process for specs of one family that reduce alike."""
    return _count(spec, key)


def _count(model_spec: ModelSpec, key: OpsKey) -> StepOps:
    types = layer_types(model_spec)
    kinds = list(dict.fromkeys(types)) if types else [None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's and torchao's notices, not the user's
        one = {k: step_ops(model_spec, key, (k,)) for k in kinds}
        per_kind = {k: step_ops(model_spec, key, (k, k)) - one[k] for k in kinds}
    if types:
        counts = Counter(types)
        layer = sum(per_kind[t] * n for t, n in counts.items()) / len(types)
    else:
        layer = per_kind[None]
    last = kinds[-1]
    return StepOps(layer=float(layer), root=float(one[last] - per_kind[last]))


def step_ops(spec: ModelSpec, key: OpsKey, kinds: tuple[Any, ...]) -> int:
    """The ops of one forward with the loss and its backward of `spec`'s model with one decoder
    layer per entry of `kinds`, set up by the builder for `key` on the CPU."""
    from autofit.builder.apply import prepare

    model, layout = prepare(
        build_layers_model(spec, kinds), step_config(key), torch.device("cpu"), 1
    )
    model.train()
    torch.manual_seed(0)
    ids = torch.randint(0, spec.vocab, (1, SEQ_LEN))
    autocast = torch.autocast("cpu", dtype=TORCH_DTYPES[COMPUTE_DTYPE], enabled=layout.autocast)
    counter = OpCounter()
    with counter:
        with autocast:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return counter.ops
