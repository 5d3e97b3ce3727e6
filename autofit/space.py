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
from typing import Any

from autofit.config import (
    KNOBS,
    LORA_SETTINGS,
    Config,
)
from autofit.data.source import DataSource
from autofit.layout import AUTO_WRAP, resolve_wrap
from autofit.rules import (
    QUANT_NEEDS_LORA,
    broken_rule,
    derive_grad_accum,
    fsdp2_only_knob,
    launch_unavailable,
    loss_unavailable,
    quant_without_lora,
)
from autofit.settings import coerce_setting
from autofit.values import Shard, Wrap

_DEFAULTS = Config()
"""Every knob and setting at its default."""


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
        is the same mesh as `shard: all` (`autofit.layout.mesh_shape`), so only `all` is kept.
        With `n_gpus`, `wrap: auto` is replaced by the values it stands for there
        (`autofit.layout.resolve_wrap` under each offload and shard of the space), each value
        once: a space that lists `auto` and one that lists what it resolves to make the same
        runs (what names a study, `autofit.search.study.runs_of`).
        Without the data's lengths (`data`) every sequence is `seq_len` long, where every
        `batching` is the same run, so only its default is kept."""
        knobs = self.knobs
        if nodes <= 1 and Shard.NODE in knobs["shard"]:
            knobs = {**knobs, "shard": (Shard.ALL.value,)}
        if n_gpus is not None and AUTO_WRAP in knobs["wrap"]:
            launch = self.settings.get("launch", _DEFAULTS.launch)
            wraps = [
                resolve_wrap(w, n_gpus, offload, shard, launch)
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
        `autofit.rules.loss_unavailable`; `launch: trl` needs TRL, `launch_unavailable`), with
        the values that differ on `nodes` nodes and
        with (`data`) or without the data's lengths (`knobs_on`)."""
        walk = _Walk.of(self, n_gpus, seq_len or self.seq_len, global_batch, device, nodes, data)
        out: list[Config] = []
        skipped: Counter[str] = Counter()
        for combo in itertools.product(*(walk.knobs[k] for k in walk.outer)):
            accums = walk.block_accums(combo, skipped)
            if accums is not None:
                walk.add_block(walk.prefix(combo), accums, out, skipped)
        return out, skipped


ONE_GPU_FSDP = "one GPU: FSDP2 only with offload=params"


