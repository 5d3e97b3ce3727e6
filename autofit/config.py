"""The knobs of a fine-tuning run, each declared once, and the rules between them.

A knob is something the search varies; a setting is the user's choice, the same for every
candidate of a plan (the LoRA alpha, targets, dropout and trained embeddings). Both are fields of
`Config`, and each field's declaration (`knob(...)`, `setting(...)`: default, allowed values or
least value, help, and its part of `Config.short()`'s label) is the only place that says so.
`KNOBS`, `KNOB_HELP`, `LORA_SETTINGS`, `SETTING_HELP` and `DECLARED` are read off it; the CLI
flags of every command (`autofit.cli`), the space file's schema (`autofit.space`), validation,
the labels, the exports and the README's knob table (which a test compares) all read those.
Adding a knob is one field here plus its builder and estimator terms.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError

from autofit.errors import ConfigError
from autofit.settings import OPTIMIZER_IMPLS, coerce_setting


@dataclass(frozen=True)
class Knob:
    """One knob or setting as declared on its `Config` field: everything that reads it (flags,
    schema, validation, labels, exports, docs) reads this."""

    name: str
    default: Any
    help: str  # one phrase, lower case, no final stop: the flag's and the schema's description
    choices: tuple[Any, ...] | None = None  # None: a whole number, `minimum` to `maximum`
    minimum: int | None = None
    searched: bool = True  # False: a setting, the same for every candidate of a plan
    metavar: str | None = None  # how a setting's flag names its value
    advice: str = ""  # what a flag's help adds: the next thing to try
    label: Callable[[Any], str | None] | None = None  # its part of `Config.short()`, if any
    maximum: int | None = None  # a whole number's largest value: past it no estimate means much

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def range_text(self) -> str:
        """What a whole-number knob allows, e.g. 'a whole number from 1 to 65,536'."""
        return f"a whole number from {self.minimum} to {self.maximum:,}"


_DECLARATION = "autofit.knob"  # the key of a field's metadata that holds its `Knob`


def knob(
    default: Any, help: str, *, choices: tuple[Any, ...] | None = None,
    minimum: int | None = None, maximum: int | None = None, advice: str = "",
    label: Callable[[Any], str | None] | None = None,
) -> Any:  # fmt: skip
    """A searched knob's field of `Config`; a whole number's bounds are `minimum` and `maximum`
    (both given, or `choices`)."""
    assert (choices is None) == (minimum is not None and maximum is not None), help
    declared = Knob("", default, help, choices, minimum, True, None, advice, label, maximum)
    return field(default=default, metadata={_DECLARATION: declared})


def setting(
    default: Any, help: str, *, metavar: str, label: Callable[[Any], str | None] | None = None
) -> Any:
    """A setting's field of `Config`: checked by `autofit.settings.coerce_setting`."""
    declared = Knob("", default, help, None, None, False, metavar, "", label)
    return field(default=default, metadata={_DECLARATION: declared})


MAX_COUNT = 65_536
"""The largest micro-batch and gradient accumulation a knob takes: 64 Ki, far past any run that
fits a GPU (a larger number is a typo, and its estimate would mean nothing)."""
MAX_LORA_RANK = 4096
"""The largest LoRA rank: wider than any published adapter. The estimate's layer trace grows with
the rank (measured on llama-70b, cold cache: rank 1,024 0.55 GB and 30 s, 4,096 1.0 GB and 87 s,
65,536 over 9.8 GB and still running after 135 s)."""
MAX_SEQ_LEN = 16_777_216
"""The longest sequence a knob takes: 16 Mi tokens, past the longest context of any model."""


