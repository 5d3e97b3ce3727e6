"""Trials on one host take turns on the devices they share.

Two planners (or a planner and `autofit trial`) on one machine would otherwise measure at the same
time on the same GPUs or cores and slow each other down, so one's numbers would be wrong. Every
trial holds a `filelock.FileLock` (an exclusive `flock`) on one file per device it uses
(`cuda-<id>` per GPU it sees, one `cpu` for the host's cores) in a folder shared by every process
of the host. The kernel drops a lock when its holder dies, `kill -9` included, so a crashed
planner never leaves a device locked. Locks are re-entrant within a thread (a verification that
holds them can run its trial); two threads of one process take turns like two processes
(filelock's per-thread holds).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_DIR_ENV = "AUTOFIT_LOCK_DIR"  # where the lock files live (default: <tmp>/autofit-locks)


def lock_dir() -> Path:
    path = Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "autofit-locks")
    path.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        path.chmod(0o1777)  # every user of the host shares the devices
    return path


def device_keys(device: str, nprocs: int) -> list[str]:
    """The lock names of the devices a trial on `nprocs` ranks of `device` uses."""
    if device != "cuda":
        return ["cpu"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    ids = ids[:nprocs] if ids else [str(i) for i in range(nprocs)]
    return sorted(f"cuda-{i}" for i in ids)  # one global order: no two holders deadlock


def holder(key: str) -> str:
    """What the lock file says about its current holder (pid and command), or ''."""
    with contextlib.suppress(OSError):
        return (lock_dir() / f"{key}.lock").read_text().strip()
    return ""


def _lock(key: str) -> FileLock:
    """The process's one `FileLock` of `key` (a singleton per path: holds are counted on it)."""
    path = lock_dir() / f"{key}.lock"
    return FileLock(path, mode=0o666, is_singleton=True, preserve_lock_file=True)


def _acquire(key: str, on_wait: Callable[[str, str], None] | None) -> FileLock:
    lock = _lock(key)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        if on_wait is not None:
            on_wait(key, holder(key))
        lock.acquire()
    if lock.lock_counter == 1:  # a new holder: say who (flock locks the file, not its text)
        Path(lock.lock_file).write_text(f"pid {os.getpid()}\n")
    return lock


def _release(lock: FileLock) -> None:
    if lock.lock_counter == 1:  # still ours: the next holder writes its own line
        with contextlib.suppress(OSError):
            os.truncate(lock.lock_file, 0)
    lock.release()


@contextlib.contextmanager
def device_lock(
    device: str, nprocs: int, on_wait: Callable[[str, str], None] | None = None
) -> Iterator[None]:
    """Hold the devices of a trial on `nprocs` ranks of `device`; wait while another process does.

    `on_wait(key, holder)` is called once per device that is busy, before waiting for it.
    """
    taken: list[FileLock] = []
    try:
        for key in device_keys(device, nprocs):
            taken.append(_acquire(key, on_wait))
        yield
    finally:
        for lock in reversed(taken):
            _release(lock)
