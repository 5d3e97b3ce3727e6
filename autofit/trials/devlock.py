"""Trials on one host take turns on the devices they share.

Two planners (or a planner and `autofit trial`) on one machine would otherwise measure at the same
time on the same GPUs or cores and slow each other down, so one's numbers would be wrong. Every
trial holds an exclusive `flock` on one file per device it uses (`cuda-<id>` per GPU it sees, one
`cpu` for the host's cores) in a folder shared by every process of the host. The kernel drops a
lock when its holder dies, `kill -9` included, so a crashed planner never leaves a device locked.
Locks are re-entrant within a thread (a verification that holds them can run its trial); two
threads of one process take turns like two processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK_DIR_ENV = "AUTOFIT_LOCK_DIR"  # where the lock files live (default: <tmp>/autofit-locks)

_held: dict[tuple[str, int], tuple[int, int]] = {}  # (key, thread) -> (fd, depth)
_guard = threading.Lock()


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


def _acquire(key: str, on_wait: Callable[[str, str], None] | None) -> None:
    me = (key, threading.get_ident())
    with _guard:
        if me in _held:
            fd, depth = _held[me]
            _held[me] = (fd, depth + 1)
            return
    fd = os.open(lock_dir() / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(key, holder(key))
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    with _guard:
        _held[me] = (fd, 1)


def _release(key: str) -> None:
    me = (key, threading.get_ident())
    with _guard:
        fd, depth = _held[me]
        if depth > 1:
            _held[me] = (fd, depth - 1)
            return
        del _held[me]
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)  # closing the only descriptor drops the flock


@contextlib.contextmanager
def device_lock(
    device: str, nprocs: int, on_wait: Callable[[str, str], None] | None = None
) -> Iterator[None]:
    """Hold the devices of a trial on `nprocs` ranks of `device`; wait while another process does.

    `on_wait(key, holder)` is called once per device that is busy, before waiting for it.
    """
    taken: list[str] = []
    try:
        for key in device_keys(device, nprocs):
            _acquire(key, on_wait)
            taken.append(key)
        yield
    finally:
        for key in reversed(taken):
            _release(key)
