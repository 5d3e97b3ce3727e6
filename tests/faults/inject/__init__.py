"""Put the fault injector (`sitecustomize.py` here) in a trial's way: `fault_env("hang")`."""

from __future__ import annotations

import os
from pathlib import Path

from .sitecustomize import FAULT_ENV, FAULTS

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def fault_env(fault: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables that make a trial's workers fail with `fault` (see
    `sitecustomize.py`): the fault's name and a `PYTHONPATH` with this folder first, then the
    repository (so the workers still import this autofit), then whatever `base` had."""
    assert fault in FAULTS, fault
    base = os.environ if base is None else base
    path = [str(HERE), str(REPO), base.get("PYTHONPATH", "")]
    return {FAULT_ENV: fault, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
