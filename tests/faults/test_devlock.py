"""Planners on one host take turns on its devices (issue 8, fault 3), and what a dead planner
left behind is cleaned up (fault 1)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autofit.trials import guard
from autofit.trials.devlock import device_keys, device_lock
from autofit.trials.launcher import WORKER_MODULE

# A planner's trial on GPU 0: say when it waits and when it holds the lock, log entering and
# leaving to a file every process appends to, and leave when the test writes a line to stdin.
HOLD = """
import sys
from autofit.trials.devlock import device_lock

def log(event):
    with open(sys.argv[1], "a") as f:
        f.write(f"{sys.argv[2]} {event}\\n")

waiting = lambda key, who: print(f"waiting {key} {who}", flush=True)
with device_lock("cuda", 1, on_wait=waiting):
    log("enter")
    print("held", flush=True)
    sys.stdin.readline()
    log("leave")
"""


def _planner(tmp_path: Path, name: str) -> subprocess.Popen[str]:
    env = {**os.environ, "AUTOFIT_LOCK_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": "0"}
    argv = [sys.executable, "-c", HOLD, str(tmp_path / "events"), name]
    return subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _says(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def _events(tmp_path: Path) -> list[str]:
    return (tmp_path / "events").read_text().splitlines()


def test_two_planners_on_one_gpu_take_turns(tmp_path: Path) -> None:
    first = _planner(tmp_path, "first")
    assert _says(first) == "held"
    second = _planner(tmp_path, "second")
    try:
        # The second finds GPU 0 held by the first, and is told who holds it.
        assert _says(second) == f"waiting cuda-0 pid {first.pid}"
        first.communicate("\n", timeout=60)  # the first's trial ends
        assert _says(second) == "held"
        second.communicate("\n", timeout=60)
    finally:
        first.kill()
        second.kill()
    assert _events(tmp_path) == ["first enter", "first leave", "second enter", "second leave"]
    assert first.returncode == second.returncode == 0


def test_a_killed_holder_frees_the_gpu(tmp_path: Path) -> None:
    first = _planner(tmp_path, "first")
    assert _says(first) == "held"
    second = _planner(tmp_path, "second")
    try:
        assert _says(second) == f"waiting cuda-0 pid {first.pid}"
        first.kill()  # SIGKILL: no `finally`, no release of its own
        first.wait()
        assert _says(second) == "held"  # the kernel dropped the dead holder's flock
        second.communicate("\n", timeout=60)
    finally:
        second.kill()
    assert _events(tmp_path) == ["first enter", "second enter", "second leave"]


def test_threads_of_one_process_take_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOFIT_LOCK_DIR", str(tmp_path))
    events: list[str] = []
    entered, leave = threading.Event(), threading.Event()
    waited = threading.Event()

    def first() -> None:
        with device_lock("cpu", 1):
            events.append("first enter")
            entered.set()
            leave.wait()
            events.append("first leave")

    def second() -> None:
        with device_lock("cpu", 1, on_wait=lambda key, who: waited.set()):
            events.append("second enter")

    one = threading.Thread(target=first)
    one.start()
    entered.wait()
    two = threading.Thread(target=second)
    two.start()
    waited.wait()  # the second thread found the lock held
    leave.set()
    one.join()
    two.join()
    assert events == ["first enter", "first leave", "second enter"]


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
