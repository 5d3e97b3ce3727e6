"""The knobs of a fine-tuning run and the rules between them.

`KNOBS` is the one table of knob names and allowed values; the search-space loader, the CLI flags,
validation and the exports all read it. `Config` is one point of the space.

`LORA_SETTINGS` are what the user chooses for LoRA and the search never varies: the same for every
candidate of a plan, yet part of each `Config` (the estimate counts them, the builder applies them).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError

from autofit.errors import ConfigError

# name -> allowed values (None: any positive integer). Order is the order shown to users.
KNOBS: dict[str, tuple[Any, ...] | None] = {
    "quant": ("none", "int8", "nf4"),
    "lora_rank": None,  # 0 = full fine-tune, else a positive rank
    "micro_batch": None,
    "grad_accum": None,
    "wrap": ("layer", "every-2", "every-4", "model", "none"),
    "shard": ("all", "node"),
    "reshard": (True, False),
    "checkpointing": ("none", "full", "every-2", "selective"),
    "offload": ("none", "optimizer", "params"),
    "optimizer": ("adamw", "adamw8bit", "adamw4bit"),
    "precision": ("bf16-mixed", "bf16"),
    "loss": ("standard", "chunked", "fused"),
    "compile": (False, True),
    "seq_len": None,
}

KNOB_HELP: dict[str, str] = {
    "quant": "storage of the frozen base weights (torchao); needs lora_rank > 0",
    "lora_rank": "0 = full fine-tune; r = LoRA on lora_targets (default: all linear projections)",
    "micro_batch": "sequences per GPU per forward/backward",
    "grad_accum": "micro-steps per optimizer step (derived from global_batch when given)",
    "wrap": "FSDP2 units: each decoder layer, groups of 2/4 layers, one unit; or none (one GPU: "
    "the plain module; several: DDP replicas)",
    "shard": "all = FSDP2 over every GPU; node = HSDP: a 2-D mesh that shards within each node "
    "and replicates across nodes (several nodes only)",
    "reshard": "reshard_after_forward (false keeps gathered params until backward)",
    "checkpointing": "activation checkpointing of decoder layers: all (full), every other "
    "(every-2), or op-level (selective: saves every matmul and attention output, recomputes the "
    "element-wise ops)",
    "offload": "params = FSDP2 CPUOffloadPolicy; optimizer = optimizer state and step on CPU",
    "optimizer": "torch AdamW or torchao low-bit AdamW",
    "precision": "bf16-mixed = fp32 master params + bf16 compute; bf16 = everything bf16",
    "loss": "standard = the model's own cross-entropy; chunked = LM head + cross-entropy over "
    "chunks of tokens, one chunk's fp32 logits live at a time (pure torch); fused = Liger's fused "
    "linear cross-entropy kernel (CUDA, pip install 'autofit[liger]')",
    "compile": "torch.compile each decoder layer (after checkpointing, before sharding, as "
    "torchtitan does); compile time is reported apart from training time",
    "seq_len": "tokens per sequence (fixed per plan)",
}

# Settings of a `Config` that are not searched: the user's choice, fixed for a whole plan.
LORA_SETTINGS = ("lora_alpha", "lora_targets", "lora_dropout", "train_embeddings")

SETTING_HELP: dict[str, str] = {
    "lora_alpha": "LoRA alpha (the adapter's scale is alpha / rank); default 2 x rank",
    "lora_targets": "modules LoRA adapts: leaf names (q_proj, v_proj, gate_up_proj) or paths "
    "inside a decoder layer (self_attn.q_proj), comma-separated; default all-linear (every "
    "linear projection of the decoder blocks)",
    "lora_dropout": "dropout on each adapted layer's input, >= 0 and < 1 (peft keeps a copy of "
    "that input, which costs memory); default 0",
    "train_embeddings": "with LoRA, also train the input embeddings and the LM head: none "
    "(default); full = a trainable copy of each beside the frozen original (peft "
    "modules_to_save); tokens:N = only the rows of the last N token ids, e.g. the tokens a chat "
    "template added (peft trainable_token_indices)",
}

# `train_embeddings` values: `none`, `full`, or `tokens:N` (the last N ids of the vocabulary).
TRAIN_EMBEDDINGS = ("none", "full")
TOKENS_PREFIX = "tokens:"

# `lora_targets` spellings of the default: every linear projection of the decoder blocks.
ALL_LINEAR = "all-linear"
_ALL_LINEAR_WORDS = (ALL_LINEAR, "all")
# a module name: a leaf (`q_proj`) or a dotted path inside a decoder layer (`self_attn.q_proj`)
_MODULE_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")

# Integer knobs and their least value.
_INT_KNOBS = {"lora_rank": 0, "micro_batch": 1, "grad_accum": 1, "seq_len": 1}


def wrap_group_size(wrap: str, n_layers: int) -> int:
    """Decoder layers per FSDP2 unit for a `wrap` value (`none` -> no units)."""
    if wrap == "layer":
        return 1
    if wrap.startswith("every-"):
        return int(wrap.split("-")[1])
    if wrap == "model":
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
    k = wrap_group_size(wrap, n_layers)
    if k == 0 or k >= n_layers:
        return ()
    return tuple(tuple(range(i, min(i + k, n_layers))) for i in range(0, n_layers, k))


class Sharding(str, enum.Enum):
    """How a run holds the model across its GPUs (what a trial reports as `sharding`)."""

    NONE = "none"  # one GPU, the plain module (train.py, torchtune single-device, HF Trainer)
    DDP = "ddp"  # replicas holding the weights once, gradients all-reduced (PyTorch DDP)
    FSDP2 = "fsdp2"  # `fully_shard` units laid out as torchtitan does

    def __str__(self) -> str:
        return self.value


def sharding_for(wrap: str, n_gpus: int) -> Sharding:
    """`wrap: none` is the plain module on one GPU and DDP replicas on several; any other wrap is
    FSDP2 (on one GPU a one-rank mesh, which only param offload or a measured win justifies).
    The builder and the estimator both read this rule."""
    if wrap == "none":
        return Sharding.NONE if n_gpus <= 1 else Sharding.DDP
    return Sharding.FSDP2


def mesh_shape(shard: str, n_gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(replicas, shard degree) of the FSDP2 mesh: `shard: all` shards over every GPU (one
    replica); `shard: node` is HSDP, torchtitan's `dp_replicate` x `dp_shard` mesh with the shard
    dimension inside a node and a replica per node. The builder's `init_device_mesh` and the
    estimator's shard degree and collectives read this. On one node both are the same mesh."""
    if shard == "node" and n_gpus > gpus_per_node >= 1 and n_gpus % gpus_per_node == 0:
        return n_gpus // gpus_per_node, gpus_per_node
    return 1, n_gpus


