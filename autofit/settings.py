"""The settings' values: what each may be and the one sentence for a value it cannot be.

The settings are declared with the knobs on `autofit.config.Config` (name, default, help); this
module holds their checks: `lora_targets` (module names), `lora_dropout` (a share), `lora_alpha`
(a whole number), `train_embeddings` (`none`, `full` or `tokens:N`), `optimizer_impl` (one of
`OPTIMIZER_IMPLS`) and `launch` (one of `LAUNCHES`). Plain data, no torch.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from autofit.errors import ConfigError
from autofit.values import (
    BnbQuantStorage,
    Launch,
    OptimizerImpl,
    QuantBackend,
    TrainEmbeddings,
    values,
)

ADAPTER_SETTINGS = ("lora_alpha", "lora_targets", "lora_dropout")
"""The settings that configure LoRA's adapters: a full fine-tune has none to carry them."""
# `train_embeddings` values: `none`, `full`, or `tokens:N` (the last N ids of the vocabulary).
TRAIN_EMBEDDINGS = values(TrainEmbeddings)
TOKENS_PREFIX = "tokens:"

# `quant_backend` values (`WORD_SETTINGS`)
QUANT_BACKENDS = values(QuantBackend)
BNB_SETTINGS = ("bnb_4bit_use_double_quant", "bnb_4bit_quant_storage")
"""The settings of bitsandbytes' NF4 storage (`quant_backend: bitsandbytes` only)."""
BNB_QUANT_STORAGES = values(BnbQuantStorage)
"""`bnb_4bit_quant_storage` values (`autofit.recipe.BNB_QUANT_STORAGE` has their widths)."""


@dataclass(frozen=True)
class Words:
    """A setting that takes one of a few words: its `autofit.values` enum (the first member its
    default), what the setting chooses, what each word does ("" where its name says it) and
    where it applies. Its `--help` (`help`) and its refusal (`allowed`) are made of these."""

    enum: type[StrEnum]
    what: str
    meanings: dict[str, str]
    scope: str = ""

    @property
    def default(self) -> str:
        return values(self.enum)[0]

    @property
    def metavar(self) -> str:
        return "|".join(values(self.enum))

    def help(self) -> str:
        """`what: first (default) = does this; second; third = does that; scope`."""
        return f"{self.what}: {self.allowed()}"

    def allowed(self) -> str:
        """Each word, and what it does where its name does not say it, the first the default;
        then where the setting applies."""
        parts = []
        for i, word in enumerate(values(self.enum)):
            named = f"{word} (default)" if i == 0 else word
            meaning = self.meanings[word]
            parts.append(f"{named} = {meaning}" if meaning else named)
        return "; ".join(parts + ([self.scope] if self.scope else []))


WORD_SETTINGS: dict[str, Words] = {
    "optimizer_impl": Words(
        OptimizerImpl,
        "how torch AdamW runs its step",
        {
            OptimizerImpl.AUTO: "fused where the parameters are on a GPU (fastest, no "
            "intermediate), torch's own choice elsewhere (its for-loop on CPU)",
            OptimizerImpl.FUSED: "",
            OptimizerImpl.FOREACH: "torch's default on CUDA, HF Trainer's adamw_torch: one "
            "intermediate the size of every trainable parameter",
            OptimizerImpl.FOR_LOOP: "torch's single-tensor step: two the size of the largest",
        },
        "optimizer=adamw only",
    ),
    "quant_backend": Words(
        QuantBackend,
        "the library that stores quant=nf4 weights",
        {
            QuantBackend.TORCHAO: "torchao's NF4Tensor",
            QuantBackend.BITSANDBYTES: "bitsandbytes' Linear4bit, as HF Trainer's "
            "BitsAndBytesConfig loads them: the plain module on one GPU, pip install "
            "'autofit[bnb]'",
        },
        "quant=nf4 only",
    ),
    "bnb_4bit_quant_storage": Words(
        BnbQuantStorage,
        "the dtype bitsandbytes views its packed 4-bit codes as (BitsAndBytesConfig's "
        "bnb_4bit_quant_storage; the same bytes, FSDP needs the other parameters' dtype)",
        {word: "" for word in BnbQuantStorage},
        "quant_backend=bitsandbytes only",
    ),
    "launch": Words(
        Launch,
        "whose training loop runs the config",
        {
            Launch.AUTOFIT: "autofit's builder and loop (autofit.apply)",
            Launch.TRAINER: "HF Trainer.train() with the TrainingArguments the trainer export "
            "writes, the model loaded as a Trainer script loads it (the plain module on one "
            "GPU, DDP on several, as torchrun runs the script; no "
            "torchao quant, chunked/fused loss, every-2/selective checkpointing, offload or "
            "compile; QLoRA is quant=nf4 with quant_backend=bitsandbytes, loaded with "
            "BitsAndBytesConfig and prepare_model_for_kbit_training)",
            Launch.TRL: "TRL's SFTTrainer.train() with the SFTConfig the trainer export writes "
            "(as trainer, but QLoRA as SFTTrainer loads it: no prepare_model_for_kbit_training, "
            "its adapters bf16, so precision=bf16; and its packing for batching=packed; pip "
            "install 'autofit[trl]')",
        },
    ),
}
"""The settings that take one of a few words, each declared once: its words, their meanings
and where it applies, from which its help, its check and its refusal follow."""
_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")

# `optimizer_impl` values (`WORD_SETTINGS`; `autofit.recipe.adamw_impl` resolves `auto`,
# `autofit.recipe.ADAMW_IMPLS` counts what each holds)
OPTIMIZER_IMPLS = values(OptimizerImpl)

