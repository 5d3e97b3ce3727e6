"""The `autofit` app (typer) and what every command shares: the consoles (sized for the
terminal), errors as one paragraph or one JSON object, warnings and interrupts."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any, NoReturn

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape

import autofit
from autofit import interrupt
from autofit.checks import sane_columns, terminal_columns
from autofit.errors import AutofitError
from autofit.interrupt import stop_signals_interrupt

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Find the fastest LLM fine-tuning config that will not run out of GPU memory.",
    pretty_exceptions_enable=False,
    # click's own help pages: typer's rich tables cut option names to fit (--inter-node-bandwi…);
    # click wraps each option's help beside its whole name
    rich_markup_mode=None,
)


PIPE_WIDTH = 160
"""Columns of output that goes to neither a terminal nor a width named by `COLUMNS` (a pipe, CI)."""


class _Console(Console):
    """rich's Console as wide as the terminal, or as `COLUMNS` says (read when printing, so a
    width set after import counts; a width no terminal has is `DEFAULT_COLUMNS`:
    `checks.terminal_columns`); elsewhere (pipes, CI, tests) `PIPE_WIDTH`, so long lines are
    not wrapped at rich's 80."""

    @property  # type: ignore[override]
    def size(self) -> ConsoleDimensions:
        size = super().size
        columns = terminal_columns(os.environ.get("COLUMNS"))
        if columns is not None:
            return ConsoleDimensions(columns, size.height)
        if self.is_terminal:
            return size
        return ConsoleDimensions(PIPE_WIDTH, size.height)


def console(stderr: bool = False) -> Console:
    return _Console(stderr=stderr, highlight=False)


sane_columns()  # before any console reads COLUMNS: these two, and typer's for the help pages
out = console()
err = console(stderr=True)


def _version(value: bool) -> None:
    if value:
        print(f"autofit {autofit.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        help="Also show other libraries' raw notices (torch, torchao, transformers, peft), here "
        "and in trial processes; without it only autofit's own lines reach the terminal.",
    ),
) -> None:
    """Find the fastest LLM fine-tuning config that will not run out of GPU memory."""
    stop_signals_interrupt()  # SIGTERM/SIGHUP (SLURM, docker stop, timeout) act like Ctrl-C
    sane_columns()  # COLUMNS may have changed since import (an app run in process)
    if verbose:
        from autofit.quiet import set_verbose

        set_verbose(True)


def interrupted(exc: KeyboardInterrupt, json_out: bool, what: str) -> NoReturn:
    """Stopped by Ctrl-C, SIGTERM or SIGHUP: the running trial's processes are already gone."""
    text = f"Interrupted ({interrupt.name(exc)}). {what}"
    if json_out:
        emit_json({"error": text, "interrupted": True})
    else:
        err.print(f"\n[yellow]{escape(text)}[/]", soft_wrap=True)
    raise typer.Exit(interrupt.exit_code(exc)) from None


def fail(exc: AutofitError, json_out: bool = False, command: str | None = None) -> NoReturn:
    """One paragraph on stderr (user text escaped: rich would eat `[none, nf4]`), or with
    --json one object `{"error": ..., "hint": ...}` on stdout; exit 2 either way."""
    hint = getattr(exc, "hint", None)
    if json_out:
        text = str(exc)
        if hint and text.endswith(hint):
            text = text[: -len(hint)].rstrip()
        emit_json({"error": text, "hint": hint or help_hint(command)})
    else:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(2)


def help_hint(command: str | None = None) -> str:
    where = f"autofit {command} --help" if command else "autofit --help"
    return f"Run `{where}` for the options and the values they allow."


@contextlib.contextmanager
def warnings_to_stderr() -> Iterator[None]:
    """autofit's warnings (allowed, but probably not meant) as one `warning:` paragraph each on
    stderr, also under --json (stdout stays one JSON object), each said once however many checks
    meet it (the CLI's cheap checks and the API's); other warnings as Python shows them. A model
    traced for the first time (seconds) is announced there too (`arch.trace_notices`).
    """
    from autofit.arch import trace_notices
    from autofit.checks import AutofitWarning

    def tracing(text: str) -> None:
        err.print(text, markup=False, highlight=False, soft_wrap=True)

    with warnings.catch_warnings(), trace_notices(tracing):
        warnings.simplefilter("always", AutofitWarning)
        shown = warnings.showwarning
        said: set[str] = set()

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if issubclass(category, AutofitWarning):
                if str(message) not in said:
                    said.add(str(message))
                    err.print(f"[yellow]warning:[/] {escape(str(message))}", soft_wrap=True)
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def usage_error(exc: Any, json_out: bool) -> None:
    ctx = getattr(exc, "ctx", None)
    command = ctx.info_name if ctx is not None and ctx.parent is not None else None
    message = " ".join(exc.format_message().split())
    message += "" if message.endswith((".", "?", "!")) else "."
    if json_out:
        emit_json({"error": message, "hint": help_hint(command)})
    else:
        err.print(f"[red]error:[/] {escape(message)} {escape(help_hint(command))}", soft_wrap=True)
