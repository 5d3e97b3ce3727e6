"""`autofit` command line (typer): a thin layer over the public API in `autofit/__init__.py`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape

import autofit
from autofit import interrupt, report
from autofit.checks import TRIAL_TIMEOUT_S
from autofit.cli_data import data_flags, data_lengths, lengths_dict
from autofit.config import DECLARED, Knob, coerce_knob
from autofit.errors import AutofitError, WriteError
from autofit.interrupt import stop_signals_interrupt
from autofit.settings import coerce_setting
from autofit.units import fmt_bytes

_Command = TypeVar("_Command", bound=Callable[..., Any])

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Find the fastest LLM fine-tuning config that will not run out of GPU memory.",
    pretty_exceptions_enable=False,
)


PIPE_WIDTH = 160
"""Columns of output that goes to neither a terminal nor a width named by `COLUMNS` (a pipe, CI)."""


class _Console(Console):
    """rich's Console as wide as the terminal, or as `COLUMNS` says (read when printing, so a
    width set after import counts); elsewhere (pipes, CI, tests) `PIPE_WIDTH`, so long lines
    are not wrapped at rich's 80."""

    @property  # type: ignore[override]
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self.is_terminal or os.environ.get("COLUMNS", "").strip().isdigit():
            return size
        return ConsoleDimensions(PIPE_WIDTH, size.height)


def _console(stderr: bool = False) -> Console:
    return _Console(stderr=stderr, highlight=False)


out = _console()
err = _console(stderr=True)


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
    if verbose:
        from autofit.quiet import set_verbose

        set_verbose(True)


def _interrupted(exc: KeyboardInterrupt, json_out: bool, what: str) -> NoReturn:
    """Stopped by Ctrl-C, SIGTERM or SIGHUP: the running trial's processes are already gone."""
    text = f"Interrupted ({interrupt.name(exc)}). {what}"
    if json_out:
        _emit_json({"error": text, "interrupted": True})
    else:
        err.print(f"\n[yellow]{escape(text)}[/]", soft_wrap=True)
    raise typer.Exit(interrupt.exit_code(exc)) from None


def _fail(exc: AutofitError, json_out: bool = False, command: str | None = None) -> NoReturn:
    """One paragraph on stderr (user text escaped: rich would eat `[none, nf4]`), or with
    --json one object `{"error": ..., "hint": ...}` on stdout; exit 2 either way."""
    hint = getattr(exc, "hint", None)
    if json_out:
        text = str(exc)
        if hint and text.endswith(hint):
            text = text[: -len(hint)].rstrip()
        _emit_json({"error": text, "hint": hint or _help_hint(command)})
    else:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(2)


def _help_hint(command: str | None = None) -> str:
    where = f"autofit {command} --help" if command else "autofit --help"
    return f"Run `{where}` for the options and the values they allow."


@contextlib.contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """autofit's warnings (allowed, but probably not meant) as one `warning:` paragraph each on
    stderr, also under --json (stdout stays one JSON object); other warnings as Python shows them.
    A model traced for the first time (seconds) is announced there too (`arch.trace_notices`).
    """
    from autofit.arch import trace_notices
    from autofit.checks import AutofitWarning

    def tracing(text: str) -> None:
        err.print(text, markup=False, highlight=False, soft_wrap=True)

    with warnings.catch_warnings(), trace_notices(tracing):
        warnings.simplefilter("always", AutofitWarning)
        shown = warnings.showwarning

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if issubclass(category, AutofitWarning):
                err.print(f"[yellow]warning:[/] {escape(str(message))}", soft_wrap=True)
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield


def _emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


# ----- shared options ---------------------------------------------------------------------------
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


def _renamed(old: str, old_value: Any, new: str, new_value: Any, default: Any) -> Any:
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


def declared_flags(*, knobs: bool = True, note: str = ".") -> Callable[[_Command], _Command]:
    """Give a command one flag per declared knob (unless `knobs` is false) and setting
    (`autofit.config.DECLARED`), generated from the declaration, after its `--gpus` option. The
    command receives them as `declared`: the flags given, each checked (`ConfigError`, one
    paragraph) and normalised. `note` ends a setting's help (`{}` is its name)."""

    def wrap(command: _Command) -> _Command:
        chosen = [d for d in DECLARED.values() if knobs or not d.searched]
        names = {d.name for d in chosen}

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in names}
            return command(*args, declared=given, **kwargs)

        flags = [
            inspect.Parameter(
                d.name, inspect.Parameter.KEYWORD_ONLY, default=_flag(d, note),
                annotation=int | None if d.searched and d.choices is None else str | None,
            )
            for d in chosen
        ]  # fmt: skip
        own = [p for p in inspect.signature(command).parameters.values() if p.name != "declared"]
        at = next((i + 1 for i, p in enumerate(own) if p.name == "gpus"), 0)
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        run.__signature__ = inspect.Signature(params[:at] + flags + params[at:])  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return wrap


