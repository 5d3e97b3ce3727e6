"""`autofit calibrate`: a short sweep of real trials that identifies each correction factor, stored
as this machine's calibration for every later plan.

Each trial of the sweep moves one knob away from a plain base config, so that the terms it adds
(activations and compute with a larger micro-batch, recomputation with checkpointing, LoRA's
frozen base, dequantisation with NF4, communication with DDP or FSDP2, host copies and the CPU
optimizer with offload, the per-micro-step constant with gradient accumulation) show in the
measurements apart from the others. A second model family keeps the fit from learning one
architecture's quirks. Small models: a few minutes in all (on CPU about a minute).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autofit.calibration import Calibration, Observation, calibration_to_dict, fit_calibration
from autofit.calibration import store as cal_store
from autofit.checks import TRIAL_TIMEOUT_S
from autofit.config import Config
from autofit.errors import ConfigError, WriteError
from autofit.estimate import estimate
from autofit.hardware import Hardware
from autofit.models import ModelSpec, resolve_model
from autofit.rules import fsdp2_only_knob
from autofit.space_file import parse_space
from autofit.trials.result import TrialResult
from autofit.values import Checkpointing, Offload, Precision, Quant, Wrap

# (model, seq_len) per device: the sweep's models, small enough for a few minutes of trials.
MODELS = {
    "cpu": (("llama-debug", 128), ("qwen3-debug", 128)),
    "cuda": (("tinyllama-1.1b", 1024), ("llama-mini", 1024)),
}
# Knobs moved away from the base, one variant each (first model); the second model runs the
# first `SECOND_MODEL_VARIANTS` of them.
VARIANTS: tuple[dict[str, Any], ...] = (
    {},
    {"micro_batch": 8},
    {"micro_batch": 8, "checkpointing": Checkpointing.FULL},
    {"lora_rank": 8},
    {"lora_rank": 8, "quant": Quant.NF4},
    {"wrap": Wrap.NONE},
    {"offload": Offload.OPTIMIZER},
    {"offload": Offload.PARAMS, "wrap": Wrap.LAYER},
    {"grad_accum": 2},
    {"precision": Precision.BF16},
)
SECOND_MODEL_VARIANTS = 3
# `quick`: the first model's variants that move the largest terms (activations and compute,
# recomputation, LoRA, the CPU optimizer, the per-micro-step constant): a rougher calibration in
# about a third of the time.
QUICK_VARIANTS = (0, 1, 2, 3, 6, 8)
BASE: dict[str, Any] = {"micro_batch": 2, "wrap": Wrap.LAYER}


@dataclass
class SweepTrial:
    model: str
    config: Config
    estimate: Any  # autofit.estimate.Estimate (napkin)
    result: TrialResult

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "model": self.model,
            "config": self.config.to_dict(),
            "label": self.config.short(),
            "status": r.status,
            "peak_bytes": r.peak_bytes,
            "tokens_per_s": r.tokens_per_s,
            "estimate": {
                "peak_bytes": self.estimate.peak_bytes,
                "tokens_per_s": self.estimate.tokens_per_s,
            },
            "message": r.message.splitlines()[0] if r.message else "",
        }


@dataclass
class CalibrationRun:
    """What `calibrate` did: its trials, the calibration stored, where, for which machine."""

    machine: dict[str, Any]
    trials: list[SweepTrial] = field(default_factory=list)
    calibration: Calibration | None = None
    path: str = ""
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "trials": [t.to_dict() for t in self.trials],
            "calibration": calibration_to_dict(self.calibration) if self.calibration else None,
            "path": self.path,
            "skipped": self.skipped,
        }


def sweep(hardware: Hardware, device: str, quick: bool = False) -> list[tuple[ModelSpec, Config]]:
    """The sweep's configs that can run on `hardware` (`Space.candidates` applies the rules)."""
    out: list[tuple[ModelSpec, Config]] = []
    models = MODELS[device][:1] if quick else MODELS[device]
    for m, (name, seq_len) in enumerate(models):
        spec = resolve_model(name)
        if quick:
            variants = tuple(VARIANTS[i] for i in QUICK_VARIANTS)
        else:
            variants = VARIANTS if m == 0 else VARIANTS[:SECOND_MODEL_VARIANTS]
        for variant in variants:
            knobs = {**BASE, **variant}
            fsdp2_only = fsdp2_only_knob(knobs.get("offload", ""), knobs.get("shard", ""))
            if hardware.n_gpus == 1 and not fsdp2_only:
                knobs["wrap"] = Wrap.NONE.value  # one GPU trains the plain module
            space = parse_space(
                {"seq_len": seq_len, "knobs": {k: [v] for k, v in knobs.items()}},
                "calibration sweep",
                name="calibrate",
            )
            try:
                configs, _ = space.candidates(hardware.n_gpus, device=device, nodes=hardware.nodes)
            except ConfigError:
                continue
            for cfg in configs:
                if (spec, cfg) not in out:
                    out.append((spec, cfg))
    return out


