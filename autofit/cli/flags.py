"""The options the commands share, and one flag per declared knob and setting, generated from
its declaration (`declared_flags`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from autofit.cli.app import err
from autofit.config import DECLARED, Knob, coerce_declared

_Command = TypeVar("_Command", bound=Callable[..., Any])


MODEL = typer.Option(..., "--model", "-m", help="Preset name (see `autofit models`) or a path to "
                     "a HF config.json / model folder.")  # fmt: skip
GPUS = typer.Option(
    "auto",
    "--gpus",
    "-g",
    help="auto (all NVML GPUs; on every node of a torchrun/SLURM launch), N (first N), 0,2 "
    "(indices), or KxNAME / NxKxNAME (N nodes of K) for hardware you do not have, e.g. "
    "2xrtx3090, 8xh100-80gb, 4x8xh100-80gb (`autofit hardware --presets`).",
)
INTER_NODE_BANDWIDTH = typer.Option(
    None,
    "--inter-node-bandwidth",
    metavar="BW",
    help="The network between nodes, per GPU and direction, e.g. 400Gb/s or 50GB/s (default: "
    "the GPU class's usual cluster, `autofit hardware --presets`).",
)
GPU_MEMORY = typer.Option(
    None,
    "--gpu-memory",
    help="Cap each GPU at this size, e.g. 24GiB (emulates a smaller card; on --device cpu the "
    "capacity trials are held to).",
)
DEVICE = typer.Option(
    "cuda", "--device", help="cuda: trials on GPUs; cpu: the same trials on CPU with gloo."
)
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else.")


def renamed(old: str, old_value: Any, new: str, new_value: Any, default: Any) -> Any:
    """A renamed flag's old, hidden name still works (with a note on stderr); the new name wins
    when both are given."""
    if old_value is None:
        return new_value
    err.print(f"[yellow]note:[/] {old} is now {new}; the old name still works for now.")
    return old_value if new_value == default else new_value


def _knob_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _flag(d: Knob, note: str) -> Any:
    """The flag of a declared knob or setting: its help, its allowed values and its default
    (the `Config` value an unset flag leaves). No square brackets: rich reads them as markup."""
    if not d.searched:  # a setting: its own text, checked by `coerce_setting`
        return typer.Option(None, d.flag, metavar=d.metavar, help=d.help + note.format(d.name))
    if d.choices:
        allowed = "Allowed: " + ", ".join(_knob_text(v) for v in d.choices) + "."
    else:
        allowed = f"Allowed: {d.range_text}."
    text = f"{d.help}. {allowed} Default: {_knob_text(d.default)}."
    return typer.Option(None, d.flag, help=text + (f" {d.advice}" if d.advice else ""))


def gathered(
    command: _Command, into: str, flags: list[inspect.Parameter], at: Callable[[list[str]], int]
) -> _Command:
    """`command` with `flags` among its options, at the index `at` gives for the names of its own
    (all keyword-only); it receives their values as one dict, its parameter `into`."""
    names = [f.name for f in flags]

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in names}
        return command(*args, **{into: given}, **kwargs)

    params = inspect.signature(command).parameters.values()
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params if p.name != into]
    i = at([p.name for p in own])
    run.__signature__ = inspect.Signature(own[:i] + flags + own[i:])  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def option(name: str, default: Any, annotation: Any) -> inspect.Parameter:
    """A command's keyword-only parameter: its `typer.Option` and its type."""
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def flag(
    name: str,
    annotation: Any,
    help: str,
    default: Any = None,
    *,
    spelling: str = "",
    **extra: Any,
) -> inspect.Parameter:
    """A command's option declared as one row of its table: the keyword it arrives under, its
    type, its help and its default; its flag is the keyword spelled with dashes (`spelling` where
    it is another word) and, left out (None), its type admits None. `extra`: typer's other
    settings, e.g. `hidden`."""
    spelling = spelling or "--" + name.replace("_", "-")
    annotation = annotation | None if default is None else annotation
    return option(name, typer.Option(default, spelling, help=help, **extra), annotation)


def table_flags(table: list[inspect.Parameter]) -> Callable[[_Command], _Command]:
    """Give a command the options of `table`, in its order, before its own; it receives them as
    `options`, a dict of their values by keyword."""
    return lambda command: gathered(command, "options", table, lambda _: 0)


# The options that say what a command is for, under the keywords of the `autofit` API.
TARGET = {
    p.name: p
    for p in (
        option("model", MODEL, str),
        option("gpus", GPUS, str),
        option("gpu_memory", GPU_MEMORY, str | None),
        option("inter_node_bandwidth", INTER_NODE_BANDWIDTH, str | None),
        option("device", DEVICE, str),
    )
}


def target_flags(*names: str) -> Callable[[_Command], _Command]:
    """Give a command the `TARGET` options `names`, in that order, before its own; it receives
    them as `target`, a dict of their values (keywords of `autofit.estimate`, `trial`...)."""
    return lambda command: gathered(command, "target", [TARGET[n] for n in names], lambda _: 0)


def declared_flags(*, knobs: bool = True, note: str = ".") -> Callable[[_Command], _Command]:
    """Give a command one flag per declared knob (unless `knobs` is false) and setting
    (`autofit.config.DECLARED`), generated from the declaration, after its `--gpus` option. The
    command receives them as `declared`: the flags given, each checked (`ConfigError`, one
    paragraph) and normalised. `note` ends a setting's help (`{}` is its name)."""
    chosen = [d for d in DECLARED.values() if knobs or not d.searched]
    flags = [
        option(
            d.name, _flag(d, note), int | None if d.searched and d.choices is None else str | None
        )
        for d in chosen
    ]
    return lambda command: gathered(command, "declared", flags, _after_gpus)


def _after_gpus(names: list[str]) -> int:
    return names.index("gpus") + 1 if "gpus" in names else 0


def checked(given: dict[str, Any]) -> dict[str, Any]:
    """The flags given (`declared`), checked and normalised by their declarations
    (`coerce_declared`: each a `ConfigError` naming the flag's value and what is allowed)."""
    return {
        name: coerce_declared(name, value) for name, value in given.items() if value is not None
    }