# `launch` values (`WORD_SETTINGS`; `autofit.builder.trainer`, `autofit.builder.trl`)
LAUNCHES = values(Launch)
HF_LAUNCHES = (Launch.TRAINER.value, Launch.TRL.value)
"""The launches whose loop is HF Trainer's (TRL's `SFTTrainer` is a `Trainer`): the plain module
on one GPU and Accelerate's DDP on several, the model a script loads, the arguments of the
trainer export."""

# `lora_targets` spellings of the default: every linear projection of the decoder blocks.
ALL_LINEAR = "all-linear"
_ALL_LINEAR_WORDS = (ALL_LINEAR, "all")
# a module name: a leaf (`q_proj`) or a dotted path inside a decoder layer (`self_attn.q_proj`)
_MODULE_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def targeted(path: str, names: tuple[str, ...] | None) -> bool:
    """Whether `lora_targets` (`names`; None: every projection) names the projection at `path`
    inside a decoder layer (`self_attn.q_proj`): by its leaf (`q_proj`) or by its path. The
    builder adapts, and the estimator counts, exactly these."""
    return names is None or path.rsplit(".", 1)[-1] in names or path in names


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
    if name not in SETTING_CHECKS:  # pragma: no cover - a caller's bug
        raise ValueError(f"{name!r} is not a setting")
    return SETTING_CHECKS[name].check(value)


def _dropout_problem(value: Any) -> tuple[float | None, str | None]:
    number = _number(0.0 if value is None else value)
    if number is None or not 0 <= number < 1:  # NaN fails the test too
        return None, "out of range"
    return number, None


def _alpha_problem(value: Any) -> tuple[int | None, str | None]:
    if value is None:
        return None, None
    number = _number(value)
    if number is None or not math.isfinite(number) or number != int(number) or number < 1:
        return None, "not a whole number"
    return int(number), None


def _flag_problem(value: Any) -> tuple[bool | None, str | None]:
    if value is None or isinstance(value, bool):
        return bool(value), None
    text = value.strip().lower() if isinstance(value, str) else ""
    if text in _TRUE or text in _FALSE:
        return text in _TRUE, None
    return None, "not true or false"


def _choice(value: Any, allowed: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(one of `allowed`, read case-insensitively; None is the first, the default, None) or
    (None, why not)."""
    text = allowed[0] if value is None else value.strip().lower() if isinstance(value, str) else ""
    return (text, None) if text in allowed else (None, "unknown value")


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
    return SETTING_CHECKS[name].message.format(place=place, value=value, why=why)


@dataclass(frozen=True)
class SettingCheck:
    """How one setting's value is read (`check`: the normalised value and None, or None and
    what is wrong) and the sentence for a value it cannot take (`message`, formatted with the
    `place`, the `value` and `why`)."""

    check: Callable[[Any], tuple[Any, str | None]]
    message: str


def _words(setting: str) -> SettingCheck:
    """The check and the refusal of a setting that takes one of its `WORD_SETTINGS` words."""
    words = WORD_SETTINGS[setting]
    return SettingCheck(
        lambda value: _choice(value, values(words.enum)),
        f"Setting '{setting}'{{place}} cannot be {{value!r}}. Allowed: {words.allowed()}.",
    )


SETTING_CHECKS: dict[str, SettingCheck] = {
    "lora_targets": SettingCheck(
        _targets_problem,
        "Setting 'lora_targets'{place} cannot be {value!r}: {why}. Allowed: module names of "
        "the decoder layers, comma-separated or as a list, e.g. q_proj,v_proj (leaf names such "
        "as q_proj or gate_up_proj, or paths inside a layer such as self_attn.q_proj); or "
        f"{ALL_LINEAR} for every linear projection of the decoder blocks (the default).",
    ),
    "lora_dropout": SettingCheck(
        _dropout_problem,
        "Setting 'lora_dropout'{place} must be a number >= 0 and < 1 (the share of each "
        "adapted layer's input that LoRA drops, e.g. 0.05; 0 = no dropout); got {value!r}.",
    ),
    "lora_alpha": SettingCheck(
        _alpha_problem, "Setting 'lora_alpha'{place} must be a whole number >= 1; got {value!r}."
    ),
    "train_embeddings": SettingCheck(
        _train_embeddings_problem,
        "Setting 'train_embeddings'{place} cannot be {value!r} ({why}). Allowed: none (the "
        "default: embeddings and LM head frozen), full (a trainable copy of the input "
        "embeddings and of the LM head beside the frozen originals, peft modules_to_save), "
        "or tokens:N with N a whole number >= 1 (only the rows of the last N token ids, "
        "e.g. tokens:8 for the 8 tokens a chat template added; peft trainable_token_indices).",
    ),
    "optimizer_impl": _words("optimizer_impl"),
    "quant_backend": _words("quant_backend"),
    "bnb_4bit_use_double_quant": SettingCheck(
        _flag_problem,
        "Setting 'bnb_4bit_use_double_quant'{place} must be true or false (bitsandbytes "
        "also quantizes NF4's absmax scales to 8 bits); got {value!r}.",
    ),
    "bnb_4bit_quant_storage": _words("bnb_4bit_quant_storage"),
    "launch": _words("launch"),
}
"""Every setting's check and sentence, one record each (`autofit.config` declares the settings;
a test holds the two to the same names)."""


def coerce_setting(name: str, value: Any, where: str = "") -> Any:
    """Check and normalise one setting (`LORA_SETTINGS`); raise `ConfigError` naming the
    setting, the value and what is allowed. `lora_targets`: a tuple of module names, or None for
    every linear projection (`all-linear`, `all`, an empty list); `lora_dropout`: a float;
    `train_embeddings`: `none`, `full` or `tokens:N`; `optimizer_impl`, `launch`: lower case."""
    problem = setting_error(name, value, where)
    if problem is not None:
        raise ConfigError(problem)
    return _setting_problem(name, value)[0]
