"""The commands that look or measure: hardware, models, estimate, trial and calibrate."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

import autofit
from autofit import report
from autofit.checks import TRIAL_TIMEOUT_S
from autofit.cli.app import app, emit_json, err, fail, interrupted, out, warnings_to_stderr
from autofit.cli.data import data_flags, lengths_dict
from autofit.cli.flags import JSON, checked, declared_flags, renamed, target_flags
from autofit.data.source import data_lengths
from autofit.errors import AutofitError
from autofit.units import fmt_bytes


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
            emit_json({"presets": [_preset_dict(p) for p in GPU_PRESETS.values()]})
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
        emit_json(data)
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

        emit_json(
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
@target_flags("model", "gpus", "gpu_memory", "inter_node_bandwidth", "device")
def estimate(
    declared: dict[str, Any], data: dict[str, Any], target: dict[str, Any], json_out: bool = JSON
) -> None:
    """Napkin estimate of one config: peak memory per GPU with a breakdown, and step time."""
    try:
        knobs = checked(declared)
        with warnings_to_stderr():
            from autofit.arguments import check_model_size, config_of
            from autofit.hardware import resolve_hardware
            from autofit.models import check_seq_len, resolve_model

            spec = resolve_model(target["model"])
            check_model_size(spec)
            hw = resolve_hardware(**{k: v for k, v in target.items() if k != "model"})
            check_seq_len(spec, knobs.get("seq_len"))  # the API's cheap checks, before the data
            config_of(knobs, spec, hw)
            hist = data_lengths(**data, progress=not json_out)
            # the model and GPUs resolved once: the API takes them as they are
            est = autofit.estimate(spec, hw, device=target["device"], lengths=hist, **knobs)
    except AutofitError as exc:
        fail(exc, json_out, "estimate")
    seq_len = est.config.seq_len
    if json_out:
        emit_json({**est.to_dict(), **lengths_dict(hist, seq_len)})
        return
    wrap = knobs.get("wrap", "auto")
    report.estimate_report(out, spec, hw, est, target["device"], requested_wrap=wrap, lengths=hist)
    if hist is not None:
        out.print(report.lengths_line(hist, seq_len), markup=False)


@app.command()
@declared_flags()
@data_flags
@target_flags("model", "gpus", "gpu_memory", "device")
def trial(
    declared: dict[str, Any],
    data: dict[str, Any],
    target: dict[str, Any],
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
    timeout = renamed("--timeout", timeout, "--trial-timeout", trial_timeout, TRIAL_TIMEOUT_S)
    try:
        knobs = checked(declared)
        if not json_out:
            model, gpus, device = (escape(target[k]) for k in ("model", "gpus", "device"))
            err.print(f"Running a trial of {model} on {gpus} ({device}) ...")
        with warnings_to_stderr():
            result = autofit.trial(**target, steps=steps, trial_timeout=timeout, **data, **knobs)
    except AutofitError as exc:
        fail(exc, json_out, "trial")
    except KeyboardInterrupt as exc:
        interrupted(exc, json_out, "The trial was stopped and its processes killed.")
    if json_out:
        emit_json(result.to_dict())
    else:
        report.trial_report(out, result, requested_wrap=knobs.get("wrap", "auto"))
    if result.status not in ("ok", "oom"):
        raise typer.Exit(1)


@app.command()
@target_flags("gpus", "device", "gpu_memory")
def calibrate(
    target: dict[str, Any],
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
            where = f"{target['gpus']} ({target['device']})"
            err.print(f"Calibrating {where}: {n} short trials ...", markup=False)
        err.print(f"[{i + 1}/{n}] {model} {cfg.short()} ...", markup=False, highlight=False)

    def finished(i: int, n: int, t: Any) -> None:
        if not json_out:
            out.print(report.sweep_line(t), markup=False, highlight=False)

    try:
        with warnings_to_stderr():
            result = autofit.calibrate(
                **target, steps=steps, trial_timeout=trial_timeout, quick=quick,
                on_start=started, on_trial=finished,
            )  # fmt: skip
    except AutofitError as exc:
        fail(exc, json_out, "calibrate")
    except KeyboardInterrupt as exc:
        interrupted(
            exc, json_out,
            "The running trial was stopped and its processes killed; nothing was stored.",
        )  # fmt: skip
    if json_out:
        emit_json(result.to_dict())
    else:
        report.calibration_report(console, result)
    if not result.path:
        raise typer.Exit(1)
