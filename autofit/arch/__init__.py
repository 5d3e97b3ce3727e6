"""A model's own structure, read once from the model itself, and its traced activations.

The estimator needs, for any decoder family, what each parameter is (a projection LoRA targets and
quantization touches, a norm, a bias, the embedding, the head, a router, an expert) and what one
decoder layer saves for backward. Both are read from the real HF model, not from per-family
formulas:

- `structure_of(spec)`: the family's causal LM built on the meta device (no memory), the very
  model trials build (`autofit.builder.model.build_meta_model`), its parameters sorted by role
  (`autofit.builder.structure`).
- `activations_of(spec, key)`: one decoder layer of the real architecture at real width traced
  under `FakeTensorMode` with the builder's own dtypes, LoRA and checkpointing: the bytes it keeps
  alive for backward per sequence, and the bytes outside the layers (embedding side, final norm,
  logits and loss) (`autofit.builder.trace`).

Both are plain data (`autofit.structure`), cached in memory and on disk (`cache_dir()`, keyed
by the architecture and the torch/transformers/peft versions), so the napkin stays arithmetic: a
plan traces each layer variant once, later plans read the cache without importing torch. Every
preset's structure and the traces its plans need ship inside the package (`arch.shipped`, made by
`bench/ship_traces.py`), read where the disk cache has no entry yet: a preset's first plan
imports no torch. A trace runs inside `quiet_libraries()` (other libraries' notices kept off the
terminal) and is announced to the `trace_notices` listeners. This module imports no torch; the
builder's readers it calls do (the builder never calls back here).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import platformdirs

from autofit.arch.shipped import arch_fields, installed_versions, read_shipped
from autofit.files import atomic_write
from autofit.models import ModelSpec
from autofit.quiet import quiet_libraries
from autofit.structure import (
    ActivationKey,
    LayerActivations,
    OpsKey,
    StepEvents,
    StepOps,
    Structure,
)

__all__ = [
    "activations_of", "cache_dir", "ops_entry", "ops_of", "step_events_of", "structure_of",
    "trace_notices", "traced_entry",
]  # fmt: skip

TRACE_VERSION = 8
"""Bump when what a trace or a structure read counts changes: older cache entries are ignored."""


# ----- caches -------------------------------------------------------------------------------------
_STRUCTURES: dict[ModelSpec, Structure] = {}
_ACTIVATIONS: dict[tuple[ModelSpec, ActivationKey], LayerActivations] = {}
_EVENTS: dict[tuple[ModelSpec, ActivationKey], StepEvents] = {}
_OPS: dict[tuple[ModelSpec, OpsKey], StepOps] = {}


def structure_of(spec: ModelSpec) -> Structure:
    """The parameters of `spec` by role, read from its meta model once per process (and from
    the disk cache when an earlier run read it)."""
    found = _STRUCTURES.get(spec)
    if found is not None:
        return found
    entry = _disk(spec)
    if "structure" in entry:
        found = Structure.from_dict(entry["structure"])
    else:
        _announce(spec)
        with quiet_libraries():
            from autofit.builder.structure import read_structure

            found = read_structure(spec)
        _disk_update(spec, structure=found.to_dict())
    _STRUCTURES[spec] = found
    return found


def activations_of(spec: ModelSpec, key: ActivationKey) -> LayerActivations:
    """One decoder layer of `spec` traced for `key` (memory, then disk, then a trace)."""

    def trace() -> LayerActivations:
        from autofit.builder.trace import trace_activations

        return trace_activations(spec, key)

    return _traced(
        spec, key, "activations", _ACTIVATIONS, lambda stored: LayerActivations(*stored), trace,
        _activations_list,
    )  # fmt: skip


def _activations_list(a: LayerActivations) -> list[float]:
    return [a.layer, a.root, a.root_forward, a.backward]


def traced_entry(
    spec: ModelSpec,
    activation_keys: Iterable[ActivationKey],
    event_keys: Iterable[ActivationKey],
    structure: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`spec`'s structure (unless given) and its traces for the keys given, read from the model
    now (no cache read or written), as the disk cache holds them: what `bench/ship_traces.py`
    ships. A step
    log the model cannot be traced for (fp32 weights under autocast, which HF's grouped-mm MoE
    experts refuse) is left out: a plan that asks for it traces it and fails as it would."""
    from autofit.builder.structure import read_structure
    from autofit.builder.trace import step_events, trace_activations

    with quiet_libraries():
        entry: dict[str, Any] = {
            "structure": structure or read_structure(spec).to_dict(),
            "activations": {
                k.text(): _activations_list(trace_activations(spec, k)) for k in activation_keys
            },
            "events": {},
        }
        for key in event_keys:
            with contextlib.suppress(RuntimeError):
                entry["events"][key.text()] = step_events(spec, key).to_list()
    return entry


def step_events_of(spec: ModelSpec, key: ActivationKey) -> StepEvents:
    """The births and deaths of one micro-step of `spec`'s one-layer model for `key`, its loss as
    traced (`standard` or `chunked`: the layers' allocations are the same, the head's and the
    loss's are not), memory, then disk, then a trace."""

    def trace() -> StepEvents:
        from autofit.builder.trace import step_events

        return step_events(spec, key)

    return _traced(spec, key, "events", _EVENTS, StepEvents.from_list, trace, StepEvents.to_list)