def fp32_trainable(precision: str, optimizer: str) -> bool:
    """Trainable (master) params in fp32: under bf16-mixed, and always with torchao's low-bit AdamW
    (its compiled step fails on bf16 params under FSDP2: `lerp`/`view(dtype)` on the quantized
    state), whose compute is still bf16. Otherwise bf16. The builder and the estimator read this."""
    return precision == "bf16-mixed" or optimizer != "adamw"


def uses_autocast(precision: str, optimizer: str, sharding: Sharding) -> bool:
    """bf16 autocast runs where fp32 trainable params are held by the plain module or DDP (HF
    Trainer's `bf16=True`, torchtune's single-device recipes); FSDP2 casts the gathered params
    through its `MixedPrecisionPolicy` instead, and bf16 params need no cast."""
    return sharding is not Sharding.FSDP2 and fp32_trainable(precision, optimizer)


LIGER_MODULE = "liger_kernel"
"""The import name of Liger's kernels (`pip install 'autofit[liger]'`), which `loss: fused` runs."""


def liger_installed() -> bool:
    """Whether Liger's kernels are importable here (found without importing them, or torch)."""
    import importlib.util

    return importlib.util.find_spec(LIGER_MODULE) is not None


def loss_unavailable(loss: str, device: str) -> str | None:
    """Why `loss` cannot run on `device` here (a short reason the space's skip count shows), or
    None: `fused` is Liger's Triton kernel, CUDA only, and an optional install."""
    if loss != "fused":
        return None
    if device != "cuda":
        return "loss=fused needs CUDA (Liger's Triton kernel); chunked is its pure-torch twin"
    if not liger_installed():
        return "loss=fused needs Liger: pip install 'autofit[liger]'"
    return None