@dataclass(frozen=True)
class Config:
    """One fine-tuning configuration: every knob with a value, and the settings
    (`LORA_SETTINGS`), which the user chooses and the search does not vary. Field order is the
    order users see (flags, tables, labels)."""

    quant: str = knob(
        "none", "storage of the frozen base weights (torchao); needs lora_rank > 0",
        choices=("none", "int8", "nf4"),
        label=lambda c: c.quant if c.quant != "none" else ("lora" if c.is_lora else "full"),
    )  # fmt: skip
    lora_rank: int = knob(
        0, "0 = full fine-tune; r = LoRA on lora_targets (default: all linear projections)",
        minimum=0, maximum=MAX_LORA_RANK, label=lambda c: f"r{c.lora_rank}" if c.is_lora else None,
    )  # fmt: skip
    micro_batch: int = knob(
        1, "sequences per GPU per forward/backward", minimum=1, maximum=MAX_COUNT,
        advice="If it runs out of memory: halve it and double --grad-accum, or add "
        "--checkpointing full.",
        label=lambda c: f"mb{c.micro_batch}x{c.grad_accum}",
    )  # fmt: skip
    grad_accum: int = knob(
        1, "micro-steps per optimizer step (derived from global_batch when given)", minimum=1,
        maximum=MAX_COUNT,
    )  # fmt: skip
    wrap: str = knob(
        "auto", "how the model is held: auto = none on one GPU, layer on several (resolved "
        "before anything is estimated or built); FSDP2 units: each decoder layer, groups of 2/4 "
        "layers, one unit; or none (one GPU: the plain module; several: DDP replicas)",
        choices=("auto", "layer", "every-2", "every-4", "model", "none"),
        label=lambda c: f"wrap={c.wrap}" + ("" if c.reshard else "/keep"),
    )  # fmt: skip
    shard: str = knob(
        "all", "all = FSDP2 over every GPU; node = HSDP: a 2-D mesh that shards within each node "
        "and replicates across nodes (several nodes only)",
        choices=("all", "node"), label=lambda c: "hsdp" if c.shard == "node" else None,
    )  # fmt: skip
    reshard: bool = knob(
        True, "reshard_after_forward (false keeps gathered params until backward)",
        choices=(True, False),
    )  # fmt: skip
    checkpointing: str = knob(
        "none", "activation checkpointing of decoder layers: all (full), every other "
        "(every-2), or op-level (selective: saves every matmul and attention output, recomputes "
        "the element-wise ops)",
        choices=("none", "full", "every-2", "selective"),
        label=lambda c: f"ckpt={c.checkpointing}" if c.checkpointing != "none" else None,
    )  # fmt: skip
    offload: str = knob(
        "none", "params = FSDP2 CPUOffloadPolicy; optimizer = optimizer state and step on CPU",
        choices=("none", "optimizer", "params"),
        label=lambda c: f"offload={c.offload}" if c.offload != "none" else None,
    )  # fmt: skip
    optimizer: str = knob(
        "adamw", "torch AdamW or torchao low-bit AdamW",
        choices=("adamw", "adamw8bit", "adamw4bit"),
        label=lambda c: c.optimizer if c.optimizer != "adamw" else None,
    )  # fmt: skip
    precision: str = knob(
        "bf16-mixed", "bf16-mixed = fp32 master params + bf16 compute; bf16 = everything bf16",
        choices=("bf16-mixed", "bf16"),
        label=lambda c: c.precision if c.precision != "bf16-mixed" else None,
    )  # fmt: skip
    loss: str = knob(
        "standard", "standard = the model's own cross-entropy; chunked = LM head + cross-entropy "
        "over chunks of tokens, one chunk's fp32 logits live at a time (pure torch); fused = "
        "Liger's fused linear cross-entropy kernel (CUDA, pip install 'autofit[liger]')",
        choices=("standard", "chunked", "fused"),
        label=lambda c: f"loss={c.loss}" if c.loss != "standard" else None,
    )  # fmt: skip
    compile: bool = knob(
        False, "torch.compile each decoder layer (after checkpointing, before sharding, as "
        "torchtitan does); compile time is reported apart from training time",
        choices=(False, True), label=lambda c: "compiled" if c.compile else None,
    )  # fmt: skip
    batching: str = knob(
        "padded", "how sequences of different lengths make micro-batches: padded = each "
        "micro-batch padded to its longest sequence, in dataset order; grouped = length-grouped "
        "micro-batches (HF Trainer's group_by_length); packed = sequences concatenated into rows "
        "of seq_len, attention and loss kept inside each document; searched only with the "
        "data's lengths (without them every sequence is seq_len and the three are one)",
        choices=("padded", "grouped", "packed"),
        label=lambda c: c.batching if c.batching != "padded" else None,
    )  # fmt: skip
    seq_len: int = knob(
        2048, "tokens per sequence (fixed per plan)", minimum=1, maximum=MAX_SEQ_LEN
    )
    lora_alpha: int | None = setting(
        None, "LoRA alpha (the adapter's scale is alpha / rank); default 2 x rank", metavar="INT"
    )
    lora_targets: tuple[str, ...] | None = setting(
        None, "modules LoRA adapts: leaf names (q_proj, v_proj, gate_up_proj) or paths inside a "
        "decoder layer (self_attn.q_proj), comma-separated; default all-linear (every linear "
        "projection of the decoder blocks)",
        metavar="NAMES",
        label=lambda c: (
            f"targets={','.join(c.lora_targets)}"
            if c.is_lora and c.lora_targets is not None else None
        ),
    )  # fmt: skip
    lora_dropout: float = setting(
        0.0, "dropout on each adapted layer's input, >= 0 and < 1 (peft keeps a copy of that "
        "input, which costs memory); default 0",
        metavar="FLOAT",
        label=lambda c: f"drop={c.lora_dropout:g}" if c.is_lora and c.lora_dropout else None,
    )  # fmt: skip
    train_embeddings: str = setting(
        "none", "with LoRA, also train the input embeddings and the LM head: none (default); "
        "full = a trainable copy of each beside the frozen original (peft modules_to_save); "
        "tokens:N = only the rows of the last N token ids, e.g. the tokens a chat template added "
        "(peft trainable_token_indices)",
        metavar="none|full|tokens:N",
        label=lambda c: f"emb={c.train_embeddings}" if c.train_embeddings != "none" else None,
    )  # fmt: skip
    optimizer_impl: str = setting(
        "auto", "how torch AdamW runs its step: auto (default) = fused where the parameters are "
        "on a GPU (fastest, no intermediate), torch's own choice elsewhere (its for-loop on "
        "CPU); fused; foreach (torch's default on CUDA, HF Trainer's adamw_torch: one "
        "intermediate the size of every trainable parameter); for-loop (torch's single-tensor "
        "step: two the size of the largest); optimizer=adamw only",
        metavar="|".join(OPTIMIZER_IMPLS),
        label=lambda c: f"adamw={c.optimizer_impl}" if c.optimizer_impl != "auto" else None,
    )  # fmt: skip

    def __post_init__(self) -> None:
        fields = self.__dict__  # a frozen dataclass's own fields, set once here
        for name, value in fields.items():
            checked = _checked(name, value)
            if checked is not value:
                fields[name] = checked
        problem = rule_violation(self)
        if problem:
            raise ConfigError(problem)

    @classmethod
    def of_checked_values(cls, fields: dict[str, Any]) -> Config:
        """A Config of every field's value, each already checked and normalised by its
        declaration (a loaded space's values), the rules between knobs not checked: what a
        space enumerates a few hundred thousand times, at a dict copy each (`__init__` checks
        every value and rule again: 25 us a config)."""
        cfg = object.__new__(cls)
        object.__setattr__(cfg, "__dict__", fields)
        return cfg

    @property
    def is_lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def alpha(self) -> int:
        """LoRA alpha: 2 x rank unless set."""
        return self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_rank

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def resolved(self, n_gpus: int) -> Config:
        """This config as it runs on `n_gpus` GPUs: `wrap: auto` replaced by the value it stands
        for there (`resolve_wrap`); a config with a real wrap is returned as it is."""
        if self.wrap != AUTO_WRAP:
            return self
        return self.replace(wrap=resolve_wrap(AUTO_WRAP, n_gpus, self.offload, self.shard))

    def settings(self) -> dict[str, Any]:
        """The settings that differ from their defaults, JSON-ready (targets as a list)."""
        out: dict[str, Any] = {}
        for name in LORA_SETTINGS:
            value = getattr(self, name)
            if value != DECLARED[name].default:
                out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_dict(self) -> dict[str, Any]:
        """Every knob, then the settings that differ from their defaults."""
        return {**{name: getattr(self, name) for name in KNOBS}, **self.settings()}

    @classmethod
    def of(cls, value: Any, what: str) -> Config:
        """`value` as a Config: a Config, or a mapping of knobs and settings (`Config.to_dict()`,
        a plan's `config:`); anything else is a `TypeError` naming it (`what`: the call)."""
        if isinstance(value, Config):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(dict(value))
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise TypeError(
            f"{what}: config must be an autofit.Config or a dict of knobs and settings (e.g. "
            f"plan.best.config, autofit.load_plan(path).best.config, or {{'lora_rank': 16, "
            f"'micro_batch': 4}}); got {type(value).__name__} {shown}."
        )

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
        """A compact one-line label, e.g. 'nf4 r64 mb8x4 wrap=layer ckpt=full': each declared
        knob's and setting's part (`Knob.label`), in field order."""
        return " ".join(part for d in _LABELLED if (part := d.label(self)))  # type: ignore[misc]