@dataclass
class _Walk:
    """What `Space.candidates` settles once before it walks the knobs' combinations: the knobs
    with the values that make different runs, which checks apply, and the configs already kept.
    The innermost knob (`inner`) varies fastest: each combination of the others (`outer`) is
    checked and laid out once (the checks read none of it), then takes each of its values."""

    knobs: dict[str, tuple[Any, ...]]
    outer: list[str]
    inner: str
    n_gpus: int
    accum_values: tuple[Any, ...]
    # micro_batch -> the grad_accum values it is tried with (none: skipped); only with a
    # global batch
    accums_of: dict[int, tuple[int, ...]]
    global_batch: int | None
    template: dict[str, Any]  # every config's fields before the knobs' values (`_config_dict`)
    auto: bool  # the space lists `wrap: auto`, resolved per combination
    plain_only: bool  # one GPU: FSDP2 kept for param offload alone
    unavailable: dict[str, str | None]  # loss -> why it cannot run here
    launch: str | None  # why the space's launch cannot run here
    seen: set[Config] | None  # the configs kept so far, where some may come twice
    quant_at: int
    rank_at: int
    mb_at: int
    loss_at: int

    @classmethod
    def of(
        cls,
        space: Space,
        n_gpus: int,
        seq: int,
        global_batch: int | None,
        device: str,
        nodes: int,
        data: bool,
    ) -> _Walk:
        """The walk over `space`'s knobs on `n_gpus` GPUs of `device`, `nodes` nodes."""
        names = [k for k in KNOBS if k not in ("seq_len", "grad_accum")]
        knobs = space.knobs_on(nodes, data=data)  # `wrap: auto`: resolved per combination
        accum_values = (None,) if global_batch else knobs["grad_accum"]
        # a space that lists a value twice, or `auto` beside a wrap it may stand for, makes some
        # configs twice: each is kept once
        auto = AUTO_WRAP in knobs["wrap"]
        seen: set[Config] | None = None
        if (auto and len(knobs["wrap"]) > 1) or any(
            len(set(v)) < len(v) for v in (*(knobs[k] for k in names), accum_values)
        ):
            seen = set()
        # One GPU trains the plain module (`wrap: none`, what `auto` stands for there); where the
        # space offers it, a one-rank FSDP2 mesh (which only adds gathered copies and DTensor
        # overhead) is kept for param offload alone.
        plain_only = n_gpus == 1 and (Wrap.NONE in knobs["wrap"] or auto)
        accums_of = {
            m: () if (ga := derive_grad_accum(global_batch, m, n_gpus)) is None else (ga,)
            for m in knobs["micro_batch"]
        } if global_batch else {}  # fmt: skip
        *outer, inner = names
        quant_at, rank_at, mb_at, loss_at = (
            outer.index(k) for k in ("quant", "lora_rank", "micro_batch", "loss")
        )
        return cls(
            knobs=knobs,
            outer=outer,
            inner=inner,
            n_gpus=n_gpus,
            accum_values=accum_values,
            accums_of=accums_of,
            global_batch=global_batch,
            template=_config_dict(seq, space.settings),
            auto=auto,
            plain_only=plain_only,
            unavailable={loss: loss_unavailable(loss, device) for loss in knobs["loss"]},
            launch=launch_unavailable(space.settings.get("launch", _DEFAULTS.launch)),
            seen=seen,
            quant_at=quant_at,
            rank_at=rank_at,
            mb_at=mb_at,
            loss_at=loss_at,
        )

    def block_accums(self, combo: tuple[Any, ...], skipped: Counter[str]) -> tuple[Any, ...] | None:
        """The grad_accum values the outer combination `combo` is tried with, or None where the
        whole block of its inner values is skipped (counted in `skipped` by reason)."""
        inner_values = self.knobs[self.inner]
        if quant_without_lora(combo[self.quant_at], combo[self.rank_at]):  # the block at once
            skipped[QUANT_NEEDS_LORA] += len(inner_values) * len(self.accum_values)
            return None
        why = self.launch or self.unavailable[combo[self.loss_at]]
        if why:
            skipped[why] += len(inner_values) * len(self.accum_values)
            return None
        if not self.global_batch:
            return self.accum_values
        accums = self.accums_of[combo[self.mb_at]]
        if not accums:
            skipped["micro_batch x GPUs does not divide global batch"] += len(inner_values)
            return None
        return accums

    def prefix(self, combo: tuple[Any, ...]) -> dict[str, Any]:
        """A config's fields with the outer knobs at `combo`, `wrap: auto` resolved."""
        prefix = self.template.copy()
        prefix.update(zip(self.outer, combo, strict=True))
        if self.auto:  # `wrap: auto`: what it stands for with this offload and shard
            prefix["wrap"] = resolve_wrap(
                prefix["wrap"], self.n_gpus, prefix["offload"], prefix["shard"],
                prefix.get("launch", _DEFAULTS.launch),
            )  # fmt: skip
        return prefix

    def add_block(
        self,
        prefix: dict[str, Any],
        accums: tuple[Any, ...],
        out: list[Config],
        skipped: Counter[str],
    ) -> None:
        """Append to `out` each config of `prefix` with each inner value and grad_accum that
        breaks no rule and was not kept before; count the others in `skipped` by reason."""
        for value in self.knobs[self.inner]:
            for ga in accums:
                cfg = _fast_config(prefix, self.inner, value, ga)
                broken = broken_rule(cfg)
                if broken:
                    skipped[broken[0]] += 1
                    continue
                if (
                    self.plain_only
                    and cfg.wrap != Wrap.NONE
                    and not fsdp2_only_knob(cfg.offload, cfg.shard)
                ):
                    skipped[ONE_GPU_FSDP] += 1
                    continue
                if self.seen is not None:
                    if cfg in self.seen:
                        continue
                    self.seen.add(cfg)
                out.append(cfg)


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
