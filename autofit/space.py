"""Search spaces: the knobs' candidate values, read from `search_spaces/*.yaml`.

A space is a YAML file with `knobs:` (each knob of `autofit.config.KNOBS` -> a list of values),
an optional `seq_len:` default and `description:`, and optionally the LoRA settings
(`autofit.config.LORA_SETTINGS`) as top-level keys beside `seq_len:`, one value each, which every
candidate of the space carries (they are not searched):

    lora_targets: [q_proj, v_proj]   # or "q_proj,v_proj"; default all-linear
    lora_dropout: 0.05               # default 0
    lora_alpha: 32                   # default 2 x lora_rank
    train_embeddings: full           # or tokens:N; default none (LoRA candidates only)

and the data plans are made for (`autofit.data`; the flags `--dataset`, `--tokenizer`,
`--text-field` and `--lengths` replace it), paths relative to the space file:

    dataset: data/train.jsonl        # or {path: ..., tokenizer: ..., text_field: ...}
                                     # or {lengths: lengths.txt}

`--space NAME` picks a shipped file, `--space path.yaml` any file. Enumeration applies the rules
between knobs and derives `grad_accum` from the global batch, counting every skipped combination
by reason.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    create_model,
)

from autofit.config import (
    KNOB_HELP,
    KNOBS,
    LORA_SETTINGS,
    SETTING_HELP,
    Config,
    knob_error,
    knob_type,
)
from autofit.data.source import DataSource, SpaceData, as_space_data
from autofit.errors import SpaceError, did_you_mean
from autofit.layout import AUTO_WRAP, resolve_wrap
from autofit.rules import (
    QUANT_NEEDS_LORA,
    broken_rule,
    derive_grad_accum,
    loss_unavailable,
    quant_without_lora,
)
from autofit.settings import OPTIMIZER_IMPLS, coerce_setting, setting_error


def spaces_dir() -> Path:
    """Where the shipped spaces are: inside the installed package (wheel), or the repository's
    top-level `search_spaces/` (source tree and editable installs)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_search_spaces", here.parent / "search_spaces"):
        if candidate.is_dir():
            return candidate
    raise SpaceError(  # pragma: no cover - a broken install
        "autofit's search_spaces folder is missing from this installation; reinstall autofit."
    )


def available_spaces() -> list[str]:
    return sorted(p.stem for p in spaces_dir().glob("*.yaml"))


