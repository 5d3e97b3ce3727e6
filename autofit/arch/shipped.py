"""The structures and layer traces shipped inside the package: a plan of a preset reads them, so
its first run traces nothing and imports no torch.

`bench/ship_traces.py` makes them: for every preset, its structure, and the layer traces
(`activations_of`, `step_events_of`) of every `ActivationKey` a plan of a shipped search space asks
for (`shipped_keys`). Each is one gzipped JSON file in `autofit/arch/shipped/`, named by the hash of
the architecture (`arch_id`: a local `config.json` equal to a preset's reads it too) and stamped
with the versions it was made with (`made_with`). An entry whose versions are not this
environment's is not read: the plan traces, as without it. This module imports no torch.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from autofit.models import ModelSpec

__all__ = [
    "SHIPPED_DIR", "arch_fields", "arch_id", "installed_versions", "made_with", "read_shipped",
    "shipped_path",
]  # fmt: skip

SHIPPED_DIR = Path(__file__).parent / "shipped"

_DISTRIBUTIONS = ("torch", "transformers", "peft")


def arch_fields(spec: ModelSpec) -> dict[str, Any]:
    """What a trace depends on in `spec`: every field but its name and description."""
    return {k: v for k, v in spec.to_dict().items() if k not in ("name", "description")}


def arch_id(spec: ModelSpec) -> str:
    """The hash of `spec`'s `arch_fields`."""
    return hashlib.sha256(json.dumps(arch_fields(spec), sort_keys=True).encode()).hexdigest()[:20]


@functools.cache
def installed_versions() -> dict[str, str | None]:
    """The installed torch, transformers and peft versions a trace depends on (None: not
    installed), looked up once per process."""
    found: dict[str, str | None] = {}
    for dist in _DISTRIBUTIONS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def made_with(trace_version: int) -> dict[str, Any]:
    """The versions a shipped trace is valid for: torch, transformers and peft as released (the
    local label of a build, `+cpu` or `+cu130`, dropped: traces run on CPU fake tensors, where
    every build runs the same kernels' shapes) and autofit's trace format (`TRACE_VERSION`)."""
    found: dict[str, Any] = {
        dist: version.split("+", 1)[0] if version is not None else None
        for dist, version in installed_versions().items()
    }
    found["trace_version"] = trace_version
    return found


def shipped_path(spec: ModelSpec) -> Path:
    return SHIPPED_DIR / f"{arch_id(spec)}.json.gz"


def read_shipped(spec: ModelSpec, trace_version: int) -> dict[str, Any]:
    """The shipped entry of `spec`'s architecture (`structure`, `activations`, `events`, `ops`, as
    the disk cache holds them), or {} where none is shipped or it was made with other versions."""
    path = shipped_path(spec)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if data.get("made_with") != made_with(trace_version):
        return {}
    return {k: data[k] for k in ("structure", "activations", "events", "ops") if k in data}