def _checked(given: dict[str, Any]) -> dict[str, Any]:
    """The flags given (`declared`), checked and normalised: knobs by `coerce_knob`, settings by
    `coerce_setting` (each a `ConfigError` naming the flag's value and what is allowed)."""
    return {
        name: (coerce_knob if DECLARED[name].searched else coerce_setting)(name, value)
        for name, value in given.items()
        if value is not None
    }


# ----- commands ---------------------------------------------------------------------------------
@app.command()
def hardware(
    json_out: bool = JSON,
    presets: bool = typer.Option(False, "--presets", help="List the what-if GPU presets."),
) -> None:
    """List the GPUs (NVML), their links, host RAM and cores; or the what-if presets."""
    from autofit.hardware import GPU_PRESETS, NoDriver, local_hardware
    from autofit.hardware.spec import cpu_cores, host_ram_bytes

    if presets:
        if json_out:
            _emit_json({"presets": [_preset_dict(p) for p in GPU_PRESETS.values()]})
        else:
            out.print(report.presets_table())
        return
    try:
        hw = local_hardware()
        reason = None
    except NoDriver as exc:
        hw, reason = None, str(exc)
    if json_out:
        data = hw.to_dict() if hw else {
            "gpus": [], "pairs": [], "host_ram_bytes": host_ram_bytes(),
            "cpu_cores": cpu_cores(), "source": "none", "reason": reason,
        }  # fmt: skip
        _emit_json(data)
        return
    if hw is None:
        out.print(
            f"No NVIDIA GPU driver found ({escape(str(reason))}), so there are no GPUs to list.\n"
            f"Host: {fmt_bytes(host_ram_bytes())} RAM, {cpu_cores()} CPU cores.\n"
            "You can still plan: name the hardware with --gpus KxNAME (e.g. --gpus 2xrtx3090; "
            "`autofit hardware --presets` lists the names) and add --no-trials, or run real "
            "trials of small models with --device cpu."
        )
        return
    if not hw.gpus:
        out.print("NVML is present but reports no GPUs.")
    else:
        out.print(report.hardware_table(hw))
        pairs = report.pairs_table(hw)
        if pairs is not None:
            out.print(pairs)
    out.print(f"Host: {fmt_bytes(hw.host_ram_bytes)} RAM, {hw.cpu_cores} CPU cores.")


def _preset_dict(p: Any) -> dict[str, Any]:
    return {
        "name": p.name,
        "gpu": p.full_name,
        "memory_bytes": p.memory_bytes,
        "bf16_tflops": p.bf16_tflops,
        "mem_bw_gbs": p.mem_bw_gbs,
        "interconnect": p.interconnect,
        "link_bw_gbs": p.link_bw_gbs,
        "network": p.network,
        "inter_node_bw_gbs": p.inter_node_bw_gbs,
        "compute_capability": f"{p.compute_capability[0]}.{p.compute_capability[1]}",
        "bf16": p.bf16,
        "fp8": p.fp8,
    }


@app.command()
def models(json_out: bool = JSON) -> None:
    """List the model presets with their exact parameter counts."""
    from autofit.models import PRESETS

    if json_out:
        from autofit.arch import structure_of

        _emit_json(
            {
                "models": [
                    {**m.to_dict(), "n_params": structure_of(m).n_params} for m in PRESETS.values()
                ]
            }  # fmt: skip
        )
    else:
        out.print(report.models_table(PRESETS.values()))