def calibrate(
    hardware: Hardware,
    device: str,
    *,
    gpu_memory: int | None = None,
    steps: int = 3,
    trial_timeout: float = TRIAL_TIMEOUT_S,
    quick: bool = False,
    run_trials: Callable[..., list[TrialResult]] | None = None,
    on_trial: Callable[[int, int, SweepTrial], None] | None = None,
    on_start: Callable[[int, int, str, Config], None] | None = None,
) -> CalibrationRun:
    """Run the sweep on `hardware` (`quick`: a shorter one), fit the corrections on its trials
    together with those this machine already stored, and store the result
    (`autofit.calibration.store`). The trials of one model run in one launch
    (`autofit.trials.run_trials`): the processes start, and import torch, once per model."""
    if run_trials is None:
        from autofit.trials import run_trials
    run = CalibrationRun(machine=cal_store.machine_key(hardware, device))
    plan = sweep(hardware, device, quick)
    stamp = f"calibrate@{time.time():.0f}"
    observations: list[tuple[str, Observation]] = []
    started = 0  # trials announced to `on_start`

    def start_up_to(i: int) -> None:
        nonlocal started
        for j in range(started, min(i, len(plan) - 1) + 1):
            if on_start:
                on_start(j, len(plan), plan[j][0].name, plan[j][1])
        started = max(started, i + 1)

    def finished(i: int, result: TrialResult) -> None:
        start_up_to(i)
        spec, cfg = plan[i]
        trial = SweepTrial(spec.name, cfg, estimate(spec, hardware, cfg, device=device), result)
        run.trials.append(trial)
        if on_trial:
            on_trial(i, len(plan), trial)
        obs = Observation.of(trial.estimate, result)
        if obs.informative:
            observations.append((f"{stamp}#{i}", obs))

    first = 0
    for _name, group in itertools.groupby(plan, key=lambda item: item[0].name):
        configs = [cfg for _spec, cfg in group]
        start_up_to(first)
        run_trials(plan[first][0], configs, nprocs=hardware.n_gpus, device=device,
                   gpu_memory=gpu_memory, steps=steps, timeout_s=trial_timeout,
                   on_progress=lambda info, o=first: start_up_to(o + info.get("config", 0)),
                   on_result=lambda i, result, o=first: finished(o + i, result))  # fmt: skip
        first += len(configs)
    if not observations:
        run.calibration = fit_calibration([])
        return run
    try:
        path, stored = cal_store.save(hardware, device, observations)
    except OSError as exc:  # a full disk: the trials were shown as they finished
        raise WriteError(
            f"The calibration sweep finished ({len(observations)} measured trial(s), shown "
            f"above), but this machine's calibration could not be stored "
            f"({exc.strerror or exc}); the one stored before, if any, is whole and still used. "
            "Free some space, then run `autofit calibrate` again.",
            run, getattr(exc, "filename", None), exc.strerror or str(exc),
        ) from None  # fmt: skip
    run.calibration, run.path = stored, str(path)
    return run
