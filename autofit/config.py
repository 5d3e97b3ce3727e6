"""The knobs of a fine-tuning run, each declared once, and the rules between them.

A knob is something the search varies; a setting is the user's choice, the same for every
candidate of a plan (the LoRA alpha, targets, dropout and trained embeddings, and how torch
AdamW runs its step). Both are fields of `Config`, and each field's declaration (`knob(...)`,
`setting(...)`: default, allowed values or least value, help, and its part of `Config.short()`'s
label) is the only place that says so. `KNOBS`, `KNOB_HELP`, `LORA_SETTINGS`, `SETTING_HELP` and
`DECLARED` are read off it; the CLI flags of every command (`autofit.cli`), the space file's
schema (`autofit.space_file`), validation, the labels, the exports and the README's knob table
(which a test compares) all read those.
Adding a knob is one field here plus its builder and estimator terms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError

from autofit.checks import MAX_SEQ_LEN
from autofit.errors import ConfigError
from autofit.layout import resolve_wrap
from autofit.rules import rule_violation
from autofit.settings import WORD_SETTINGS, coerce_setting
from autofit.values import (
    Batching,
    BnbQuantStorage,
    Checkpointing,
    Launch,
    Loss,
    Offload,
    Optimizer,
    OptimizerImpl,
    Precision,
    Quant,
    QuantBackend,
    Shard,
    TrainEmbeddings,
    Wrap,
    values,
)


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


def word_setting(name: str, label: Callable[[Any], str | None]) -> Any:
    """A setting that takes one of a few words (`autofit.settings.WORD_SETTINGS[name]`): its
    first word the default, its help made of the words' meanings."""
    words = WORD_SETTINGS[name]
    return setting(words.default, words.help(), metavar=words.metavar, label=label)


MAX_COUNT = 65_536
"""The largest micro-batch and gradient accumulation a knob takes: 64 Ki, far past any run that
fits a GPU (a larger number is a typo, and its estimate would mean nothing)."""
MAX_LORA_RANK = 4096
"""The largest LoRA rank: wider than any published adapter. The estimate's layer trace grows with
the rank (measured on llama-70b, cold cache: rank 1,024 0.55 GB and 30 s, 4,096 1.0 GB and 87 s,
65,536 over 9.8 GB and still running after 135 s)."""