@app.command()
@declared_flags()
@data_flags
def estimate(
    declared: dict[str, Any],
    data: dict[str, Any],
    model: str = MODEL,
    gpus: str = GPUS,
    gpu_memory: str | None = GPU_MEMORY,
    inter_node_bandwidth: str | None = INTER_NODE_BANDWIDTH,
    device: str = DEVICE,
    json_out: bool = JSON,
) -> None:
    """Napkin estimate of one config: peak memory per GPU with a breakdown, and step time."""
    try:
        knobs = _checked(declared)
        with _warnings_to_stderr():
            est = autofit.estimate(
                model, gpus, gpu_memory=gpu_memory, device=device,
                inter_node_bandwidth=inter_node_bandwidth, **knobs,
            )  # fmt: skip
            hist = data_lengths(**data, progress=not json_out)
    except AutofitError as exc:
        _fail(exc, json_out, "estimate")
    seq_len = est.config.seq_len
    if json_out:
        _emit_json({**est.to_dict(), **lengths_dict(hist, seq_len)})
        return
    from autofit.hardware import resolve_hardware
    from autofit.models import resolve_model

    hw = resolve_hardware(
        gpus, device=device, gpu_memory=gpu_memory, inter_node_bandwidth=inter_node_bandwidth
    )
    report.estimate_report(
        out, resolve_model(model), hw, est, device, requested_wrap=knobs.get("wrap", "auto")
    )
    if hist is not None:
        out.print(report.lengths_line(hist, seq_len), markup=False)


@app.command()
@declared_flags()
def trial(
    declared: dict[str, Any],
    model: str = MODEL,
    gpus: str = GPUS,
    gpu_memory: str | None = GPU_MEMORY,
    device: str = DEVICE,
    steps: int = typer.Option(3, "--steps", help="Measured optimizer steps (after 1 warm-up)."),
    trial_timeout: float = typer.Option(
        TRIAL_TIMEOUT_S,
        "--trial-timeout",
        help="Seconds before the trial is killed (every process of it).",
    ),
    timeout: float | None = typer.Option(
        None, "--timeout", hidden=True, help="Old name of --trial-timeout."
    ),
    json_out: bool = JSON,
) -> None:
    """Run one real trial: a few training steps (plain module, DDP or FSDP2, as --wrap and --gpus
    say) in their own processes, measured."""
    timeout = _renamed("--timeout", timeout, "--trial-timeout", trial_timeout, TRIAL_TIMEOUT_S)
    try:
        knobs = _checked(declared)
        if not json_out:
            err.print(
                f"Running a trial of {escape(model)} on {escape(gpus)} ({escape(device)}) ..."
            )
        with _warnings_to_stderr():
            result = autofit.trial(
                model, gpus, device=device, gpu_memory=gpu_memory, steps=steps,
                trial_timeout=timeout,
                **knobs,
            )  # fmt: skip
    except AutofitError as exc:
        _fail(exc, json_out, "trial")
    except KeyboardInterrupt as exc:
        _interrupted(exc, json_out, "The trial was stopped and its processes killed.")
    if json_out:
        _emit_json(result.to_dict())
    else:
        report.trial_report(out, result, requested_wrap=knobs.get("wrap", "auto"))
    if result.status not in ("ok", "oom"):
        raise typer.Exit(1)


@app.command()
def calibrate(
    gpus: str = GPUS,
    device: str = DEVICE,
    gpu_memory: str | None = GPU_MEMORY,
    steps: int = typer.Option(3, "--steps", help="Measured optimizer steps per trial."),
    trial_timeout: float = typer.Option(
        TRIAL_TIMEOUT_S, "--trial-timeout", help="Seconds one trial may run before it is killed."
    ),
    quick: bool = typer.Option(
        False, "--quick", help="One model, six trials: rougher, in about a third of the time."
    ),
    json_out: bool = JSON,
) -> None:
    """Calibrate this machine: a short sweep of real trials of small models, fitted and stored
    so that every later plan here starts from measured corrections to the estimate."""
    console = err if json_out else out

    def started(i: int, n: int, model: str, cfg: Any) -> None:
        if json_out:
            return
        if i == 0:  # the input was good: the sweep begins
            err.print(f"Calibrating {gpus} ({device}): {n} short trials ...", markup=False)
        err.print(f"[{i + 1}/{n}] {model} {cfg.short()} ...", markup=False, highlight=False)

    def finished(i: int, n: int, t: Any) -> None:
        if not json_out:
            out.print(report.sweep_line(t), markup=False, highlight=False)

    try:
        with _warnings_to_stderr():
            result = autofit.calibrate(
                gpus, device=device, gpu_memory=gpu_memory, steps=steps,
                trial_timeout=trial_timeout, quick=quick, on_start=started, on_trial=finished,
            )  # fmt: skip
    except AutofitError as exc:
        _fail(exc, json_out, "calibrate")
    except KeyboardInterrupt as exc:
        _interrupted(
            exc, json_out,
            "The running trial was stopped and its processes killed; nothing was stored.",
        )  # fmt: skip
    if json_out:
        _emit_json(result.to_dict())
    else:
        report.calibration_report(console, result)
    if not result.path:
        raise typer.Exit(1)


