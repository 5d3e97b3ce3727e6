"""Faults for the trial tests, injected from outside the worker (issue 9, point 9).

Python imports `sitecustomize` from the path at start-up of every process. `fault_env()` (in
`__init__.py`) puts this folder on `PYTHONPATH`, which the launcher passes on to torchrun and its
workers, and names a fault in `AUTOFIT_TEST_FAULT`. Only in a trial worker (torchrun sets
`LOCAL_RANK`) does this file act: once the worker imports `autofit.trials.rank` (after it guarded
itself; importing torch here, at start-up, would delay that guard by seconds), it wraps
`join_group`, which every rank calls once, with a process group or without one (a one-rank
launch of the plain module has none), so that right after a rank has set up

- `hang`: every rank hangs;
- `hang-collective`: rank 0 waits in a collective (a barrier) that the other ranks never join;
- `host-oom`: rank 0 allocates host memory until something stops it;
- `slow-step`: every step of a config whose label (`Config.short()`) contains
  `AUTOFIT_TEST_SLOW_MATCH` sleeps `AUTOFIT_TEST_SLOW_S` seconds first (warm-up steps too), as a
  config whose kernels crawl would (wrapping `autofit.trials.rank.train_step` once the worker
  imports it).

Every other process (the planner, torchrun) imports nothing and changes nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import types

FAULT_ENV = "AUTOFIT_TEST_FAULT"
FAULTS = ("hang", "hang-collective", "host-oom", "slow-step")
SLOW_MATCH_ENV = "AUTOFIT_TEST_SLOW_MATCH"
SLOW_S_ENV = "AUTOFIT_TEST_SLOW_S"


def _hang() -> None:
    import time

    while True:
        time.sleep(1)


def _slow_steps(rank: types.ModuleType) -> None:
    import time

    step, match = rank.train_step, os.environ.get(SLOW_MATCH_ENV, "")
    seconds = float(os.environ.get(SLOW_S_ENV, "5"))

    def train_step(run, *args, **kwargs):  # type: ignore[no-untyped-def]
        if match and match in run.config.short():
            time.sleep(seconds)
        return step(run, *args, **kwargs)

    rank.train_step = train_step


def _inject(fault: str, rank_module: types.ModuleType) -> None:
    join = rank_module.join_group

    def join_group(*args, **kwargs):  # type: ignore[no-untyped-def]
        joined = join(*args, **kwargs)
        import torch.distributed as dist

        rank = int(os.environ.get("RANK", "0"))
        if fault == "hang" or (fault == "hang-collective" and rank != 0):
            _hang()
        if fault == "hang-collective":
            dist.barrier()
        if fault == "host-oom" and rank == 0:
            hog = []
            while True:
                hog.append(bytearray(64 << 20))  # bytearray() touches its pages: resident at once
        return joined

    rank_module.join_group = join_group


class _WhenImported(importlib.abc.MetaPathFinder):
    """Injects the fault into `name` right after that module is first imported."""

    def __init__(self, name: str, fault: str) -> None:
        self.name, self.fault = name, fault

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            if self.fault == "slow-step":
                _slow_steps(module)
            else:
                _inject(self.fault, module)

        spec.loader.exec_module = exec_module
        return spec


_fault = os.environ.get(FAULT_ENV, "")
if _fault and "LOCAL_RANK" in os.environ:
    if _fault not in FAULTS:
        raise SystemExit(f"{FAULT_ENV}={_fault!r}: expected one of {', '.join(FAULTS)}")
    sys.meta_path.insert(0, _WhenImported("autofit.trials.rank", _fault))
