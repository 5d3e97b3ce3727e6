"""A space file: where the shipped ones are, reading one (`load_space`: a name or a path), and its
schema (`SpaceFile`: pydantic owns parsing, errors and the JSON schema, `docs/space.schema.json`).
What a space is and how it enumerates its configs is `autofit.space`."""

from __future__ import annotations

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
    knob_error,
    knob_type,
)
from autofit.data.source import DataSource, SpaceData, as_space_data
from autofit.errors import SpaceError, did_you_mean
from autofit.settings import (
    BNB_QUANT_STORAGES,
    LAUNCHES,
    OPTIMIZER_IMPLS,
    QUANT_BACKENDS,
    coerce_setting,
    setting_error,
)
from autofit.space import _DEFAULTS, Space, _settings


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
        twice = _first_duplicate_key(yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one paragraph
        raise SpaceError(
            f"{path}: not valid YAML{where} ({problem}). A space file is a "
            "mapping with a `knobs:` mapping of knob name -> list of values."
        ) from None
    if twice is not None:
        raise SpaceError(_duplicate_key_error(str(path), *twice))
    return parse_space(data, str(path), name=path.stem)


def _first_duplicate_key(
    node: yaml.Node | None, path: tuple[str, ...] = (), seen: set[int] | None = None
) -> tuple[tuple[str, ...], str, int, int] | None:
    """The first key a mapping of the YAML document `node` names twice (YAML keeps the last
    value without a word): the keys above it, the key and the two lines; None if none is."""
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:  # an alias met again
        return None
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        return next(
            (found for item in node.value if (found := _first_duplicate_key(item, path, seen))),
            None,
        )
    if not isinstance(node, yaml.MappingNode):
        return None
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        scalar = isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge"
        if scalar:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in lines:
                return path, key, lines[key], line
            lines[key] = line
        found = _first_duplicate_key(
            value_node, (*path, str(key_node.value)) if scalar else path, seen
        )
        if found is not None:
            return found
    return None


def _duplicate_key_error(where: str, path: tuple[str, ...], key: str, first: int, then: int) -> str:
    lines = f"lines {first} and {then}"
    if path == ("knobs",):
        return (
            f"{where}: knob {key!r} is given twice ({lines}), and YAML would silently keep the "
            f"last. Give each knob once, with all its values in one list (`{key}: [a, b]`)."
        )
    inside = f" in {'.'.join(path)}" if path else ""
    return (
        f"{where}: the key {key!r}{inside} is given twice ({lines}), and YAML would silently "
        "keep the last. Give each key once."
    )


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
    ) = _DEFAULTS.lora_alpha
    lora_targets: _setting(  # type: ignore[valid-type]
        "lora_targets", list[str] | str | None
    ) = _DEFAULTS.lora_targets
    lora_dropout: _setting(  # type: ignore[valid-type]
        "lora_dropout", Annotated[float, Field(ge=0, lt=1)]
    ) = _DEFAULTS.lora_dropout
    train_embeddings: _setting(  # type: ignore[valid-type]
        "train_embeddings", Annotated[str, Field(pattern=r"^(none|full|tokens:[1-9][0-9]*)$")]
    ) = _DEFAULTS.train_embeddings
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
    ) = _DEFAULTS.optimizer_impl
    quant_backend: _setting(  # type: ignore[valid-type]
        "quant_backend", Literal[QUANT_BACKENDS]
    ) = _DEFAULTS.quant_backend
    bnb_4bit_use_double_quant: _setting(  # type: ignore[valid-type]
        "bnb_4bit_use_double_quant", bool
    ) = _DEFAULTS.bnb_4bit_use_double_quant
    bnb_4bit_quant_storage: _setting(  # type: ignore[valid-type]
        "bnb_4bit_quant_storage", Literal[BNB_QUANT_STORAGES]
    ) = _DEFAULTS.bnb_4bit_quant_storage
    launch: _setting(  # type: ignore[valid-type]
        "launch", Literal[LAUNCHES]
    ) = _DEFAULTS.launch
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
        return knob_error("seq_len", err["input"], where)
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
    return knob_error(key, err["input"], where)
