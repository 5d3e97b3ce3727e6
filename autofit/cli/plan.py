"""`autofit plan` (the search, its live display, the report, the run folder) and `autofit
export` (a study's winner written again), with the launch lines both print."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

import autofit
from autofit import report
from autofit.checks import TRIAL_TIMEOUT_S
from autofit.cli.app import app, emit_json, err, fail, interrupted, out, warnings_to_stderr
from autofit.cli.data import data_flags
from autofit.cli.flags import (
    DEVICE,
    GPU_MEMORY,
    GPUS,
    INTER_NODE_BANDWIDTH,
    JSON,
    MODEL,
    declared_flags,
    renamed,
)
from autofit.errors import AutofitError, WriteError


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
    timeout = renamed("--timeout", timeout, "--search-timeout", search_timeout, None)
    unwritten = None
    try:
        from autofit.cli.checks import plan_flags

        console = err if json_out else out
        with warnings_to_stderr():
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

        check_export_target(fmt, output, "--output")
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


def print_launch(result: Any, fmt: str, path: Path) -> None:
    """The launch commands (`<your_train.py>` standing for the user's script; on several nodes
    each node's and the SLURM one, `autofit.export.launch_lines`) and what the script is, with a
    command that runs the shipped example where autofit runs from its sources."""
    from autofit.export import launch_lines, launch_note

    for line in launch_lines(result, fmt, path):
        where = f" ({line.where})" if line.where else ""
        out.print(f"launch{where}: {line.command}", soft_wrap=True, markup=False)
    out.print(f"  {launch_note(result, fmt, path)}", soft_wrap=True, markup=False)
