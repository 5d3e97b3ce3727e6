"""The progress bar of reading a dataset: rich, on stderr, only where stderr is a terminal (never
in a pipe, a log or under --json, where stdout is one JSON object). Torch-free."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

# (done, total) in the reader's units (bytes or rows); total None: not known beforehand
Progress = Callable[[int, "int | None"], None]


@contextlib.contextmanager
def stderr_bar(label: str, enabled: bool = True) -> Iterator[Progress | None]:
    """A `Progress` callback drawing a transient bar on stderr, or None where it would not be
    seen (`enabled` false, or stderr not a terminal)."""
    from rich.console import Console

    from autofit.checks import terminal_columns

    # COLUMNS as a terminal can have it (0 would draw nothing); None: rich measures the terminal
    console = Console(stderr=True, width=terminal_columns(os.environ.get("COLUMNS")))
    if not enabled or not console.is_terminal:
        yield None
        return
    from rich import progress as rp

    columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.TaskProgressColumn(),
               rp.TimeElapsedColumn())  # fmt: skip
    with rp.Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        yield update