DECLARED: dict[str, Knob] = {
    f.name: dataclasses.replace(f.metadata[_DECLARATION], name=f.name)
    for f in dataclasses.fields(Config)
}
"""Every knob and setting by name, in field order, as declared."""
KNOBS: dict[str, tuple[Any, ...] | None] = {
    name: d.choices for name, d in DECLARED.items() if d.searched
}
"""Knob name -> allowed values (None: a whole number >= its least value), in the users' order."""
KNOB_HELP: dict[str, str] = {name: DECLARED[name].help for name in KNOBS}
LORA_SETTINGS: tuple[str, ...] = tuple(name for name, d in DECLARED.items() if not d.searched)
"""The settings: the user's choice, the same for every candidate of a plan."""
SETTING_HELP: dict[str, str] = {name: DECLARED[name].help for name in LORA_SETTINGS}
_INT_KNOBS: dict[str, Knob] = {
    name: d for name in KNOBS if (d := DECLARED[name]).minimum is not None
}
_LABELLED = tuple(d for d in DECLARED.values() if d.label is not None)


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


AUTO_WRAP = "auto"
"""`wrap`'s default: how the best recipes hold the model on the GPUs at hand (`resolve_wrap`)."""


def resolve_wrap(wrap: str, n_gpus: int, offload: str = "none", shard: str = "all") -> str:
    """The wrap `wrap: auto` stands for on `n_gpus` GPUs: the plain module (`none`) on one GPU,
    as torchtune's single-device recipes and HF Trainer run it, and FSDP2 per decoder layer
    (`layer`, torchtitan's layout) on several; also `layer` where a knob needs FSDP2 (`offload:
    params`, `shard: node`). Any other value is itself. The estimator, the builder, a trial and a
    space resolve `auto` with this before anything reads the wrap (`Config.resolved`)."""
    if wrap != AUTO_WRAP:
        return wrap
    needs_fsdp = offload == "params" or shard == "node"
    return "none" if n_gpus <= 1 and not needs_fsdp else "layer"


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


