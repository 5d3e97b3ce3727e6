"""Search spaces: the knobs' candidate values, read from `search_spaces/*.yaml`.

A space is a YAML file with `knobs:` (each knob of `autofit.config.KNOBS` -> a list of values),
an optional `seq_len:` default and `description:`. `--space NAME` picks a shipped file, `--space
path.yaml` any file. Enumeration applies the rules between knobs and derives `grad_accum` from the
global batch, counting every skipped combination by reason.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from autofit.config import KNOBS, Config, broken_rule, coerce_knob, derive_grad_accum
from autofit.errors import ConfigError, SpaceError, did_you_mean


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

    @property
    def size(self) -> int:
        """Raw combinations before rules and pruning."""
        total = 1
        for values in self.knobs.values():
            total *= len(values)
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "seq_len": self.seq_len,
            "knobs": {k: list(v) for k, v in self.knobs.items()},
            "description": self.description,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Space:
        """The inverse of `to_dict` (values as stored: a study's space was validated when it was
        loaded, so it is not validated again)."""
        return cls(
            name=data["name"],
            path=data["path"],
            knobs={k: tuple(v) for k, v in data["knobs"].items()},
            seq_len=data["seq_len"],
            description=data.get("description", ""),
        )

    def candidates(
        self, n_gpus: int, *, seq_len: int | None = None, global_batch: int | None = None
    ) -> tuple[list[Config], Counter[str]]:
        """Every valid config of the space, and the count of skipped combinations by reason."""
        seq = seq_len or self.seq_len
        names = [k for k in KNOBS if k not in ("seq_len", "grad_accum")]
        value_lists = [self.knobs[k] for k in names]
        accum_values = (None,) if global_batch else self.knobs["grad_accum"]
        out: list[Config] = []
        seen: set[Config] = set()
        skipped: Counter[str] = Counter()
        # One GPU trains the plain module (`wrap: none`); where the space offers it, a one-rank
        # FSDP2 mesh (which only adds gathered copies and DTensor overhead) is kept for param
        # offload alone.
        plain_only = n_gpus == 1 and "none" in self.knobs["wrap"]
        for combo in itertools.product(*value_lists):
            values = dict(zip(names, combo, strict=True))
            if values["quant"] != "none" and values["lora_rank"] == 0:
                skipped["quant needs LoRA"] += len(accum_values)
                continue
            if global_batch:
                ga = derive_grad_accum(global_batch, values["micro_batch"], n_gpus)
                if ga is None:
                    skipped["micro_batch x GPUs does not divide global batch"] += 1
                    continue
                accums: tuple[int, ...] = (ga,)
            else:
                accums = accum_values  # type: ignore[assignment]
            for ga in accums:
                cfg = _fast_config(values, ga, seq)
                broken = broken_rule(cfg)
                if broken:
                    skipped[broken[0]] += 1
                    continue
                if plain_only and cfg.wrap != "none" and cfg.offload != "params":
                    skipped[ONE_GPU_FSDP] += 1
                    continue
                if cfg in seen:
                    continue
                seen.add(cfg)
                out.append(cfg)
        return out, skipped


ONE_GPU_FSDP = "one GPU: FSDP2 only with offload=params"


def _fast_config(values: dict[str, Any], grad_accum: int, seq_len: int) -> Config:
    """Build a Config from values the loader already validated, skipping re-validation."""
    cfg = object.__new__(Config)
    for k, v in values.items():
        object.__setattr__(cfg, k, v)
    object.__setattr__(cfg, "grad_accum", grad_accum)
    object.__setattr__(cfg, "seq_len", seq_len)
    object.__setattr__(cfg, "lora_alpha", None)
    return cfg


def load_space(name_or_path: str | Path = "default") -> Space:
    """A shipped space by name (`default`, `qlora`, `lora`, `full`) or a YAML file by path."""
    text = str(name_or_path)
    path = Path(text).expanduser()
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


def parse_space(data: Any, where: str, name: str = "custom") -> Space:
    if not isinstance(data, dict) or not isinstance(data.get("knobs"), dict):
        raise SpaceError(
            f"{where}: expected a mapping with a `knobs:` mapping (knob name -> list of values), "
            f"for example `knobs: {{quant: [none, nf4], lora_rank: [0, 16]}}`."
        )
    extra = set(data) - {"knobs", "seq_len", "description", "name"}
    if extra:
        raise SpaceError(
            f"{where}: unknown top-level key {sorted(extra)[0]!r}. Allowed: knobs, seq_len, "
            "description, name."
        )
    knobs: dict[str, tuple[Any, ...]] = {}
    defaults = Config()
    for key, raw in data["knobs"].items():
        if key not in KNOBS or key == "seq_len":
            allowed = [k for k in KNOBS if k != "seq_len"]
            raise SpaceError(
                f"{where}: unknown knob {key!r}.{did_you_mean(str(key), allowed)} Knobs: "
                f"{', '.join(allowed)} (seq_len is a top-level key)."
            )
        values = raw if isinstance(raw, list) else [raw]
        if not values:
            raise SpaceError(f"{where}: knob {key!r} has an empty list; give at least one value.")
        try:
            coerced = tuple(
                dict.fromkeys(coerce_knob(key, v, f"{where}, knob {key!r}") for v in values)
            )
        except ConfigError as exc:
            raise SpaceError(str(exc)) from None
        knobs[key] = coerced
    for key in KNOBS:
        if key not in knobs and key != "seq_len":
            knobs[key] = (getattr(defaults, key),)
    seq = data.get("seq_len", 2048)
    try:
        seq = coerce_knob("seq_len", seq, f"{where}, seq_len")
    except ConfigError as exc:
        raise SpaceError(str(exc)) from None
    return Space(
        name=str(data.get("name", name)),
        path=where,
        knobs=knobs,
        seq_len=seq,
        description=str(data.get("description", "")),
    )