@app.command()
@declared_flags(knobs=False, note="; replaces the space file's {}.")
@data_flags
def plan(
    declared: dict[str, Any],
    data: dict[str, Any],
    model: str = MODEL,
    gpus: str = GPUS,
    seq_len: int | None = typer.Option(
        None, "--seq-len", help="Tokens per sequence (default: the space's, 2048)."
    ),
    global_batch: int | None = typer.Option(
        None, "--global-batch", help="Sequences per optimizer step; grad_accum is derived from it."
    ),
    space: str = typer.Option(
        "default", "--space", help="Search space: default, qlora, lora, full, or a .yaml path."
    ),
    trials: int | None = typer.Option(None, "--trials", help="Real trials (default 20; 0: none)."),
    no_trials: bool = typer.Option(False, "--no-trials", help="Estimates only: no GPU needed."),
    search_timeout: float | None = typer.Option(
        None,
        "--search-timeout",
        help="Seconds for the whole search: no new trial starts after it (default: no limit).",
    ),
    timeout: float | None = typer.Option(
        None, "--timeout", hidden=True, help="Old name of --search-timeout."
    ),
    trial_timeout: float = typer.Option(
        TRIAL_TIMEOUT_S, "--trial-timeout", help="Seconds one trial may run before it is killed."
    ),
    steps: int = typer.Option(3, "--steps", help="Measured steps per trial."),
    margin: float = typer.Option(
        0.05, "--margin", help="Headroom the winner must keep (0.05 = 5%)."
    ),
    device: str = DEVICE,
    gpu_memory: str | None = GPU_MEMORY,
    inter_node_bandwidth: str | None = INTER_NODE_BANDWIDTH,
    storage: str | None = typer.Option(
        None, "--storage", help="Optuna storage URL (default: SQLite in the run folder)."
    ),
    study: str | None = typer.Option(
        None, "--study", help="Study name (default: derived from model, GPUs, space)."
    ),
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="Folder for the study, plan and plot (default: ./autofit-runs/<study>).",
    ),
    no_prune: bool = typer.Option(
        False, "--no-prune", help="Let trials run candidates the estimate rules out."
    ),
    calibration: str | None = typer.Option(
        None,
        "--calibration",
        help="auto: start from this machine's stored calibration, correct the estimate with "
        "every trial, store it (default); study: this study's trials alone; off: the napkin alone.",
    ),
    no_calibration: bool = typer.Option(
        False, "--no-calibration", help="Ignore stored calibration and do not calibrate (= off)."
    ),
    node_rank: int | None = typer.Option(
        None,
        "--node-rank",
        help="This node of several (0 chooses the trials, the others join them), where no "
        "torchrun/SLURM launch says it; every node's planner needs the same --storage and --study.",
    ),
    export_path: Path | None = typer.Option(
        None, "--export", help="Write the winner to this file."
    ),
    fmt: str | None = typer.Option(None, "--format", help="autofit (default), accelerate, trainer"),
    json_out: bool = JSON,
) -> None:
    """Plan: estimate every candidate, prune what cannot fit, trial the best, pick the winner."""
    timeout = _renamed("--timeout", timeout, "--search-timeout", search_timeout, None)
    unwritten = None
    try:
        from autofit.cli_checks import plan_flags

        console = err if json_out else out
        with _warnings_to_stderr():
            n_trials, calibration, fmt = plan_flags(
                trials=trials, no_trials=no_trials, calibration=calibration,
                no_calibration=no_calibration, fmt=fmt, export_path=export_path,
                trial_only={"--search-timeout": timeout, "--storage": storage, "--study": study,
                            "--run-dir": run_dir, "--node-rank": node_rank, "--no-prune": no_prune},
            )  # fmt: skip
            result = autofit.plan(
                model, gpus, seq_len=seq_len, global_batch=global_batch, space=space,
                trials=n_trials, timeout=timeout, trial_timeout=trial_timeout, steps=steps,
                margin=margin, device=device, gpu_memory=gpu_memory,
                inter_node_bandwidth=inter_node_bandwidth, storage=storage,
                study=study, run_dir=run_dir, prune=not no_prune,
                **{name: value for name, value in declared.items() if value is not None},
                console=None if json_out else console,
                calibration=calibration, node_rank=node_rank,
                **data,
            )  # fmt: skip
        written: list[Path] = []
        if export_path is not None and result.best is not None:
            written = result.export(fmt, export_path)
    except AutofitError as exc:  # a file not written: the search's result first, then why
        if not isinstance(exc, WriteError) or exc.plan is None:
            _fail(exc, json_out, "plan")
        result, written, unwritten = exc.plan, [], exc
    except KeyboardInterrupt as exc:
        _interrupted(
            exc,
            json_out,
            "Finished trials are kept in the study: run the same command again to resume (no "
            "finished trial is repeated; the interrupted one runs first).",
        )
    if json_out:
        _emit_json({**result.to_dict(), **({"error": str(unwritten)} if unwritten else {})})
    else:
        report.plan_report(out, result, written)
        if written:
            _print_launch(result, fmt, written[0])
    if unwritten:
        _fail(unwritten)  # under --json: the error is in the plan's object above
    if result.best is None:
        raise typer.Exit(1)


