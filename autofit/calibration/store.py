"""This machine's calibration, kept between plans in the user's cache directory.

One JSON file per machine (`<cache>/calibration/<key digest>.json`, the cache of
`autofit.arch.cache_dir`, or `$AUTOFIT_CALIBRATION_DIR`): the machine it is for, the napkin
version its terms came from, the measured observations (latest `MAX_OBSERVATIONS`) and the
calibration fitted on all of them. A machine is its device kind, its GPUs' model and count, how
they are linked, the host CPU for CPU trials, the torch and torchao versions (a new kernel or
allocator changes what is measured), and on GPUs the NCCL wheel and the driver's version (what
lies outside the allocator). A record whose napkin version differs from this install's is
not used: its terms were computed by other formulas.

Writes are atomic (a temporary file renamed over the old one); two planners that finish at once
each write a whole file, and the later one's observations are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Iterable
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from autofit.arch import TRACE_VERSION, cache_dir
from autofit.calibration import Calibration, Observation, fit_calibration
from autofit.calibration.records import CalibrationRecord, ObservationRecord, StoredCalibration
from autofit.files import atomic_write
from autofit.hardware import Hardware
from autofit.hardware.nvml import driver_version
from autofit.request import PlanRequest

MAX_OBSERVATIONS = 500
_NAPKIN_FILES = ("__init__.py", "memory.py", "peak.py", "speed.py")


def napkin_version() -> str:
    """A digest of the napkin's formulas (the estimator's source and the trace version): stored
    observations carry the terms these formulas computed."""
    h = hashlib.sha256(f"trace={TRACE_VERSION}".encode())
    here = Path(__file__).resolve().parents[1] / "estimate"
    for name in _NAPKIN_FILES:
        with contextlib.suppress(OSError):
            h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def _nccl() -> str:
    """The NCCL wheel torch's CUDA build loads (`nvidia-nccl-cu13`, `-cu12`), as installed."""
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        found = _version(dist)
        if found != "none":
            return found
    return "none"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_key(hardware: Hardware, device: str) -> dict[str, Any]:
    """What makes two machines calibrate alike (not the memory cap: factors are per byte)."""
    names = sorted({g.name for g in hardware.gpus})
    key: dict[str, Any] = {
        "device": device,
        "gpus": f"{hardware.n_gpus}x {' + '.join(names)}",
        "link": f"{hardware.link} {hardware.link_bw_gbs:g} GB/s",
        "torch": _version("torch"),
        "torchao": _version("torchao"),
    }
    if hardware.nodes > 1:  # only then: one-node keys stay those stored before nodes existed
        key["nodes"] = f"{hardware.nodes} x {hardware.gpus_per_node}"
        key["network"] = f"{hardware.network} {hardware.inter_node_bw_gbs:g} GB/s"
    if device == "cpu":
        key["cpu"] = f"{_cpu_model()} ({hardware.cpu_cores} cores)"
    else:  # what lies outside the allocator: NCCL's buffers (`estimate.memory.nccl_bytes`) and
        # the CUDA context, which the driver's version changes (`Calibration.context_bytes`)
        key["nccl"] = _nccl()
        key["driver"] = driver_version()
    return key


def describe(key: dict[str, Any]) -> str:
    """The machine in a few words, for the output."""
    parts = [key["gpus"], key["link"], f"torch {key['torch']}", f"torchao {key['torchao']}"]
    if "nodes" in key:
        parts[1:1] = [f"{key['nodes']} nodes", key["network"]]
    if "cpu" in key:
        parts.insert(1, key["cpu"])
    return ", ".join(parts)


def calibration_dir() -> Path:
    """`$AUTOFIT_CALIBRATION_DIR`, else `calibration/` in autofit's cache directory."""
    if os.environ.get("AUTOFIT_CALIBRATION_DIR"):
        return Path(os.environ["AUTOFIT_CALIBRATION_DIR"])
    return cache_dir() / "calibration"


def store_path(hardware: Hardware, device: str) -> Path:
    key = machine_key(hardware, device)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return calibration_dir() / f"{digest}.json"


def _read(path: Path) -> StoredCalibration | None:
    """The stored record, or None where there is none or it does not parse as one (a damaged
    file is then replaced by the next `save`)."""
    try:
        return StoredCalibration.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


def load(hardware: Hardware, device: str) -> Calibration | None:
    """The stored calibration of this machine (`source` "stored"), or None when there is none
    for this napkin version."""
    record = _read(store_path(hardware, device))
    if record is None or record.napkin != napkin_version():
        return None
    return record.calibration.model_copy(update={"source": "stored"}).calibration()


def for_request(request: PlanRequest) -> Calibration | None:
    """This machine's stored calibration when `request` uses it (`calibration: auto`)."""
    if request.calibration != "auto":
        return None
    return load(request.hardware, request.device)


def with_measured_context(hardware: Hardware, device: str) -> Hardware:
    """`hardware` with the CUDA context its stored calibration measured (`Calibration.
    context_bytes`: the device level of this machine's GPU trials less their reserved peaks and
    NCCL's buffers), which the estimate and the headroom line then count instead of the
    default; `hardware` itself where nothing was measured, or on CPU."""
    if device == "cpu":
        return hardware
    stored = load(hardware, device)
    if stored is None or stored.context_bytes is None:
        return hardware
    return hardware.with_context(int(stored.context_bytes))


def save(
    hardware: Hardware,
    device: str,
    observations: Iterable[tuple[str, Observation]],
) -> tuple[Path, Calibration]:
    """Add `observations` (each with an id that names its trial, e.g. `study#number`: the same
    trial saved twice is kept once) to this machine's record, refit it on all of them, and write
    it. Returns the file and the calibration stored."""
    path = store_path(hardware, device)
    before = _read(path)
    kept: dict[str, ObservationRecord] = {}
    if before is not None and before.napkin == napkin_version():
        kept = {o.id: o for o in before.observations if o.id is not None}
    for ident, obs in observations:
        if obs.informative:
            kept[ident] = ObservationRecord.of(obs, ident)
    rows = list(kept.values())[-MAX_OBSERVATIONS:]
    fitted = fit_calibration(o.observation() for o in rows)
    record = StoredCalibration(
        machine=machine_key(hardware, device),
        napkin=napkin_version(),
        updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        calibration=CalibrationRecord.of(replace(fitted, source="stored")),
        observations=rows,
    )
    atomic_write(path, record.model_dump_json(indent=1))
    return path, record.calibration.calibration()