def ops_of(spec: ModelSpec, key: OpsKey) -> StepOps:
    """The ops one micro-step of `spec` dispatches for `key`, per decoder layer and outside the
    layers (`autofit.builder.ops`, counted at a reduced width): memory, then disk (the entry's
    `ops` section, which the shipped files carry too), then a count."""

    def count() -> StepOps:
        from autofit.builder.ops import count_step_ops

        return count_step_ops(spec, key)

    return _traced(spec, key, "ops", _OPS, lambda v: StepOps(*v), count, _ops_list)


def _ops_list(o: StepOps) -> list[float]:
    return [o.layer, o.root]


def ops_entry(spec: ModelSpec, keys: Iterable[OpsKey]) -> dict[str, list[float]]:
    """`spec`'s op counts for `keys`, counted now (no cache read or written), as the entry's
    `ops` section holds them: what `bench/ship_traces.py` ships."""
    from autofit.builder.ops import count_step_ops

    with quiet_libraries():
        return {k.text(): _ops_list(count_step_ops(spec, k)) for k in keys}


def _traced(
    spec: ModelSpec, key: Any, section: str, memo: dict[Any, Any],
    load: Callable[[Any], Any], trace: Callable[[], Any], dump: Callable[[Any], Any],
) -> Any:  # fmt: skip
    """A trace result of `spec` for `key`: from `memo`, else the disk cache's `section`, else
    `trace()` (written to the disk cache)."""
    found = memo.get((spec, key))
    if found is not None:
        return found
    text = key.text()
    stored = _disk(spec).get(section, {}).get(text)
    if stored is None:  # a disk entry made before its section existed: the shipped one's
        stored = _shipped(spec).get(section, {}).get(text)
    if stored is not None:
        found = load(stored)
    else:
        structure_of(spec).targets(key.lora_targets)  # unknown names: one clear paragraph
        _announce(spec)
        with quiet_libraries():
            found = trace()
        _disk_update(spec, **{section: {text: dump(found)}})
    memo[(spec, key)] = found
    return found


_LISTENERS: list[Callable[[str], None]] = []
_ANNOUNCED: set[ModelSpec] = set()


@contextlib.contextmanager
def trace_notices(show: Callable[[str], None]) -> Iterator[None]:
    """While the scope lasts, `show` is handed a line for people when a model's structure or a
    layer trace is not cached and is read from the model (seconds, once per architecture): the
    first time for each model in this process."""
    _LISTENERS.append(show)
    try:
        yield
    finally:
        _LISTENERS.remove(show)


def _announce(spec: ModelSpec) -> None:
    if spec in _ANNOUNCED or not _LISTENERS:
        return
    _ANNOUNCED.add(spec)
    text = (
        f"Tracing {spec.name}'s decoder layer at real width for each setting the estimate needs "
        f"(once for this architecture; kept in {cache_dir()}) ..."
    )
    for show in _LISTENERS:
        show(text)


def cache_dir() -> Path:
    """Where structures, traces and this machine's calibration are kept between runs:
    `$AUTOFIT_CACHE_DIR`, else the user's cache directory (`platformdirs`: `$XDG_CACHE_HOME/autofit`
    or `~/.cache/autofit` on Linux, `~/Library/Caches/autofit` on macOS)."""
    if os.environ.get("AUTOFIT_CACHE_DIR"):
        return Path(os.environ["AUTOFIT_CACHE_DIR"])
    return Path(platformdirs.user_cache_dir("autofit", appauthor=False))


def _versions() -> str:
    found = installed_versions().items()
    return ";".join(f"{dist}={'none' if version is None else version}" for dist, version in found)


def _cache_file(spec: ModelSpec) -> Path:
    arch = arch_fields(spec)
    text = json.dumps({"arch": arch, "versions": _versions(), "v": TRACE_VERSION}, sort_keys=True)
    return cache_dir() / f"arch-{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"


_DISK: dict[ModelSpec, dict[str, Any]] = {}
_SHIPPED: dict[ModelSpec, dict[str, Any]] = {}


def _shipped(spec: ModelSpec) -> dict[str, Any]:
    """What the package ships for `spec`'s architecture, read (and decompressed) once per
    process; never written to (`_disk_update` replaces a section, it does not mutate it)."""
    if spec not in _SHIPPED:
        _SHIPPED[spec] = read_shipped(spec, TRACE_VERSION)
    return _SHIPPED[spec]


def _disk(spec: ModelSpec) -> dict[str, Any]:
    """The disk cache's entry of `spec`, else what the package ships for its architecture."""
    if spec not in _DISK:
        try:
            _DISK[spec] = json.loads(_cache_file(spec).read_text())
        except (OSError, ValueError):
            _DISK[spec] = dict(_shipped(spec))
    return _DISK[spec]


def _disk_update(spec: ModelSpec, **parts: Any) -> None:
    """Merge `parts` into the cache file of `spec`, written whole to a temporary file and
    renamed over the old one (a reader never sees half a file). A cache that cannot be written
    is skipped: it only saves time."""
    entry = _disk(spec)
    for name, value in parts.items():
        if isinstance(value, dict) and name != "structure":
            entry[name] = {**entry.get(name, {}), **value}
        else:
            entry[name] = value
    path = _cache_file(spec)
    with contextlib.suppress(OSError):
        atomic_write(path, json.dumps(entry))