def _text(value: Any) -> Any:
    """Choices and booleans are read case-insensitively, around spaces ('NF4', ' true ')."""
    return value.strip().lower() if isinstance(value, str) else value


def _not_bool(value: Any) -> Any:
    """`True` is not a count (pydantic's lax int would read it as 1)."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a whole number")
    return value


def knob_type(name: str) -> Any:
    """The pydantic type of one knob's value, from `KNOBS`: a `Literal` of its choices, a whole
    number >= its least value, or a boolean. `coerce_knob` and the space file's schema
    (`autofit.space.SpaceFile`) both validate with it."""
    allowed = KNOBS[name]
    if name in _INT_KNOBS:
        # the bound before the validator: the JSON schema then reads it as `minimum`
        return Annotated[int, Field(ge=_INT_KNOBS[name]), BeforeValidator(_not_bool)]
    assert allowed is not None
    if all(isinstance(v, bool) for v in allowed):
        return Annotated[bool, BeforeValidator(_text)]
    return Annotated[Literal[allowed], BeforeValidator(_text)]  # type: ignore[valid-type]


_ADAPTERS = {name: TypeAdapter(knob_type(name)) for name in KNOBS}


def knob_error(name: str, value: Any, where: str = "") -> str:
    """The sentence for a value `name` cannot take: the knob, the value and what is allowed."""
    place = f" in {where}" if where else ""
    if name in _INT_KNOBS:
        return f"Knob {name!r}{place} must be a whole number >= {_INT_KNOBS[name]}; got {value!r}."
    allowed = KNOBS[name]
    assert allowed is not None
    if all(isinstance(v, bool) for v in allowed):
        return f"Knob {name!r}{place} must be true or false; got {value!r}."
    from autofit.errors import did_you_mean

    text = str(value).strip().lower()
    return (
        f"Knob {name!r}{place} cannot be {value!r}.{did_you_mean(text, map(str, allowed))} "
        f"Allowed values: {', '.join(map(str, allowed))}."
    )


def unknown_knob_error(name: str, where: str = "") -> str:
    from autofit.errors import did_you_mean

    place = f" in {where}" if where else ""
    return (
        f"Unknown knob {name!r}{place}.{did_you_mean(name, [*KNOBS, *LORA_SETTINGS])} Knobs are: "
        f"{', '.join(KNOBS)}; settings: {', '.join(LORA_SETTINGS)}."
    )


def coerce_knob(name: str, value: Any, where: str = "") -> Any:
    """Check and convert one knob value; raise `ConfigError` naming the knob and allowed values."""
    adapter = _ADAPTERS.get(name)
    if adapter is None:
        raise ConfigError(unknown_knob_error(name, where))
    try:
        return adapter.validate_python(value)
    except ValidationError:
        raise ConfigError(knob_error(name, value, where)) from None


def _targets_problem(value: Any) -> tuple[tuple[str, ...] | None, str | None]:
    """(`lora_targets` normalised, None) or (None, why it cannot be)."""
    if value is None:
        return None, None
    if isinstance(value, str):
        if value.strip().lower() in _ALL_LINEAR_WORDS:
            return None, None
        items: list[Any] = value.split(",")
        if not any(item.strip() for item in items):
            return None, "it names no module"
    elif isinstance(value, list | tuple):
        items = list(value)
        if not items:
            return None, None  # an empty list: the default
    else:
        return None, "it is neither text nor a list of module names"
    names: list[str] = []
    for item in items:
        if not isinstance(item, str):
            return None, f"{item!r} is not a module name"
        name = item.strip()
        if name and name not in names:
            names.append(name)
    if not names:
        return None, "it names no module"
    if any(name.lower() in _ALL_LINEAR_WORDS for name in names):
        if len(names) == 1:
            return None, None
        return None, f"{ALL_LINEAR} already means every projection; give it alone"
    for name in names:
        if not _MODULE_NAME.fullmatch(name):
            return None, f"{name!r} is not a module name (letters, digits, _ and . only)"
    return tuple(names), None


def _number(value: Any) -> float | None:
    """A real number from a number or its text; None for anything else (booleans too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if not isinstance(value, numbers.Real):
        return None
    return float(value)


def _setting_problem(name: str, value: Any) -> tuple[Any, str | None]:
    """(the setting's normalised value, None), or (None, what is wrong with `value`)."""
    if name == "lora_targets":
        return _targets_problem(value)
    if name == "lora_dropout":
        number = _number(0.0 if value is None else value)
        if number is None or not 0 <= number < 1:  # NaN fails the test too
            return None, "out of range"
        return number, None
    if name == "lora_alpha":
        if value is None:
            return None, None
        number = _number(value)
        if number is None or not math.isfinite(number) or number != int(number) or number < 1:
            return None, "not a whole number"
        return int(number), None
    if name == "train_embeddings":
        return _train_embeddings_problem(value)
    raise ValueError(f"{name!r} is not a setting")  # pragma: no cover - a caller's bug


def _train_embeddings_problem(value: Any) -> tuple[str | None, str | None]:
    """(`train_embeddings` normalised: `none`, `full` or `tokens:N`, None) or (None, why not)."""
    if value is None:
        return "none", None
    if not isinstance(value, str):
        return None, "not text"
    text = "".join(value.split()).lower()  # `Tokens: 8` reads as tokens:8
    if text in TRAIN_EMBEDDINGS:
        return text, None
    if text.startswith(TOKENS_PREFIX):
        count = text[len(TOKENS_PREFIX) :]
        if count.isascii() and count.isdigit() and int(count) >= 1:
            return f"{TOKENS_PREFIX}{int(count)}", None
        return None, "N must be a whole number >= 1"
    return None, "unknown value"


def trained_token_count(train_embeddings: str) -> int | None:
    """N of a normalised `tokens:N` value; None for `none` and `full`."""
    if train_embeddings.startswith(TOKENS_PREFIX):
        return int(train_embeddings[len(TOKENS_PREFIX) :])
    return None


def trained_tokens_error(train_embeddings: str, vocab: int) -> str | None:
    """The sentence for a `tokens:N` that asks for more token ids than the model's vocabulary of
    `vocab` tokens has, or None."""
    count = trained_token_count(train_embeddings)
    if count is None or count <= vocab:
        return None
    return (
        f"train_embeddings={train_embeddings} trains the last {count} token ids, but this "
        f"model's vocabulary has {vocab:,} tokens. Use tokens:N with N <= {vocab} (the tokens "
        "your chat template added), or full to train every row."
    )


def setting_error(name: str, value: Any, where: str = "") -> str | None:
    """The sentence for a value setting `name` cannot take (the setting, the value and what is
    allowed), or None when it can take it."""
    _, why = _setting_problem(name, value)
    if why is None:
        return None
    place = f" in {where}" if where else ""
    if name == "lora_dropout":
        return (
            f"Setting 'lora_dropout'{place} must be a number >= 0 and < 1 (the share of each "
            f"adapted layer's input that LoRA drops, e.g. 0.05; 0 = no dropout); got {value!r}."
        )
    if name == "lora_alpha":
        return f"Setting 'lora_alpha'{place} must be a whole number >= 1; got {value!r}."
    if name == "train_embeddings":
        return (
            f"Setting 'train_embeddings'{place} cannot be {value!r} ({why}). Allowed: none (the "
            "default: embeddings and LM head frozen), full (a trainable copy of the input "
            "embeddings and of the LM head beside the frozen originals, peft modules_to_save), "
            "or tokens:N with N a whole number >= 1 (only the rows of the last N token ids, "
            "e.g. tokens:8 for the 8 tokens a chat template added; peft trainable_token_indices)."
        )
    return (
        f"Setting 'lora_targets'{place} cannot be {value!r}: {why}. Allowed: module names of the "
        "decoder layers, comma-separated or as a list, e.g. q_proj,v_proj (leaf names such as "
        f"q_proj or gate_up_proj, or paths inside a layer such as self_attn.q_proj); or "
        f"{ALL_LINEAR} for every linear projection of the decoder blocks (the default)."
    )


def coerce_setting(name: str, value: Any, where: str = "") -> Any:
    """Check and normalise one LoRA setting (`LORA_SETTINGS`); raise `ConfigError` naming the
    setting, the value and what is allowed. `lora_targets`: a tuple of module names, or None for
    every linear projection (`all-linear`, `all`, an empty list); `lora_dropout`: a float;
    `train_embeddings`: `none`, `full` or `tokens:N`."""
    problem = setting_error(name, value, where)
    if problem is not None:
        raise ConfigError(problem)
    return _setting_problem(name, value)[0]


@dataclass(frozen=True)
class Config:
    """One fine-tuning configuration: every knob of design.md with a value, and the LoRA
    settings (`LORA_SETTINGS`), which the user chooses and the search does not vary."""

    quant: str = "none"
    lora_rank: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    wrap: str = "layer"
    shard: str = "all"
    reshard: bool = True
    checkpointing: str = "none"
    offload: str = "none"
    optimizer: str = "adamw"
    precision: str = "bf16-mixed"
    loss: str = "standard"
    compile: bool = False
    seq_len: int = 2048
    lora_alpha: int | None = None  # None: 2 x lora_rank
    lora_targets: tuple[str, ...] | None = None  # None: every linear projection of the decoder
    lora_dropout: float = 0.0
    train_embeddings: str = "none"  # none | full | tokens:N (`LORA_SETTINGS`)

    def __post_init__(self) -> None:
        for name in KNOBS:
            object.__setattr__(self, name, coerce_knob(name, getattr(self, name)))
        for name in LORA_SETTINGS:
            object.__setattr__(self, name, coerce_setting(name, getattr(self, name)))
        problem = rule_violation(self)
        if problem:
            raise ConfigError(problem)

    @property
    def is_lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def alpha(self) -> int:
        """LoRA alpha: 2 x rank unless set."""
        return self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_rank

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def settings(self) -> dict[str, Any]:
        """The LoRA settings that differ from their defaults, JSON-ready (targets as a list)."""
        out: dict[str, Any] = {}
        if self.lora_alpha is not None:
            out["lora_alpha"] = self.lora_alpha
        if self.lora_targets is not None:
            out["lora_targets"] = list(self.lora_targets)
        if self.lora_dropout:
            out["lora_dropout"] = self.lora_dropout
        if self.train_embeddings != "none":
            out["train_embeddings"] = self.train_embeddings
        return out

    def to_dict(self) -> dict[str, Any]:
        """Every knob, then the settings that differ from their defaults."""
        return {**{name: getattr(self, name) for name in KNOBS}, **self.settings()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "") -> Config:
        unknown = set(data) - set(KNOBS) - set(LORA_SETTINGS)
        if unknown:
            coerce_knob(sorted(unknown)[0], None, where)  # raises with a did-you-mean hint
        values = {k: coerce_knob(k, v, where) for k, v in data.items() if k in KNOBS}
        for name in LORA_SETTINGS:
            if data.get(name) is not None:
                values[name] = coerce_setting(name, data[name], where)
        return cls(**values)

    def short(self) -> str:
        """A compact one-line label, e.g. 'nf4 r64 mb8x4 layer ckpt=full'."""
        parts = [self.quant if self.quant != "none" else ("lora" if self.is_lora else "full")]
        if self.is_lora:
            parts.append(f"r{self.lora_rank}")
        parts.append(f"mb{self.micro_batch}x{self.grad_accum}")
        parts.append(f"wrap={self.wrap}" + ("" if self.reshard else "/keep"))
        if self.shard == "node":
            parts.append("hsdp")
        if self.checkpointing != "none":
            parts.append(f"ckpt={self.checkpointing}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.precision != "bf16-mixed":
            parts.append(self.precision)
        if self.loss != "standard":
            parts.append(f"loss={self.loss}")
        if self.compile:
            parts.append("compiled")
        if self.is_lora and self.lora_targets is not None:
            parts.append(f"targets={','.join(self.lora_targets)}")
        if self.is_lora and self.lora_dropout:
            parts.append(f"drop={self.lora_dropout:g}")
        if self.train_embeddings != "none":
            parts.append(f"emb={self.train_embeddings}")
        return " ".join(parts)


def rule_violation(cfg: Config) -> str | None:
    """The first rule between knobs that `cfg` breaks, as a user-facing sentence, or None."""
    broken = broken_rule(cfg)
    return broken[1] if broken else None


def broken_rule(cfg: Config) -> tuple[str, str] | None:
    """(short reason, full sentence) of the first rule `cfg` breaks, or None."""
    if cfg.quant != "none" and cfg.lora_rank == 0:
        return (
            "quant needs LoRA",
            f"quant={cfg.quant} needs LoRA: a quantized base cannot be fully fine-tuned. "
            "Set lora_rank > 0 (e.g. 16 or 64), or use quant=none for a full fine-tune.",
        )
    if cfg.train_embeddings != "none" and cfg.lora_rank == 0:
        return (
            "train_embeddings needs LoRA",
            f"train_embeddings={cfg.train_embeddings} trains the input embeddings and LM head "
            "beside a frozen LoRA base, so it needs lora_rank > 0: a full fine-tune (lora_rank "
            "0) trains the embeddings and head already. Set lora_rank > 0 (e.g. 16 or 64), or "
            "train_embeddings=none for a full fine-tune.",
        )
    if cfg.offload == "params" and cfg.quant == "int8":
        return (
            "offload=params with int8",
            "offload=params cannot be combined with quant=int8: torchao's int8 weights stay out "
            "of FSDP2 sharding, so FSDP2's CPUOffloadPolicy cannot move them. Use quant=nf4, or "
            "offload=optimizer/none.",
        )
    if cfg.shard == "node" and cfg.wrap == "none":
        return (
            "shard=node without sharding",
            "shard=node (HSDP: shard within a node, replicate across nodes) needs FSDP2 "
            "(wrap=layer, every-2, every-4 or model): wrap=none runs DDP replicas, which hold "
            "everything on every GPU. Use shard=all with wrap=none.",
        )
    if cfg.offload == "params" and cfg.wrap == "none":
        return (
            "offload=params without sharding",
            "offload=params needs FSDP2 (wrap=layer, every-2, every-4 or model; on one GPU a "
            "one-rank FSDP2 mesh, as answer.ai offloads): wrap=none runs the plain module or DDP "
            "replicas, which keep the weights on the GPU.",
        )
    return None


def derive_grad_accum(global_batch: int, micro_batch: int, dp_size: int) -> int | None:
    """Micro-steps per optimizer step so micro_batch x grad_accum x dp_size == global_batch.

    Returns None when the division is not exact (that micro-batch cannot reach the global batch).
    """
    per_step = micro_batch * dp_size
    if global_batch <= 0 or global_batch % per_step:
        return None
    return global_batch // per_step
