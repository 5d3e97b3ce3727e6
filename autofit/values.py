"""The words a knob or a setting takes, each declared once as a `StrEnum` member.

`autofit.config` declares each knob with `choices=values(Offload)`, and code that asks what a
config does compares with a member (`cfg.offload == Offload.PARAMS`), never with the word: a
value renamed or added here is renamed or added everywhere, and `grep` finds who reads it.

A member is a `str` equal to its word (`Offload.PARAMS == "params"`, the same hash), so a config
keeps plain strings (its JSON, YAML and labels are unchanged) and either side of a comparison may
be the word a user typed. Plain data: no torch, nothing of autofit's.
"""

from __future__ import annotations

import enum


class Quant(enum.StrEnum):
    """`quant`: how the frozen base weights are stored."""

    NONE = "none"
    INT8 = "int8"
    NF4 = "nf4"


class Wrap(enum.StrEnum):
    """`wrap`: how the model is held on its GPUs (`autofit.layout.resolve_wrap` decides `auto`)."""

    AUTO = "auto"
    LAYER = "layer"
    EVERY_2 = "every-2"
    EVERY_4 = "every-4"
    MODEL = "model"
    NONE = "none"


class Shard(enum.StrEnum):
    """`shard`: FSDP2 over every GPU, or HSDP (shard within a node, replicate across nodes)."""

    ALL = "all"
    NODE = "node"


class Checkpointing(enum.StrEnum):
    """`checkpointing`: which decoder layers recompute their activations in backward."""

    NONE = "none"
    FULL = "full"
    EVERY_2 = "every-2"
    SELECTIVE = "selective"


class Offload(enum.StrEnum):
    """`offload`: what lives on the host."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    PARAMS = "params"


class Optimizer(enum.StrEnum):
    """`optimizer`: torch AdamW, or torchao's low-bit AdamW."""

    ADAMW = "adamw"
    ADAMW8BIT = "adamw8bit"
    ADAMW4BIT = "adamw4bit"


class Precision(enum.StrEnum):
    """`precision`: fp32 master weights with bf16 compute, or everything bf16."""

    BF16_MIXED = "bf16-mixed"
    BF16 = "bf16"


class Loss(enum.StrEnum):
    """`loss`: the model's own cross-entropy, autofit's chunked one, or Liger's fused kernel."""

    STANDARD = "standard"
    CHUNKED = "chunked"
    FUSED = "fused"


class Batching(enum.StrEnum):
    """`batching`: how sequences of different lengths make micro-batches."""

    PADDED = "padded"
    GROUPED = "grouped"
    PACKED = "packed"


class OptimizerImpl(enum.StrEnum):
    """The `optimizer_impl` setting: how torch AdamW runs its step (`auto`: `recipe.adamw_impl`)."""

    AUTO = "auto"
    FUSED = "fused"
    FOREACH = "foreach"
    FOR_LOOP = "for-loop"


class QuantBackend(enum.StrEnum):
    """The `quant_backend` setting: the library that stores `quant: nf4` weights."""

    TORCHAO = "torchao"
    BITSANDBYTES = "bitsandbytes"


class BnbQuantStorage(enum.StrEnum):
    """The `bnb_4bit_quant_storage` setting: the dtype bitsandbytes views its packed codes as."""

    UINT8 = "uint8"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class Launch(enum.StrEnum):
    """The `launch` setting: whose training loop runs the config."""

    AUTOFIT = "autofit"
    TRAINER = "trainer"
    TRL = "trl"


class TrainEmbeddings(enum.StrEnum):
    """The words of the `train_embeddings` setting (its third form is `tokens:N`)."""

    NONE = "none"
    FULL = "full"


def values(words: type[enum.StrEnum]) -> tuple[str, ...]:
    """A knob's choices as the plain words users type, in declaration order (a setting's first
    word is its default: `autofit.config` declares it so and a test holds the two together)."""
    return tuple(member.value for member in words)
