"""How long a trial should take, from its estimate: the limit it is held to, and the step time
past which it is stopped as `slow`.

A trial starts a process (imports, the process group), builds the model (materialise and
initialise on the device, quantize, or initialise on the host what FSDP2 offloads), compiles its
layers in the first warm-up step (`compile: true`), then runs its warm-up and measured steps. Each
part is timed here from what the first GPU run measured (one H200, 2026-11-27, autofit's own
one-rank launches: `bench/data/gpu-check/h200-2026-11-27-run1.json`, wall time per config less its
steps) and the step from the (calibrated) estimate. A trial is held to `LIMIT_FACTOR` times that
plus `LIMIT_SLACK_S` (at most the user's `--trial-timeout`), and a measured step past
`SLOW_FACTOR` times its estimate (at least `SLOW_MIN_S`) ends it as `slow`: what it measured
still ranks it and teaches the speed model, and the search goes on instead of waiting out a
fixed limit (the first GPU run's int8 trial took 26 s a step against 0.61 s estimated, and ran
until its 600 s limit).

Plain data: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from autofit.checks import TRIAL_TIMEOUT_S
from autofit.config import Config
from autofit.hardware import Hardware
from autofit.models import ModelSpec
from autofit.values import Offload, Quant

START_S = {"cuda": 15.0, "cpu": 10.0}
"""Process start, imports and the process group. H200: a launch's first config took 14-15 s
beyond its build and steps (tinyllama-1.1b 15.2 s in all, llama-7b NF4 23.8 s); CPU: a one- or
two-rank launch on this project's 2-core machine, 5-10 s."""

DEVICE_INIT_S_PER_B = 0.3
"""Seconds per billion parameters materialised and initialised on the GPU (H200: llama-7b LoRA,
3.7 s for the config less 1.7 s of steps)."""

QUANTIZE_S_PER_B = 1.0
"""Seconds per billion parameters quantized to NF4 or int8 (H200: llama-7b NF4, 6.6 s beyond
its steps; int8 taken alike)."""

HOST_INIT_S_PER_B = 20.0
"""Seconds per billion parameters initialised on the host and pinned (`offload: params`; on CPU
every parameter): H200 host, tinyllama-1.1b full fine-tune offloaded, 21 s beyond its steps."""

COMPILE_S = 30.0
"""torch.compile of the decoder layers in the first warm-up step (two graphs, forward and
backward): 12-14 s on the H200 for llama-7b's layer (bench/gpu_check.py's int8 rows), about 10 s
per compile of llama-debug on this project's 2-core CPU; twice that, as a compile that takes
longer is not a reason to stop a trial."""

LIMIT_FACTOR = 3.0
LIMIT_SLACK_S = 30.0
"""A trial is killed past `LIMIT_FACTOR` x its expected time + `LIMIT_SLACK_S`."""

SLOW_FACTOR = 5.0
SLOW_MIN_S = 3.0
"""A measured step past `SLOW_FACTOR` x its estimated step time, and past `SLOW_MIN_S` (a CPU
step of a debug model takes a tenth of a second, and a loaded machine may take ten times that),
stops the trial as `slow` once that step is measured."""


@dataclass(frozen=True)
class TrialTime:
    """The expected seconds of one trial, by part, and the step time it is judged by."""

    start_s: float
    build_s: float
    compile_s: float
    step_s: float  # one optimizer step, as (calibrated) estimated
    n_steps: int  # warm-up and measured steps together

    @property
    def expected_s(self) -> float:
        return self.start_s + self.build_s + self.compile_s + self.n_steps * self.step_s

    def limit_s(self, cap: float | None = None) -> float:
        """The trial's limit: `LIMIT_FACTOR` x expected + `LIMIT_SLACK_S`, at most `cap`."""
        limit = LIMIT_FACTOR * self.expected_s + LIMIT_SLACK_S
        return min(limit, cap) if cap is not None else limit

    @property
    def slow_after_s(self) -> float:
        """A measured step longer than this stops the trial as `slow`."""
        return max(SLOW_FACTOR * self.step_s, SLOW_MIN_S)


def trial_limit(timing: TrialTime, trial_timeout: float | None) -> float:
    """A search's limit for one trial: the user's `--trial-timeout` when given, else the trial's
    own from its estimate (`TrialTime.limit_s`), at most `TRIAL_TIMEOUT_S`."""
    return trial_timeout if trial_timeout is not None else timing.limit_s(TRIAL_TIMEOUT_S)


def warmup_steps(config: Config, asked: int, data: bool = False) -> int:
    """Warm-up steps a trial runs: those asked for, and at least one for a compiled model, whose
    first forward and backward compile its layers (that step is never a measured one). On the
    data's lengths (`data`) one more, after at least one: the step of the longest micro-batch, run
    once the optimizer's state exists (its first step makes it) and never timed."""
    warm = max(asked, 1) if config.compile else asked
    return max(warm, 1) + 1 if data else warm


def trial_time(
    model: ModelSpec, config: Config, step_time_s: float, steps: int, *, warmup: int = 1,
    device: str = "cuda", data: bool = False,
) -> TrialTime:  # fmt: skip
    """What one trial of `config` should take: `steps` measured steps after the warm-up a trial
    asked for `warmup` runs (`warmup_steps`; `data`: on the data's lengths), each of
    `step_time_s`."""
    from autofit.arch import structure_of

    billions = structure_of(model).n_params / 1e9
    if device != "cuda":
        build = billions * HOST_INIT_S_PER_B
    elif config.quant != Quant.NONE:  # the base quantized on the GPU; what FSDP2 offloads is small
        build = billions * QUANTIZE_S_PER_B
    elif config.offload == Offload.PARAMS:
        build = billions * HOST_INIT_S_PER_B
    else:
        build = billions * DEVICE_INIT_S_PER_B
    warm = warmup_steps(config, warmup, data)
    return TrialTime(
        start_s=START_S.get(device, START_S["cpu"]),
        build_s=build,
        compile_s=COMPILE_S if config.compile else 0.0,
        step_s=step_time_s,
        n_steps=warm + steps,
    )


def measured_context(hardware: Hardware) -> dict[str, int]:
    """The trial option a machine's measured CUDA context adds (`Hardware.context_bytes`, from
    its calibration): a capped trial's cap counts it (`run_trials(context_bytes=...)`); none
    where nothing was measured."""
    ctx = hardware.context_bytes
    return {"context_bytes": int(ctx)} if ctx is not None else {}
