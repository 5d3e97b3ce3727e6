"""SIGTERM and SIGHUP behave like Ctrl-C.

SLURM, `docker stop`, `timeout` and a closed terminal stop a process with SIGTERM or SIGHUP, not
SIGINT. The CLI turns them into `Terminated`, a `KeyboardInterrupt`, so the same clean-up runs:
the running trial's processes are killed, the study keeps every finished trial, and the command
says how to resume and exits with 128 + the signal's number.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class Terminated(KeyboardInterrupt):
    """A stop signal other than SIGINT, raised where the main thread is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, _frame: FrameType | None) -> None:
    raise Terminated(signum)


def stop_signals_interrupt() -> None:
    """Make SIGTERM and SIGHUP raise `Terminated` (only possible on the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)


def exit_code(exc: KeyboardInterrupt) -> int:
    """128 + the signal's number, as a shell reports a process a signal stopped."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def name(exc: KeyboardInterrupt) -> str:
    return signal.Signals(exc.signum).name if isinstance(exc, Terminated) else "Ctrl-C"
