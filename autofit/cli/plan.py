"""`autofit plan` (the search, its live display, the report, the run folder) and `autofit
export` (a study's winner written again), with the launch lines both print."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

import autofit
from autofit import report
from autofit.checks import SEARCH_TIMEOUT_S, TRIAL_TIMEOUT_S
from autofit.cli.app import app, emit_json, err, fail, interrupted, out, warnings_to_stderr
from autofit.cli.data import data_flags
from autofit.cli.flags import JSON, TARGET, declared_flags, flag, renamed, table_flags
from autofit.errors import AutofitError, WriteError
from autofit.request import DEFAULT_MARGIN, DEFAULT_TRIALS
from autofit.trials.budget import LIMIT_FACTOR, LIMIT_SLACK_S

# The options of `autofit plan`, in the order its --help lists them (the settings follow --gpus,
# the data flags come before --json): keyword, type, help, default (`flag`). `CLI_ONLY`: the
# CLI's own and those `autofit.plan` takes under another name; the others are its keywords.
PLAN = [
    TARGET["model"],
    TARGET["gpus"],
    flag("seq_len", int, "Tokens per sequence (default: the space's, 2048)."),
    flag("global_batch", int, "Sequences per optimizer step; grad_accum is derived from it."),
    flag("space", str, "Search space: default, qlora, lora, full, or a .yaml path.", "default"),
    flag("trials", int, f"Real trials (default {DEFAULT_TRIALS}; 0: none)."),
    flag("no_trials", bool, "Estimates only: no GPU needed.", False),
    flag("search_timeout", float,
         f"Seconds for the whole search: no new trial starts after it (default "
         f"{SEARCH_TIMEOUT_S:g}; each trial is held to a limit from its estimate, at most "
         "--trial-timeout)."),
    flag("timeout", float, "Old name of --search-timeout.", hidden=True),
    flag("trial_timeout", float,
         f"Seconds one trial may run before it is killed (default: each trial's own limit, "
         f"{LIMIT_FACTOR:g}x the time its estimate expects + {LIMIT_SLACK_S:g} s, at most "
         f"{TRIAL_TIMEOUT_S:g})."),
    flag("steps", int, "Measured steps per trial.", 3),
    flag("margin", float, "Headroom the winner must keep (0.05 = 5%).", DEFAULT_MARGIN),
    TARGET["device"],
    TARGET["gpu_memory"],
    TARGET["inter_node_bandwidth"],
    flag("storage", str, "Optuna storage URL (default: SQLite in the run folder)."),
    flag("study", str, "Study name (default: derived from model, GPUs, space)."),
    flag("run_dir", Path, "Folder for the study, plan and plot (default: ./autofit-runs/<study>)."),
    flag("no_prune", bool, "Let trials run candidates the estimate rules out.", False),
    flag("calibration", str,
         "auto: start from this machine's stored calibration, correct the estimate with every "
         "trial, store it (default); study: this study's trials alone; off: the napkin alone."),
    flag("no_calibration", bool, "Ignore stored calibration and do not calibrate (= off).", False),
    flag("node_rank", int,
         "This node of several (0 chooses the trials, the others join them), where no "
         "torchrun/SLURM launch says it; every node's planner needs the same --storage and "
         "--study."),
    flag("export_path", Path, "Write the winner to this file.", spelling="--export"),
    flag("fmt", str, "autofit (default), accelerate, trainer", spelling="--format"),
]  # fmt: skip
CLI_ONLY = (
    "trials", "no_trials", "search_timeout", "timeout", "no_prune", "calibration",
    "no_calibration", "export_path", "fmt",
)  # fmt: skip


@app.command()
@declared_flags(knobs=False, note="; replaces the space file's {}.")
@data_flags
@table_flags(PLAN)
def plan(
    declared: dict[str, Any], data: dict[str, Any], options: dict[str, Any], json_out: bool = JSON
) -> None:
    """Plan: estimate every candidate, prune what cannot fit, trial the best, pick the winner."""
    kept = {name: value for name, value in options.items() if name not in CLI_ONLY}
    timeout = renamed("--timeout", options["timeout"], "--search-timeout",
                      options["search_timeout"], None)  # fmt: skip
    export_path, no_prune = options["export_path"], options["no_prune"]
    unwritten = None
    try:
        from autofit.cli.checks import plan_flags

        console = err if json_out else out
        with warnings_to_stderr():
            n_trials, calibration, fmt = plan_flags(
                trials=options["trials"], no_trials=options["no_trials"],
                calibration=options["calibration"], no_calibration=options["no_calibration"],
                fmt=options["fmt"], export_path=export_path,
                trial_only={"--search-timeout": timeout, "--storage": kept["storage"],
                            "--study": kept["study"], "--run-dir": kept["run_dir"],
                            "--node-rank": kept["node_rank"], "--no-prune": no_prune},
            )  # fmt: skip
            result = autofit.plan(
                **kept, trials=n_trials, prune=not no_prune,
                timeout=timeout if timeout is not None else SEARCH_TIMEOUT_S,
                calibration=calibration,
                **{name: value for name, value in declared.items() if value is not None},
                console=None if json_out else console,
                **data,
            )  # fmt: skip
        written: list[Path] = []
        if export_path is not None and result.best is not None:
            written = result.export(fmt, export_path)
    except AutofitError as exc:  # a file not written: the search's result first, then why
        if not isinstance(exc, WriteError) or exc.plan is None:
            fail(exc, json_out, "plan")
        result, written, unwritten = exc.plan, [], exc
    except KeyboardInterrupt as exc:
        interrupted(
            exc,
            json_out,
            "Finished trials are kept in the study: run the same command again to resume (no "
            "finished trial is repeated; the interrupted one runs first).",
        )
    if json_out:
        emit_json({**result.to_dict(), **({"error": str(unwritten)} if unwritten else {})})
    else:
        report.plan_report(out, result, written)
        if written:
            print_launch(result, fmt, written[0])
    if unwritten:
        fail(unwritten)  # under --json: the error is in the plan's object above
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

        fmt = check_export_target(fmt, output, "--output")
        check_sqlite_exists(storage)  # opening a mistyped SQLite path would create an empty one
        result = load_study_plan(storage, study)
        written = result.export(fmt, output)
    except AutofitError as exc:
        fail(exc, json_out, "export")
    if json_out:
        emit_json(_export_dict(result, fmt, written))
        return
    for path in written:
        out.print(f"wrote {path}")
    print_launch(result, fmt, written[0])


def _export_dict(result: Any, fmt: str, written: list[Path]) -> dict[str, Any]:
    """`autofit export --json`: the files written, the launch commands and the winner."""
    from autofit.export import launch_lines, launch_note

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


def print_launch(result: Any, fmt: str, path: Path) -> None:
    """The launch commands (`<your_train.py>` standing for the user's script; on several nodes
    each node's and the SLURM one, `autofit.export.launch_lines`) and what the script is, with a
    command that runs the shipped example where autofit runs from its sources."""
    from autofit.export import launch_lines, launch_note

    for line in launch_lines(result, fmt, path):
        where = f" ({line.where})" if line.where else ""
        out.print(f"launch{where}: {line.command}", soft_wrap=True, markup=False)
    out.print(f"  {launch_note(result, fmt, path)}", soft_wrap=True, markup=False)