@dataclass(frozen=True)
class Space:
    name: str
    path: str
    knobs: dict[str, tuple[Any, ...]]
    seq_len: int = 2048
    description: str = ""
    # the LoRA settings (`LORA_SETTINGS`) every candidate carries, normalised; only those that
    # differ from their defaults
    settings: dict[str, Any] = field(default_factory=dict)
    data: DataSource | None = None  # the space file's `dataset:`, its paths made absolute

    def with_settings(self, where: str = "", **given: Any) -> Space:
        """This space with the LoRA settings in `given` replacing its own (`lora_targets=
        "all-linear"` included: a setting given its default value drops the space's)."""
        settings = {**self.settings, **given}
        return dataclasses.replace(self, settings=_settings(settings, where))

    @property
    def size(self) -> int:
        """Raw combinations of every listed value before rules and pruning (as on several
        nodes, where every value makes a run of its own)."""
        return self.size_on(nodes=2)

    def size_on(self, nodes: int) -> int:
        """Raw combinations on `nodes` nodes before rules and pruning (`knobs_on`)."""
        total = 1
        for values in self.knobs_on(nodes).values():
            total *= len(values)
        return total

    def knobs_on(
        self, nodes: int, n_gpus: int | None = None, data: bool = False
    ) -> dict[str, tuple[Any, ...]]:
        """The knob values that make different runs on `nodes` nodes: on one node `shard: node`
        is the same mesh as `shard: all` (`autofit.config.mesh_shape`), so only `all` is kept.
        With `n_gpus`, `wrap: auto` is replaced by the values it stands for there
        (`autofit.config.resolve_wrap` under each offload and shard of the space), each value
        once: a space that lists `auto` beside what it resolves to makes no config twice.
        Without the data's lengths (`data`) every sequence is `seq_len` long, where every
        `batching` is the same run, so only its default is kept."""
        knobs = self.knobs
        if nodes <= 1 and "node" in knobs["shard"]:
            knobs = {**knobs, "shard": ("all",)}
        if n_gpus is not None and AUTO_WRAP in knobs["wrap"]:
            wraps = [
                resolve_wrap(w, n_gpus, offload, shard)
                for w in knobs["wrap"]
                for offload in knobs["offload"]
                for shard in knobs["shard"]
            ]
            knobs = {**knobs, "wrap": tuple(dict.fromkeys(wraps))}
        if not data and knobs["batching"] != (_DEFAULTS.batching,):
            knobs = {**knobs, "batching": (_DEFAULTS.batching,)}
        return knobs

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "path": self.path,
            "seq_len": self.seq_len,
            "knobs": {k: list(v) for k, v in self.knobs.items()},
            "description": self.description,
        }
        if self.settings:  # as a (LoRA) Config writes them: lora_targets as a list
            out["settings"] = Config(lora_rank=1, **self.settings).settings()
        if self.data is not None:
            out["dataset"] = self.data.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Space:
        """The inverse of `to_dict` (values as stored: a study's space was validated when it was
        loaded, so it is not validated again; its settings are normalised back, lists to
        tuples). Spaces stored before settings existed have none; knobs added since a space was
        stored (`loss`, `compile`) take their default alone, as a space file that leaves them out
        does."""
        knobs = {k: tuple(v) for k, v in data["knobs"].items()}
        for name in KNOBS:
            if name != "seq_len" and name not in knobs:
                knobs[name] = (getattr(_DEFAULTS, name),)
        return cls(
            name=data["name"],
            path=data["path"],
            knobs=knobs,
            seq_len=data["seq_len"],
            description=data.get("description", ""),
            settings=_settings(data.get("settings") or {}),
            data=DataSource(**data["dataset"]) if data.get("dataset") else None,
        )

    def candidates(
        self,
        n_gpus: int,
        *,
        seq_len: int | None = None,
        global_batch: int | None = None,
        device: str = "cuda",
        nodes: int = 1,
        data: bool = False,
    ) -> tuple[list[Config], Counter[str]]:
        """Every valid config of the space that can run on `device` here, and the count of
        skipped combinations by reason (`loss: fused` needs CUDA and Liger installed:
        `autofit.config.loss_unavailable`), with the values that differ on `nodes` nodes and
        with (`data`) or without the data's lengths (`knobs_on`)."""
        seq = seq_len or self.seq_len
        names = [k for k in KNOBS if k not in ("seq_len", "grad_accum")]
        knobs = self.knobs_on(nodes, n_gpus, data)
        accum_values = (None,) if global_batch else knobs["grad_accum"]
        out: list[Config] = []
        skipped: Counter[str] = Counter()
        # a space that lists a value twice makes some configs twice: each is kept once
        seen: set[Config] | None = None
        if any(len(set(v)) < len(v) for v in (*(knobs[k] for k in names), accum_values)):
            seen = set()
        # One GPU trains the plain module (`wrap: none`); where the space offers it, a one-rank
        # FSDP2 mesh (which only adds gathered copies and DTensor overhead) is kept for param
        # offload alone.
        plain_only = n_gpus == 1 and "none" in knobs["wrap"]
        unavailable = {loss: loss_unavailable(loss, device) for loss in knobs["loss"]}
        accums_of = {  # micro_batch -> the grad_accum values it is tried with (none: skipped)
            m: () if (ga := derive_grad_accum(global_batch, m, n_gpus)) is None else (ga,)
            for m in knobs["micro_batch"]
        } if global_batch else {}  # fmt: skip
        template = _config_dict(seq, self.settings)
        # The innermost knob varies fastest: each combination of the others is checked and laid
        # out once (the checks below read none of it), then takes each of its values.
        *outer, inner = names
        quant_at, rank_at, mb_at, loss_at = (
            outer.index(k) for k in ("quant", "lora_rank", "micro_batch", "loss")
        )
        inner_values = knobs[inner]
        for combo in itertools.product(*(knobs[k] for k in outer)):
            if quant_without_lora(combo[quant_at], combo[rank_at]):  # the whole block at once
                skipped[QUANT_NEEDS_LORA] += len(inner_values) * len(accum_values)
                continue
            why = unavailable[combo[loss_at]]
            if why:
                skipped[why] += len(inner_values) * len(accum_values)
                continue
            if global_batch:
                accums = accums_of[combo[mb_at]]
                if not accums:
                    skipped["micro_batch x GPUs does not divide global batch"] += len(inner_values)
                    continue
            else:
                accums = accum_values
            prefix = template.copy()
            prefix.update(zip(outer, combo, strict=True))
            for value in inner_values:
                for ga in accums:
                    cfg = _fast_config(prefix, inner, value, ga)
                    broken = broken_rule(cfg)
                    if broken:
                        skipped[broken[0]] += 1
                        continue
                    if plain_only and cfg.wrap != "none" and cfg.offload != "params":
                        skipped[ONE_GPU_FSDP] += 1
                        continue
                    if seen is not None:
                        if cfg in seen:
                            continue
                        seen.add(cfg)
                    out.append(cfg)
        return out, skipped