def shard_unavailable(shard: str, nodes: int) -> str | None:
    """Why one config (an estimate, a trial) cannot take `shard` on `nodes` nodes, or None:
    `shard: node` replicates across nodes, so on one it would be `shard: all` labelled HSDP. (A
    space keeps only `all` there instead: `Space.knobs_on`.)"""
    if shard != "node" or nodes > 1:
        return None
    return (
        "shard=node (HSDP: shard within each node, replicate across nodes) needs several nodes; "
        "on one node it is the same mesh as shard=all. Use shard=all (the default), or name "
        "several nodes with --gpus NxKxNAME (e.g. 2x8xh100-80gb) or --device cpu --gpus NxK."
    )


def lora_settings_unused(settings: dict[str, Any], lora_ranks: Any) -> str | None:
    """Why LoRA settings (`Config.settings()`: alpha, targets, dropout) cannot be given where
    every rank in `lora_ranks` is 0, or None: a full fine-tune has no adapter to carry them.
    (`train_embeddings` has a rule of its own, `broken_rule`.)"""
    given = {k: v for k, v in settings.items() if k != "train_embeddings"}
    if not given or any(rank > 0 for rank in lora_ranks):
        return None
    shown = ", ".join(
        f"{k}={','.join(v) if isinstance(v, list | tuple) else v}" for k, v in given.items()
    )
    return (
        f"{shown} configure{'s' if len(given) == 1 else ''} LoRA adapters, but lora_rank=0 is a "
        "full fine-tune, which has none. Set lora_rank > 0 (e.g. 16 or 64) for LoRA, or leave "
        "the LoRA settings out for a full fine-tune."
    )


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
        # the bounds before the validator: the JSON schema then reads them as `minimum`, `maximum`
        d = _INT_KNOBS[name]
        return Annotated[int, Field(ge=d.minimum, le=d.maximum), BeforeValidator(_not_bool)]
    assert allowed is not None
    if all(isinstance(v, bool) for v in allowed):
        return Annotated[bool, BeforeValidator(_text)]
    return Annotated[Literal[allowed], BeforeValidator(_text)]  # type: ignore[valid-type]


