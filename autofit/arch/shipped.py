"""The structures and layer traces shipped inside the package: a plan of a preset reads them, so
its first run traces nothing and imports no torch.

`bench/ship_traces.py` makes them: for every preset, its structure, and the layer traces
(`activations_of`, `step_events_of`) of every `ActivationKey` a plan of a shipped search space asks
for (`shipped_keys`). Each is one gzipped JSON file in `autofit/arch/shipped/`, named by the hash of
the architecture (`arch_id`: a local `config.json` equal to a preset's reads it too) and stamped
with the versions it was made with (`made_with`). An entry is read where this environment's
versions trace alike with those (`traces_alike`): the same release, or two releases of one group
of `TRACED_ALIKE`, each group checked by tracing under its releases (`bench/ship_traces.py
--check`, docs/architecture.md). Elsewhere it is not read: the plan traces, as without it. This
module imports no torch, nor any library it names: versions are read from the installed
distributions' metadata.
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
    "shipped_path", "shipped_paths", "TRACED_ALIKE", "traces_alike",
]  # fmt: skip

SHIPPED_DIR = Path(__file__).parent / "shipped"

_DISTRIBUTIONS = ("torch", "transformers", "peft")

TRACED_ALIKE: dict[str, tuple[tuple[str, ...], ...]] = {
    # A group: release series (a prefix of the release: "2.11" is every 2.11.x) whose traces of
    # the debug presets of every family were found equal, activations and step logs, traced
    # under each (`bench/ship_traces.py --check`; docs/estimator.md, "Shipped", has the table). A
    # release of no group reads only entries made with that very release. Not alike, found so:
    # transformers 5.17 to 5.20 against 5.24 (5.17 and 5.18: the rotary tables' temporaries die
    # elsewhere in every family's step log; 5.17 to 5.20: Gemma 2's activations). 5.17 has
    # variant files of its own (`shipped_paths`); 5.18 against them: Mixtral's traces differ.
    "torch": (("2.11", "2.13"),),
    "transformers": (("5.21", "5.22", "5.23", "5.24"),),
    "peft": (),
}
"""Which releases of a distribution trace alike: what changes a traced shape is the library's
code, and that is known only by tracing under it. Add a group (or a release to one) only with
the check's result."""


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


def _release(version: str) -> str:
    return version.split("+", 1)[0]


def _in_group(version: str, group: tuple[str, ...]) -> bool:
    release = _release(version)
    return any(release == prefix or release.startswith(prefix + ".") for prefix in group)


def traces_alike(stamp: dict[str, Any], trace_version: int) -> bool:
    """Whether an entry stamped `stamp` (`made_with` where it was made) holds the traces this
    environment would make: the same `trace_version`, and for each of torch, transformers and
    peft the same release (a build's local label aside) or two releases of one group of
    `TRACED_ALIKE`."""
    if stamp.get("trace_version") != trace_version:
        return False
    for dist, installed in installed_versions().items():
        made = stamp.get(dist)
        if installed is None or made is None:
            if installed != made:
                return False
        elif _release(installed) != _release(made) and not any(
            _in_group(installed, group) and _in_group(made, group)
            for group in TRACED_ALIKE.get(dist, ())
        ):
            return False
    return True


def shipped_path(spec: ModelSpec, variant: str | None = None) -> Path:
    """The shipped file of `spec`'s architecture: the one made with the pinned releases, or a
    `variant` made with others whose traces differ (named by them, e.g. `transformers-5.17`)."""
    suffix = f".{variant}" if variant else ""
    return SHIPPED_DIR / f"{arch_id(spec)}{suffix}.json.gz"


def shipped_paths(spec: ModelSpec) -> list[Path]:
    """Every shipped file of `spec`'s architecture, the likeliest to be read first: a variant
    named by an installed release (`transformers-5.17` where transformers 5.17.x is), then the
    pinned releases' file, then the other variants by name (each file's stamp decides)."""
    arch = arch_id(spec)
    variants = sorted(SHIPPED_DIR.glob(f"{arch}.*.json.gz"))
    mine = {
        f"{dist}-{'.'.join(_release(v).split('.')[:2])}"
        for dist, v in installed_versions().items()
        if v is not None
    }
    named = [p for p in variants if p.name[len(arch) + 1 : -len(".json.gz")] in mine]
    return [*named, shipped_path(spec), *(p for p in variants if p not in named)]


def read_shipped(spec: ModelSpec, trace_version: int) -> dict[str, Any]:
    """The shipped entry of `spec`'s architecture (`structure`, `activations`, `events`, `ops`, as
    the disk cache holds them) made with versions that trace alike with this environment's
    (`traces_alike`), the pinned releases' file or a variant's; {} where none is."""
    for path in shipped_paths(spec):
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if traces_alike(data.get("made_with") or {}, trace_version):
            break
    else:
        return {}
    return {k: data[k] for k in ("structure", "activations", "events", "ops") if k in data}
