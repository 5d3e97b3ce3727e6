"""The knobs of a fine-tuning run and the rules between them.

`KNOBS` is the one table of knob names and allowed values; the search-space loader, the CLI flags,
validation and the exports all read it. `Config` is one point of the space.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
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
    "reshard": (True, False),
    "checkpointing": ("none", "full", "every-2", "selective"),
    "offload": ("none", "optimizer", "params"),
    "optimizer": ("adamw", "adamw8bit", "adamw4bit"),
    "precision": ("bf16-mixed", "bf16"),
    "seq_len": None,
}

KNOB_HELP: dict[str, str] = {
    "quant": "storage of the frozen base weights (torchao); needs lora_rank > 0",
    "lora_rank": "0 = full fine-tune; r = LoRA on all attention and MLP projections",
    "micro_batch": "sequences per GPU per forward/backward",
    "grad_accum": "micro-steps per optimizer step (derived from global_batch when given)",
    "wrap": "FSDP2 units: each decoder layer, groups of 2/4 layers, one unit; or none (one GPU: "
    "the plain module; several: DDP replicas)",
    "reshard": "reshard_after_forward (false keeps gathered params until backward)",
    "checkpointing": "activation checkpointing of decoder layers: all (full), every other "
    "(every-2), or op-level (selective: saves every matmul and attention output, recomputes the "
    "element-wise ops)",
    "offload": "params = FSDP2 CPUOffloadPolicy; optimizer = optimizer state and step on CPU",
    "optimizer": "torch AdamW or torchao low-bit AdamW",
    "precision": "bf16-mixed = fp32 master params + bf16 compute; bf16 = everything bf16",
    "seq_len": "tokens per sequence (fixed per plan)",
}

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
        f"Unknown knob {name!r}{place}.{did_you_mean(name, KNOBS)} Knobs are: {', '.join(KNOBS)}."
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


@dataclass(frozen=True)
class Config:
    """One fine-tuning configuration: every knob of design.md with a value."""

    quant: str = "none"
    lora_rank: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    wrap: str = "layer"
    reshard: bool = True
    checkpointing: str = "none"
    offload: str = "none"
    optimizer: str = "adamw"
    precision: str = "bf16-mixed"
    seq_len: int = 2048
    lora_alpha: int | None = field(default=None, compare=True)
    lora_targets: tuple[str, ...] | None = None  # TEMP until the settings branch merges
    lora_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in KNOBS:
            object.__setattr__(self, name, coerce_knob(name, getattr(self, name)))
        if self.lora_alpha is not None:
            object.__setattr__(self, "lora_alpha", int(self.lora_alpha))
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

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in KNOBS}
        if self.lora_alpha is not None:
            out["lora_alpha"] = self.lora_alpha
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "") -> Config:
        unknown = set(data) - set(KNOBS) - {"lora_alpha"}
        if unknown:
            coerce_knob(sorted(unknown)[0], None, where)  # raises with a did-you-mean hint
        values = {k: coerce_knob(k, v, where) for k, v in data.items() if k in KNOBS}
        if "lora_alpha" in data and data["lora_alpha"] is not None:
            values["lora_alpha"] = int(data["lora_alpha"])
        return cls(**values)

    def short(self) -> str:
        """A compact one-line label, e.g. 'nf4 r64 mb8x4 layer ckpt=full'."""
        parts = [self.quant if self.quant != "none" else ("lora" if self.is_lora else "full")]
        if self.is_lora:
            parts.append(f"r{self.lora_rank}")
        parts.append(f"mb{self.micro_batch}x{self.grad_accum}")
        parts.append(f"wrap={self.wrap}" + ("" if self.reshard else "/keep"))
        if self.checkpointing != "none":
            parts.append(f"ckpt={self.checkpointing}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.precision != "bf16-mixed":
            parts.append(self.precision)
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
    if cfg.offload == "params" and cfg.quant == "int8":
        return (
            "offload=params with int8",
            "offload=params cannot be combined with quant=int8: torchao's int8 weights stay out "
            "of FSDP2 sharding, so FSDP2's CPUOffloadPolicy cannot move them. Use quant=nf4, or "
            "offload=optimizer/none.",
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