_ADAPTERS = {name: TypeAdapter(knob_type(name)) for name in KNOBS}


def knob_error(name: str, value: Any, where: str = "") -> str:
    """The sentence for a value `name` cannot take: the knob, the value and what is allowed."""
    place = f" in {where}" if where else ""
    if name in _INT_KNOBS:
        return f"Knob {name!r}{place} must be {_INT_KNOBS[name].range_text}; got {value!r}."
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


def _checked(name: str, value: Any) -> Any:
    """A field's value checked and normalised by its declaration (`coerce_knob`,
    `coerce_setting`), remembered per (name, type, value): a space makes a few hundred thousand
    configs of a few dozen distinct values, each checked once."""
    try:
        return _checked_value(name, type(value), value)
    except TypeError:  # unhashable (a list of targets): checked every time
        return (coerce_knob if DECLARED[name].searched else coerce_setting)(name, value)


@lru_cache(maxsize=4096)
def _checked_value(name: str, kind: type, value: Any) -> Any:
    # `kind` in the key: True == 1, yet a count may not be a boolean
    return (coerce_knob if DECLARED[name].searched else coerce_setting)(name, value)


QUANT_NEEDS_LORA = "quant needs LoRA"
"""The short reason of the first rule, which a space also applies to whole blocks of configs."""


def quant_without_lora(quant: str, lora_rank: int) -> bool:
    """A quantized base cannot be fully fine-tuned: `quant` needs `lora_rank > 0`."""
    return quant != "none" and lora_rank == 0


def rule_violation(cfg: Config) -> str | None:
    """The first rule between knobs that `cfg` breaks, as a user-facing sentence, or None."""
    broken = broken_rule(cfg)
    return broken[1] if broken else None


def broken_rule(cfg: Config) -> tuple[str, str] | None:
    """(short reason, full sentence) of the first rule `cfg` breaks, or None."""
    if quant_without_lora(cfg.quant, cfg.lora_rank):
        return (
            QUANT_NEEDS_LORA,
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
    if cfg.optimizer_impl != "auto" and cfg.optimizer != "adamw":
        return (
            "optimizer_impl without torch AdamW",
            f"optimizer_impl={cfg.optimizer_impl} chooses how torch's AdamW runs its step, and "
            f"optimizer={cfg.optimizer} is torchao's low-bit AdamW, which has one step of its "
            "own (compiled, one parameter at a time). Use optimizer=adamw, or optimizer_impl=auto.",
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