ONE_GPU_FSDP = "one GPU: FSDP2 only with offload=params"


def _config_dict(seq_len: int, settings: dict[str, Any]) -> dict[str, Any]:
    """A Config's fields in order, at their defaults but for `seq_len` and the (normalised)
    LoRA settings: what every config of a space starts from."""
    out = {f.name: getattr(_DEFAULTS, f.name) for f in dataclasses.fields(Config)}
    return {**out, "seq_len": seq_len, **{k: settings[k] for k in LORA_SETTINGS if k in settings}}


def _fast_config(prefix: dict[str, Any], knob: str, value: Any, grad_accum: int) -> Config:
    """A Config of the fields in `prefix` (`_config_dict`) with `knob` at `value`: every value
    came from the space's schema, which checks each with the knob's own type
    (`autofit.config.knob_type`), so none is checked again (`Config.of_checked_values`); the
    caller checks the rules between knobs (`broken_rule`)."""
    attrs = prefix.copy()
    attrs[knob] = value
    attrs["grad_accum"] = grad_accum
    return Config.of_checked_values(attrs)


def _settings(given: dict[str, Any], where: str = "") -> dict[str, Any]:
    """LoRA settings normalised (`coerce_setting`; `ConfigError` for a bad one), keeping only
    those that differ from their defaults."""
    out = {}
    for name, value in given.items():
        if name not in LORA_SETTINGS:  # pragma: no cover - a caller's bug
            raise ValueError(f"{name!r} is not a LoRA setting")
        value = coerce_setting(name, value, where)
        if value != getattr(_DEFAULTS, name):
            out[name] = value
    return out


