"""Planners on one host take turns on its devices (issue 8, fault 3), and what a dead planner
left behind is cleaned up (fault 1)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autofit.trials import guard
from autofit.trials.devlock import device_keys, device_lock
from autofit.trials.launcher import WORKER_MODULE

HOLD = """
import os, sys, time
from autofit.trials.devlock import device_lock
with device_lock("cpu", 2):
    print("held", flush=True)
    time.sleep(float(sys.argv[1]))
"""


def _holder(tmp_path: Path, seconds: float) -> subprocess.Popen[str]:
    env = {**os.environ, "AUTOFIT_LOCK_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(seconds)], env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_planner_waits_until_the_first_trial_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOFIT_LOCK_DIR", str(tmp_path))
    other = _holder(tmp_path, 2.0)
    waited: list[tuple[str, str]] = []
    start = time.monotonic()
    with device_lock("cpu", 1, on_wait=lambda key, who: waited.append((key, who))):
        took = time.monotonic() - start
    other.wait(timeout=30)
    assert took >= 1.5  # the other planner held it for 2 s
    assert waited == [("cpu", f"pid {other.pid}")]


def test_a_killed_holder_frees_the_devices_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOFIT_LOCK_DIR", str(tmp_path))
    other = _holder(tmp_path, 600.0)
    other.kill()
    other.wait()
    start = time.monotonic()
    with device_lock("cpu", 1):
        assert time.monotonic() - start < 1.0


def test_locks_are_reentrant_within_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOFIT_LOCK_DIR", str(tmp_path))
    with device_lock("cpu", 2), device_lock("cpu", 2):  # a verification running its trial
        pass


def test_gpus_are_locked_one_by_one_in_one_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,2")
    assert device_keys("cuda", 2) == ["cuda-1", "cuda-3"]  # the first two it sees, sorted
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert device_keys("cuda", 2) == ["cuda-0", "cuda-1"]
    assert device_keys("cpu", 8) == ["cpu"]


def test_scratch_folders_of_dead_planners_are_swept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    dead_identity = guard.identity(dead.pid)
    dead.wait()
    stale = tmp_path / f"{guard.WORKDIR_PREFIX}dead"
    stale.mkdir()
    (stale / guard.OWNER_FILE).write_text(dead_identity)
    live = tmp_path / f"{guard.WORKDIR_PREFIX}live"
    live.mkdir()
    (live / guard.OWNER_FILE).write_text(guard.identity())
    fresh = tmp_path / f"{guard.WORKDIR_PREFIX}fresh"  # being created by another launcher
    fresh.mkdir()
    assert guard.sweep_stale_workdirs(tmp_path) == [stale]
    assert live.is_dir() and fresh.is_dir()


def test_a_reused_pid_is_not_taken_for_the_planner() -> None:
    me = guard.identity()
    pid, start = me.split(":")
    assert guard.alive(me)
    assert not guard.alive(f"{pid}:{float(start) - 100:.3f}")  # same pid, another process
    assert not guard.alive(None)


def test_trial_processes_of_a_dead_planner_are_killed_by_the_next_run() -> None:
    """What an older autofit (no watchdog) left: a 'worker' whose planner is gone."""
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    dead_identity = guard.identity(dead.pid)
    dead.wait()
    env = {**os.environ, guard.PLANNER_ENV: dead_identity}
    env.pop(guard.DEADLINE_ENV, None)
    code = "import time; time.sleep(120)"  # its command line names the worker module
    left = subprocess.Popen([sys.executable, "-c", code, WORKER_MODULE], env=env)
    live = subprocess.Popen([sys.executable, "-c", code, WORKER_MODULE],
                            env={**env, guard.PLANNER_ENV: guard.identity()})  # fmt: skip
    try:
        killed = guard.sweep_orphans(WORKER_MODULE)
        assert left.pid in killed and live.pid not in killed
        assert left.wait(timeout=10) == -9
        assert live.poll() is None
    finally:
        live.kill()
        left.kill()


def test_a_trial_past_its_deadline_kills_itself_even_if_its_planner_is_stuck() -> None:
    code = ("import time\nfrom autofit.trials.guard import watch\n"
            "watch(deadline=time.time() + 1.0)\ntime.sleep(60)")  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -9 and time.monotonic() - start < 20
