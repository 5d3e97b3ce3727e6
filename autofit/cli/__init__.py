"""`autofit` command line (typer): a thin layer over the public API in `autofit/__init__.py`.

The rooms: `app` (the app, consoles, errors), `flags` (shared options and the declared knobs'
flags), `data` (the data flags), `checks` (flags of `plan` that contradict each other),
`commands` (hardware, models, estimate, trial, calibrate) and `plan` (plan, export)."""

from __future__ import annotations

import sys

import typer

from autofit.cli import commands, plan  # noqa: F401 - registers the commands on `app`
from autofit.cli.app import app, err, usage_error
from autofit.cli.flags import declared_flags

__all__ = ["app", "declared_flags", "main"]


def main(argv: list[str] | None = None) -> None:
    """The `autofit` command. Usage errors (a bad option value, a missing option) come out as
    autofit's own errors do: one paragraph on stderr, or one JSON object on stdout under --json;
    exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    options = args[: args.index("--")] if "--" in args else args
    # typer raises click's exceptions (its own vendored copy in newer typer): find their classes
    click_exception = sys.modules[typer.BadParameter.__module__].ClickException
    try:
        code = app(args=args, prog_name="autofit", standalone_mode=False)
    except click_exception as exc:
        if type(exc).__name__ != "NoArgsIsHelpError":  # that one printed the help already
            usage_error(exc, "--json" in options)
        code = exc.exit_code
    except typer.Abort:
        err.print("Aborted.")
        code = 1
    sys.exit(code if isinstance(code, int) else 0)