@app.command()
def export(
    storage: str = typer.Option(..., "--storage", help="Optuna storage URL of the study."),
    study: str = typer.Option(..., "--study", help="Study name."),
    fmt: str = typer.Option("autofit", "--format", help="autofit, accelerate or trainer."),
    output: Path = typer.Option(..., "--output", "-o", help="File to write."),
    json_out: bool = JSON,
) -> None:
    """Export the winner of an existing study without running anything."""
    try:
        from autofit.checks import check_sqlite_exists
        from autofit.export import check_export_target
        from autofit.search import load_study_plan

        check_export_target(fmt, output, "--output")
        check_sqlite_exists(storage)  # opening a mistyped SQLite path would create an empty one
        result = load_study_plan(storage, study)
        written = result.export(fmt, output)
    except AutofitError as exc:
        _fail(exc, json_out, "export")
    if json_out:
        _emit_json(_export_dict(result, fmt, written))
        return
    for path in written:
        out.print(f"wrote {path}")
    _print_launch(result, fmt, written[0])


def _export_dict(result: Any, fmt: str, written: list[Path]) -> dict[str, Any]:
    """`autofit export --json`: the files written, the launch commands and the winner."""
    from autofit.export import launch_lines, launch_note

    fmt = fmt.strip().lower()
    best = result.best
    return {
        "format": fmt,
        "written": [str(p) for p in written],
        "launch": [
            {"command": line.command, "where": line.where}
            for line in launch_lines(result, fmt, written[0])
        ],
        "launch_note": launch_note(result, fmt, written[0]),
        "best": best.to_dict() if best is not None else None,
        "reason": result.reason,
    }


def _print_launch(result: Any, fmt: str, path: Path) -> None:
    """The launch commands (`<your_train.py>` standing for the user's script; on several nodes
    each node's and the SLURM one, `autofit.export.launch_lines`) and what the script is, with a
    command that runs the shipped example where autofit runs from its sources."""
    from autofit.export import launch_lines, launch_note

    for line in launch_lines(result, fmt, path):
        where = f" ({line.where})" if line.where else ""
        out.print(f"launch{where}: {line.command}", soft_wrap=True, markup=False)
    out.print(f"  {launch_note(result, fmt, path)}", soft_wrap=True, markup=False)


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
            _usage_error(exc, "--json" in options)
        code = exc.exit_code
    except typer.Abort:
        err.print("Aborted.")
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


def _usage_error(exc: Any, json_out: bool) -> None:
    ctx = getattr(exc, "ctx", None)
    command = ctx.info_name if ctx is not None and ctx.parent is not None else None
    message = " ".join(exc.format_message().split())
    message += "" if message.endswith((".", "?", "!")) else "."
    if json_out:
        _emit_json({"error": message, "hint": _help_hint(command)})
    else:
        err.print(f"[red]error:[/] {escape(message)} {escape(_help_hint(command))}", soft_wrap=True)


if __name__ == "__main__":  # pragma: no cover
    main()