def load_space(name_or_path: str | Path = "default") -> Space:
    """A shipped space by name (`default`, `qlora`, `lora`, `full`) or a YAML file by path."""
    from autofit.files import special_kind, too_large

    text = str(name_or_path)
    path = Path(text).expanduser()
    kind = special_kind(path) if text not in available_spaces() else None
    if kind is not None:  # a folder, a FIFO, /dev/zero: never opened, so never waited on
        raise SpaceError(
            f"--space {text!r} is {kind}, not a space file. Pass the path of a .yaml file, or "
            f"one of the shipped names: {', '.join(available_spaces())}."
        )
    if not (path.suffix in (".yaml", ".yml") or path.is_file()):
        shipped = spaces_dir() / f"{text}.yaml"
        if not shipped.is_file():
            raise SpaceError(
                f"Unknown search space {text!r}.{did_you_mean(text, available_spaces())} "
                f"Shipped spaces: {', '.join(available_spaces())}; or pass a path to a .yaml file."
            )
        path = shipped
    if not path.is_file():
        raise SpaceError(
            f"Search-space file {text!r} does not exist. Pass an existing .yaml path or one of "
            f"the shipped names: {', '.join(available_spaces())}."
        )
    if why := too_large(path):
        raise SpaceError(f"{path} cannot be a search-space file: {why}.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.strerror or exc
        raise SpaceError(
            f"Cannot read the search-space file {str(path)!r} ({why}). A space file is a UTF-8 "
            "YAML mapping with a `knobs:` mapping of knob name -> list of values; or pass one of "
            f"the shipped names: {', '.join(available_spaces())}."
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one paragraph
        raise SpaceError(
            f"{path}: not valid YAML{where} ({problem}). A space file is a "
            "mapping with a `knobs:` mapping of knob name -> list of values."
        ) from None
    return parse_space(data, str(path), name=path.stem)


# ----- the space file's schema: pydantic owns parsing, errors and the JSON schema ---------------
SPACE_KEYS = ("knobs", "seq_len", *LORA_SETTINGS, "dataset", "description", "name")


def _as_list(value: Any) -> Any:
    """A single value stands for a one-element list (`quant: nf4`)."""
    return value if isinstance(value, list) else [value]


def _as_text(value: Any) -> Any:
    """`name` and `description` are read as text, whatever YAML made of them (`name: 2024`)."""
    return value if value is None or isinstance(value, str) else str(value)


def _description(value: Any) -> str:
    return "" if value is None else str(value)


def _knob_list(name: str) -> Any:
    item = knob_type(name)
    values = Annotated[list[item], Field(min_length=1)]  # type: ignore[valid-type]
    return Annotated[
        values,
        BeforeValidator(_as_list, json_schema_input_type=values | item),  # type: ignore[operator]
        Field(description=KNOB_HELP[name]),
    ]


def _setting(name: str, shown: Any) -> Any:
    """A LoRA setting's field: checked and normalised by `coerce_setting` (whose sentence the
    error repeats); `shown` is the type the JSON schema describes."""

    def check(value: Any) -> Any:
        problem = setting_error(name, value)
        if problem is not None:
            raise ValueError(problem)
        return coerce_setting(name, value)

    return Annotated[
        Any,
        PlainValidator(check, json_schema_input_type=shown),
        Field(description=SETTING_HELP[name] + ". The same for every candidate (not searched)."),
    ]


_DEFAULTS = Config()
SpaceKnobs = create_model(
    "SpaceKnobs",
    __config__=ConfigDict(extra="forbid"),
    __doc__="Each knob -> its candidate values; a knob left out has its default value alone.",
    **{  # type: ignore[call-overload]
        k: (_knob_list(k), [getattr(_DEFAULTS, k)]) for k in KNOBS if k != "seq_len"
    },
)


class SpaceFile(BaseModel):
    """A search-space file (`search_spaces/*.yaml`)."""

    model_config = ConfigDict(
        extra="forbid",
        title="autofit search space",
        json_schema_extra={"$schema": "https://json-schema.org/draft/2020-12/schema"},
    )

    knobs: SpaceKnobs  # type: ignore[valid-type]
    seq_len: knob_type("seq_len") = Field(  # type: ignore[valid-type]
        2048, description="Tokens per sequence when the plan names none (--seq-len)."
    )
    lora_alpha: _setting(  # type: ignore[valid-type]
        "lora_alpha", Annotated[int, Field(ge=1)] | None
    ) = None
    lora_targets: _setting(  # type: ignore[valid-type]
        "lora_targets", list[str] | str | None
    ) = None
    lora_dropout: _setting(  # type: ignore[valid-type]
        "lora_dropout", Annotated[float, Field(ge=0, lt=1)]
    ) = 0.0
    train_embeddings: _setting(  # type: ignore[valid-type]
        "train_embeddings", Annotated[str, Field(pattern=r"^(none|full|tokens:[1-9][0-9]*)$")]
    ) = "none"
    dataset: Annotated[
        SpaceData | None,
        BeforeValidator(as_space_data, json_schema_input_type=SpaceData | str | None),
    ] = Field(
        None,
        description="The data plans are made for (--dataset, --tokenizer, --text-field and "
        "--lengths replace it); paths are relative to the space file.",
    )
    optimizer_impl: _setting(  # type: ignore[valid-type]
        "optimizer_impl", Literal[OPTIMIZER_IMPLS]
    ) = "auto"
    description: Annotated[str, BeforeValidator(_description)] = Field(
        "", description="One line on what the space is for."
    )
    name: Annotated[str | None, BeforeValidator(_as_text)] = Field(
        None, description="The space's name in plans (default: the file's name without .yaml)."
    )


def space_schema() -> dict[str, Any]:
    """The JSON schema of a space file; `docs/space.schema.json` is this, written out (a test
    keeps the two equal)."""
    return SpaceFile.model_json_schema()


def parse_space(data: Any, where: str, name: str = "custom") -> Space:
    """A space from a space file's parsed YAML; `SpaceError` naming `where` and the first
    mistake (in file order) when it is not one."""
    try:
        parsed = SpaceFile.model_validate(data)
    except ValidationError as exc:
        raise SpaceError(_space_error(exc, data, where)) from None
    values = parsed.knobs.model_dump()  # type: ignore[attr-defined]
    # the file's knobs in its order, then the others (their default alone) in KNOBS order
    order = [*data["knobs"], *values]
    knobs = {key: tuple(dict.fromkeys(values[key])) for key in dict.fromkeys(order)}
    return Space(
        name=parsed.name if parsed.name is not None else name,
        path=where,
        knobs=knobs,
        seq_len=parsed.seq_len,
        description=parsed.description,
        settings=_settings({k: getattr(parsed, k) for k in LORA_SETTINGS}),
        data=DataSource.of_space(parsed.dataset, where),
    )


def _space_error(exc: ValidationError, data: Any, where: str) -> str:
    """The one sentence for the first mistake: the shape, then top-level keys, then the knobs in
    the order the file lists them, then seq_len and the LoRA settings."""
    order = (
        list(data["knobs"])
        if isinstance(data, dict) and isinstance(data.get("knobs"), dict)
        else []
    )

    def rank(err: Any) -> tuple[int, int]:
        loc = err["loc"]
        if not loc or loc == ("knobs",):
            return (0, 0)
        if len(loc) == 1 and loc[0] not in ("seq_len", *LORA_SETTINGS):
            return (1, 0)
        if loc[0] == "knobs":
            return (2, order.index(loc[1]) if loc[1] in order else len(order))
        return (3, 0)

    err = min(exc.errors(), key=rank)
    loc, kind = err["loc"], err["type"]
    if not loc or loc == ("knobs",):
        return (
            f"{where}: expected a mapping with a `knobs:` mapping (knob name -> list of values), "
            f"for example `knobs: {{quant: [none, nf4], lora_rank: [0, 16]}}`."
        )
    if loc[0] == "seq_len":
        return knob_error("seq_len", err["input"], f"{where}, seq_len")
    if loc[0] == "dataset":
        at = f" ({loc[1]}: {err['msg'].lower()})" if len(loc) > 1 else ""
        return (
            f"{where}: dataset must be a path or a mapping with the keys path, tokenizer, "
            f"text_field and lengths, each a string{at}; e.g. `dataset: {{path: train.jsonl, "
            "tokenizer: model/}`."
        )
    if loc[0] in LORA_SETTINGS:
        return setting_error(str(loc[0]), err["input"], where) or err["msg"]
    if len(loc) == 1:
        if kind == "extra_forbidden":
            return (
                f"{where}: unknown top-level key {loc[0]!r}."
                f"{did_you_mean(str(loc[0]), SPACE_KEYS)} Allowed: {', '.join(SPACE_KEYS)}."
            )
        return f"{where}: {loc[0]} {err['msg'].lower()}; got {err['input']!r}."
    key = str(loc[1])
    if kind == "extra_forbidden" and key in ("seq_len", *LORA_SETTINGS):
        return (
            f"{where}: {key} is a top-level key, not a knob: write `{key}: ...` beside `knobs:`, "
            "with one value (it is the same for every candidate)."
        )
    if kind == "extra_forbidden":
        allowed = [k for k in KNOBS if k != "seq_len"]
        return (
            f"{where}: unknown knob {key!r}.{did_you_mean(key, [*allowed, *LORA_SETTINGS])} Knobs: "
            f"{', '.join(allowed)} (seq_len and the settings {', '.join(LORA_SETTINGS)} are "
            "top-level keys)."
        )
    if kind == "too_short":
        return f"{where}: knob {key!r} has an empty list; give at least one value."
    return knob_error(key, err["input"], f"{where}, knob {key!r}")
