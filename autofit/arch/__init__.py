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
plan traces each layer variant once, later plans read the cache without importing torch. This
module imports no torch; the builder's readers it calls do (the builder never calls back here).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

import platformdirs

from autofit.files import atomic_write
from autofit.models import ModelSpec
from autofit.structure import ActivationKey, LayerActivations, StepEvents, Structure

__all__ = ["activations_of", "cache_dir", "step_events_of", "structure_of"]

TRACE_VERSION = 8
"""Bump when what a trace or a structure read counts changes: older cache entries are ignored."""


# ----- caches -------------------------------------------------------------------------------------
_STRUCTURES: dict[ModelSpec, Structure] = {}
_ACTIVATIONS: dict[tuple[ModelSpec, ActivationKey], LayerActivations] = {}
_EVENTS: dict[tuple[ModelSpec, ActivationKey], StepEvents] = {}


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
        lambda a: [a.layer, a.root, a.root_forward, a.backward],
    )  # fmt: skip


def step_events_of(spec: ModelSpec, key: ActivationKey) -> StepEvents:
    """The births and deaths of one micro-step of `spec`'s one-layer model for `key` (the loss
    standard: the layers' allocations do not depend on it), memory, then disk, then a trace."""
    key = replace(key, loss="standard")

    def trace() -> StepEvents:
        from autofit.builder.trace import step_events

        return step_events(spec, key)

    return _traced(spec, key, "events", _EVENTS, StepEvents.from_list, trace, StepEvents.to_list)


def _traced(
    spec: ModelSpec, key: ActivationKey, section: str, memo: dict[Any, Any],
    load: Callable[[Any], Any], trace: Callable[[], Any], dump: Callable[[Any], Any],
) -> Any:  # fmt: skip
    """A trace result of `spec` for `key`: from `memo`, else the disk cache's `section`, else
    `trace()` (written to the disk cache)."""
    found = memo.get((spec, key))
    if found is not None:
        return found
    text = key.text()
    stored = _disk(spec).get(section, {}).get(text)
    if stored is not None:
        found = load(stored)
    else:
        structure_of(spec).targets(key.lora_targets)  # unknown names: one clear paragraph
        found = trace()
        _disk_update(spec, **{section: {text: dump(found)}})
    memo[(spec, key)] = found
    return found


def cache_dir() -> Path:
    """Where structures, traces and this machine's calibration are kept between runs:
    `$AUTOFIT_CACHE_DIR`, else the user's cache directory (`platformdirs`: `$XDG_CACHE_HOME/autofit`
    or `~/.cache/autofit` on Linux, `~/Library/Caches/autofit` on macOS)."""
    if os.environ.get("AUTOFIT_CACHE_DIR"):
        return Path(os.environ["AUTOFIT_CACHE_DIR"])
    return Path(platformdirs.user_cache_dir("autofit", appauthor=False))


def _versions() -> str:
    found = []
    for dist in ("torch", "transformers", "peft"):
        try:
            found.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            found.append(f"{dist}=none")
    return ";".join(found)


def _cache_file(spec: ModelSpec) -> Path:
    arch = {k: v for k, v in spec.to_dict().items() if k not in ("name", "description")}
    text = json.dumps({"arch": arch, "versions": _versions(), "v": TRACE_VERSION}, sort_keys=True)
    return cache_dir() / f"arch-{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"


_DISK: dict[ModelSpec, dict[str, Any]] = {}


def _disk(spec: ModelSpec) -> dict[str, Any]:
    if spec not in _DISK:
        try:
            _DISK[spec] = json.loads(_cache_file(spec).read_text())
        except (OSError, ValueError):
            _DISK[spec] = {}
    return _DISK[spec]


def _disk_update(spec: ModelSpec, **parts: Any) -> None:
    """Merge `parts` into the cache file of `spec`, written whole to a temporary file and
    renamed over the old one (a reader never sees half a file). A cache that cannot be written
    is skipped: it only saves time."""
    entry = _disk(spec)
    for name, value in parts.items():
        if isinstance(value, dict) and name != "structure":
            entry.setdefault(name, {}).update(value)
        else:
            entry[name] = value
    path = _cache_file(spec)
    with contextlib.suppress(OSError):
        atomic_write(path, json.dumps(entry))
