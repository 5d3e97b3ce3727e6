"""Writing a file so that a crash never leaves half of it: every file autofit writes for people or
for a later run (plans, exports, the calibration, the run folder, stored traces) goes through
`atomic_write`. Only regular files are read or replaced: a device (`/dev/full`, `/dev/zero`), a
FIFO or a socket at a path is refused before it is opened (`special_kind`), and an existing file
is read only as far as asked (`read_head`), so no path can hang autofit or fill its memory."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotARegularFile(OSError):
    """A path that holds something other than a regular file where autofit reads or writes one."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", str(path))
        self.kind = kind


def special_kind(path: str | Path) -> str | None:
    """What `path` is when it exists and is not a regular file ("a folder", "a FIFO (named
    pipe)", "a character device", ...), after symlinks; None for a regular file or no file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # absent, a dangling link, or not reachable: the caller's open says which
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


MAX_INPUT_BYTES = 16 << 20
"""The largest file autofit reads as a user's input (a model config, a space file): those are a
few KB; a larger one is not what was meant, and reading it whole could fill the memory."""


def too_large(path: str | Path) -> str | None:
    """Why the input file `path` is too large to read (its size), or None."""
    size = os.stat(path).st_size
    if size <= MAX_INPUT_BYTES:
        return None
    return f"it is {size:,} bytes, and an input file autofit reads is at most {MAX_INPUT_BYTES:,}"


def read_head(path: str | Path, limit: int) -> bytes:
    """At most `limit` bytes from the start of the regular file `path`. Anything else raises
    `NotARegularFile` without waiting: opened non-blocking, so a FIFO cannot hang the read."""
    kind = special_kind(path)
    if kind is not None:
        raise NotARegularFile(Path(path), kind)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode  # what was opened, should the path have changed
        if not stat.S_ISREG(mode):
            raise NotARegularFile(Path(path), "not a regular file")
        return f.read(limit)


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` via a temporary file in the same folder and `os.replace`: a reader
    sees the old file or the new one, never half of one. An existing file keeps its mode; a
    path holding anything but a regular file raises `NotARegularFile` (nothing is replaced)."""
    path = Path(path)
    kind = special_kind(path)
    if kind is not None:
        raise NotARegularFile(path, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            with contextlib.suppress(OSError):
                os.chmod(tmp, path.stat().st_mode & 0o777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
