"""Trial processes die with the planner that started them, however it dies.

A trial is `planner -> torchrun -> workers` (a one-rank trial: `planner -> worker`, as one GPU runs
without torchrun). torchrun starts each worker in a session of its own, so signals sent to the
planner's or torchrun's process group do not reach the workers, and a planner killed with SIGKILL
runs no clean-up at all. Three layers make sure nothing outlives it:

1. every trial process asks the kernel for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`, Linux);
2. every trial process runs a watchdog thread that kills it when the planner process (named by pid
   and start time in `PLANNER_ENV`, so a reused pid does not fool it) is gone, or when the trial's
   deadline (`DEADLINE_ENV`: its `--trial-timeout` plus a grace) has passed, even if the planner
   itself is stuck;
3. the launcher kills the whole tree when a trial ends or is interrupted (`launcher._kill_tree`),
   and removes the scratch folders of trials whose planner is gone (`sweep_stale_workdirs`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn

import psutil

PLANNER_ENV = "AUTOFIT_PLANNER"  # "<pid>:<start time>" of the process that launched the trial
DEADLINE_ENV = "AUTOFIT_TRIAL_DEADLINE"  # time.time() after which trial processes kill themselves
WORKDIR_PREFIX = "autofit-trial-"
OWNER_FILE = "owner"
# A scratch folder without an owner file is another launcher's that has not written it yet,
# unless it is older than this.
OWNERLESS_GRACE_S = 300.0
WATCH_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1


def identity(pid: int | None = None) -> str:
    """`<pid>:<start time>` of a process: unlike a bare pid, never names a later process."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{psutil.Process(pid).create_time():.3f}"


def alive(ident: str | None) -> bool:
    """Whether the process named by `identity()` still runs (a zombie counts as gone)."""
    if not ident:
        return False
    try:
        pid_text, start_text = ident.split(":", 1)
        proc = psutil.Process(int(pid_text))
        same = abs(proc.create_time() - float(start_text)) < 0.01
        return same and proc.status() != psutil.STATUS_ZOMBIE
    except (ValueError, psutil.Error):
        return False


def hostname() -> str:
    return socket.gethostname()


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (no-op outside Linux)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def watch(planner: str | None = None, deadline: float | None = None) -> threading.Thread | None:
    """Start a daemon thread that SIGKILLs this process when `planner` is gone or `deadline` passed.

    Both default to this process's environment (`PLANNER_ENV`, `DEADLINE_ENV`); with neither set
    (a worker started by hand) nothing is watched. Kills at once if the planner is already gone.
    """
    planner = planner if planner is not None else os.environ.get(PLANNER_ENV)
    if deadline is None and os.environ.get(DEADLINE_ENV):
        deadline = float(os.environ[DEADLINE_ENV])
    if not planner and deadline is None:
        return None
    if planner and not alive(planner):
        _kill_self()

    def loop() -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            late = deadline is not None and time.time() > deadline
            if late or (planner and not alive(planner)):
                _kill_self()

    thread = threading.Thread(target=loop, name="autofit-watchdog", daemon=True)
    thread.start()
    return thread


def guard_trial_process() -> None:
    """What every trial process (torchrun and each worker) does first."""
    die_with_parent()
    watch()


def make_workdir() -> Path:
    """A scratch folder for one trial, owned by this process (see `sweep_stale_workdirs`)."""
    path = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
    (path / OWNER_FILE).write_text(identity())
    return path


def sweep_stale_workdirs(root: str | Path | None = None) -> list[Path]:
    """Remove the scratch folders of trials whose planner is gone; return what was removed."""
    base = Path(root) if root is not None else Path(tempfile.gettempdir())
    removed: list[Path] = []
    for path in base.glob(WORKDIR_PREFIX + "*"):
        if not path.is_dir():
            continue
        try:
            owner = (path / OWNER_FILE).read_text().strip()
        except OSError:
            owner = None
        if owner is None:
            try:
                stale = time.time() - path.stat().st_mtime > OWNERLESS_GRACE_S
            except OSError:
                continue
        else:
            stale = not alive(owner)
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def sweep_orphans(marker: str) -> list[int]:
    """SIGKILL trial processes (torchrun and workers: their command line names `marker`) whose
    planner is gone: ones this version started cannot outlive it for long, but an older
    autofit's, or one whose watchdog was stopped, would hold a GPU forever. Returns their pids."""
    killed = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if marker not in " ".join(proc.info["cmdline"] or ()) or proc.pid == os.getpid():
                continue
            planner = proc.environ().get(PLANNER_ENV)
            orphan = not alive(planner) if planner else proc.ppid() == 1
            if orphan:
                proc.kill()
                killed.append(proc.pid)
    return killed


def _run_torchrun() -> None:
    """`python guard.py TORCHRUN-ARGS...`: torchrun, guarded. Run as a script (not `-m`) so that
    nothing but this file and torch is imported before the guard is in place."""
    guard_trial_process()
    import runpy

    sys.argv = ["torchrun", *sys.argv[1:]]
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    # torchrun is done and its workers are gone: exit without the interpreter's teardown of torch
    # (about half a second at every launch); a failure's traceback is printed as usual above
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    exit_now(code or 0)


def exit_now(code: int = 0) -> NoReturn:
    """Flush stdout and stderr and end this trial process with `code` at once, without the
    interpreter's teardown (seconds with torch loaded, at every launch). Only once its results
    are written and the process group is gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _run_torchrun()