@dataclass(frozen=True)
class Config:
    """One fine-tuning configuration: every knob with a value, and the settings
    (`LORA_SETTINGS`), which the user chooses and the search does not vary. Field order is the
    order users see (flags, tables, labels)."""

    quant: str = knob(
        Quant.NONE.value, "storage of the frozen base weights (torchao); needs lora_rank > 0",
        choices=values(Quant),
        label=lambda c: c.quant if c.quant != Quant.NONE else ("lora" if c.is_lora else "full"),
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
        Wrap.AUTO.value,
        "how the model is held: auto = none on one GPU, layer on several (resolved "
        "before anything is estimated or built); FSDP2 units: each decoder layer, groups of 2/4 "
        "layers, one unit; or none (one GPU: the plain module; several: DDP replicas)",
        choices=values(Wrap),
        label=lambda c: f"wrap={c.wrap}" + ("" if c.reshard else "/keep"),
    )  # fmt: skip
    shard: str = knob(
        Shard.ALL.value,
        "all = FSDP2 over every GPU; node = HSDP: a 2-D mesh that shards within each node "
        "and replicates across nodes (several nodes only)",
        choices=values(Shard), label=lambda c: "hsdp" if c.shard == Shard.NODE else None,
    )  # fmt: skip
    reshard: bool = knob(
        True, "reshard_after_forward (false keeps gathered params until backward)",
        choices=(True, False),
    )  # fmt: skip
    checkpointing: str = knob(
        Checkpointing.NONE.value,
        "activation checkpointing of decoder layers: all (full), every other "
        "(every-2), or op-level (selective: saves every matmul and attention output, recomputes "
        "the element-wise ops)",
        choices=values(Checkpointing),
        label=lambda c: (
            f"ckpt={c.checkpointing}" if c.checkpointing != Checkpointing.NONE else None
        ),
    )  # fmt: skip
    offload: str = knob(
        Offload.NONE.value,
        "params = FSDP2 CPUOffloadPolicy; optimizer = optimizer state and step on CPU",
        choices=values(Offload),
        label=lambda c: f"offload={c.offload}" if c.offload != Offload.NONE else None,
    )  # fmt: skip
    optimizer: str = knob(
        Optimizer.ADAMW.value, "torch AdamW or torchao low-bit AdamW",
        choices=values(Optimizer),
        label=lambda c: c.optimizer if c.optimizer != Optimizer.ADAMW else None,
    )  # fmt: skip
    precision: str = knob(
        Precision.BF16_MIXED.value,
        "bf16-mixed = fp32 master params + bf16 compute; bf16 = everything bf16",
        choices=values(Precision),
        label=lambda c: c.precision if c.precision != Precision.BF16_MIXED else None,
    )  # fmt: skip
    loss: str = knob(
        Loss.STANDARD.value,
        "standard = the model's own cross-entropy; chunked = LM head + cross-entropy "
        "over chunks of tokens, one chunk's fp32 logits live at a time (pure torch); fused = "
        "Liger's fused linear cross-entropy kernel (CUDA, pip install 'autofit[liger]')",
        choices=values(Loss),
        label=lambda c: f"loss={c.loss}" if c.loss != Loss.STANDARD else None,
    )  # fmt: skip
    compile: bool = knob(
        False, "torch.compile each decoder layer (after checkpointing, before sharding, as "
        "torchtitan does); compile time is reported apart from training time",
        choices=(False, True), label=lambda c: "compiled" if c.compile else None,
    )  # fmt: skip
    batching: str = knob(
        Batching.PADDED.value,
        "how sequences of different lengths make micro-batches: padded = each "
        "micro-batch padded to its longest sequence, in dataset order; grouped = length-grouped "
        "micro-batches (HF Trainer's group_by_length); packed = sequences concatenated into rows "
        "of seq_len, attention and loss kept inside each document; searched only with the "
        "data's lengths (without them every sequence is seq_len and the three are one)",
        choices=values(Batching),
        label=lambda c: c.batching if c.batching != Batching.PADDED else None,
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
        TrainEmbeddings.NONE.value,
        "with LoRA, also train the input embeddings and the LM head: none (default); "
        "full = a trainable copy of each beside the frozen original (peft modules_to_save); "
        "tokens:N = only the rows of the last N token ids, e.g. the tokens a chat template added "
        "(peft trainable_token_indices)",
        metavar="none|full|tokens:N",
        label=lambda c: (
            f"emb={c.train_embeddings}" if c.train_embeddings != TrainEmbeddings.NONE else None
        ),
    )  # fmt: skip
    optimizer_impl: str = word_setting(
        "optimizer_impl",
        label=lambda c: (
            f"adamw={c.optimizer_impl}" if c.optimizer_impl != OptimizerImpl.AUTO else None
        ),
    )  # fmt: skip
    quant_backend: str = word_setting(
        "quant_backend",
        label=lambda c: "bnb" if c.quant_backend == QuantBackend.BITSANDBYTES else None,
    )  # fmt: skip
    bnb_4bit_use_double_quant: bool = setting(
        False, "bitsandbytes double quantization (BitsAndBytesConfig's bnb_4bit_use_double_quant): "
        "NF4's fp32 absmax scales stored as 8-bit codes; default false; "
        "quant_backend=bitsandbytes only",
        metavar="true|false", label=lambda c: "dq" if c.bnb_4bit_use_double_quant else None,
    )  # fmt: skip
    bnb_4bit_quant_storage: str = word_setting(
        "bnb_4bit_quant_storage",
        label=lambda c: (
            f"storage={c.bnb_4bit_quant_storage}"
            if c.bnb_4bit_quant_storage != BnbQuantStorage.UINT8
            else None
        ),
    )  # fmt: skip
    launch: str = word_setting(
        "launch",
        label=lambda c: f"launch={c.launch}" if c.launch != Launch.AUTOFIT else None,
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
        wrap = resolve_wrap(self.wrap, n_gpus, self.offload, self.shard, self.launch)
        return self if wrap == self.wrap else self.replace(wrap=wrap)

    def changed(self, names: tuple[str, ...]) -> list[str]:
        """Those of the settings `names` whose values differ from their defaults, in order."""
        return [name for name in names if getattr(self, name) != DECLARED[name].default]

    def settings(self) -> dict[str, Any]:
        """The settings that differ from their defaults, JSON-ready (targets as a list)."""
        out: dict[str, Any] = {}
        for name in self.changed(LORA_SETTINGS):
            value = getattr(self, name)
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
        check_known(data, where)
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
    (`autofit.space_file.SpaceFile`) both validate with it."""
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


def check_known(names: Iterable[str], where: str = "") -> None:
    """Every name a knob or a setting; else the `ConfigError` of the first unknown one (sorted),
    with a did-you-mean hint (`coerce_knob`)."""
    unknown = set(names) - set(KNOBS) - set(LORA_SETTINGS)
    if unknown:
        coerce_knob(sorted(unknown)[0], None, where)


def coerce_declared(name: str, value: Any) -> Any:
    """One field's value checked and normalised by its declaration: a knob's by `coerce_knob`,
    a setting's by `coerce_setting` (each a `ConfigError` naming the value and what is allowed)."""
    return (coerce_knob if DECLARED[name].searched else coerce_setting)(name, value)


def _checked(name: str, value: Any) -> Any:
    """A field's value checked and normalised by its declaration (`coerce_knob`,
    `coerce_setting`), remembered per (name, type, value): a space makes a few hundred thousand
    configs of a few dozen distinct values, each checked once."""
    try:
        return _checked_value(name, type(value), value)
    except TypeError:  # unhashable (a list of targets): checked every time
        return coerce_declared(name, value)


@lru_cache(maxsize=4096)
def _checked_value(name: str, kind: type, value: Any) -> Any:
    # `kind` in the key: True == 1, yet a count may not be a boolean
    return coerce_declared(name, value)
