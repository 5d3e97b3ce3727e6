"""A calibration and what it is fitted on: `Observation` (one measured trial's terms), `SideCheck`
(whether a side's fit paid for itself), `Calibration` (the factors, constants and bands), each
with its plain-data form for the study and the stored file; `NAPKIN`, the uncalibrated prior."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from autofit.calibration.terms import (
    MEMORY_MODE_TERMS,
    MEMORY_TERMS,
    MODES,
    OFFLOADED_TERMS,
    PEAK_TERMS,
    SPEED_MODE_TERMS,
    SPEED_TERMS,
    TIME_FACTOR_TERMS,
    memory_terms,
    time_terms,
    tokens,
)
from autofit.estimate import MEMORY_ERROR, Estimate
from autofit.estimate.memory import nccl_bytes, usable_host_bytes
from autofit.trials.result import TrialResult

# Prior widths of the log-factors: how far from the prior one believes a factor may be (1 sigma).
# The napkin's memory terms are held to 10% by bench/accuracy.py with outliers to 30-40%; its
# speed constants are assumptions (MFU, link and PCIe efficiency) that may be off by 2x.
NAPKIN_MEMORY_SIGMA = 0.3
NAPKIN_SPEED_SIGMA = 0.7
# A stored calibration of this machine was fitted on measurements: a tighter prior.
STORED_MEMORY_SIGMA = 0.15
STORED_SPEED_SIGMA = 0.3
# Measurement noise, relative: a peak repeats within ~1% between runs of one config (trials of the
# suite; allocator and tracker noise), tokens/s of a few steps within ~5% (CPU and GPU alike).
MEMORY_NOISE = 0.02
SPEED_NOISE = 0.05
# Prior width of the share of offloaded bytes that shows on the device (prior mean 0).
OFFLOADED_SIGMA = 0.15
# Prior width of a mode's share (prior mean 0): wider than a factor's, so where only the
# candidates of one mode are off, their share moves rather than every candidate's factors.
MODE_SIGMA = 0.5
# Before any measurement the napkin's speed error is not known; this is its stated spread.
NAPKIN_SPEED_BAND = 0.25
SOURCES = ("none", "stored", "study")
Z90 = 1.6449  # |x| of a standard normal is below this 90% of the time
# No correction makes a step faster than this share of the napkin's, whose times are FLOPs and
# bytes over the hardware's rates: a fitted step below it is the fit's error, not the machine.
MIN_STEP_SHARE = 0.1


@dataclass(frozen=True)
class Observation:
    """One measured trial as the fit sees it: the napkin's terms for its config and what the
    trial measured. An OOM gives a lower bound on the peak (it ran past `peak_bytes`) and no
    step time; a timeout or an error gives nothing."""

    memory: tuple[float, ...]  # napkin memory terms (`PEAK_TERMS`)
    time: tuple[float, ...]  # napkin time terms (`SPEED_TERMS`)
    micro_steps: int  # grad_accum: micro-steps per optimizer step
    peak_bytes: float | None = None  # measured peak, or the bound an OOM ran past
    oom: bool = False
    step_time_s: float | None = None
    label: str = ""
    # the CUDA context the trial's process held: its device level less its reserved peak and
    # NCCL's buffers (`context_of`); None on CPU, or where the device level was not read
    context_bytes: float | None = None

    @classmethod
    def of(cls, est: Estimate, result: TrialResult) -> Observation:
        """`est`: the napkin's estimate of the trial's config (on the hardware and cap it ran
        under); `result`: what the trial measured."""
        peak: float | None = None
        step: float | None = None
        oom = False
        if result.measured:  # ok, or slow: the steps it ran
            peak = float(result.peak_bytes) if result.peak_bytes else None
            # the step time of the tokens the search ranks by (what tokens/s was measured of)
            step = tokens(est) / result.tokens_per_s if result.tokens_per_s else None
        elif result.status == "oom" and result.oom_of != "host":
            oom, peak = True, float(est.usable_bytes)  # it needed more than the GPU could give
        return cls(
            memory=memory_terms(est),
            time=time_terms(est),
            micro_steps=int(est.config.grad_accum),
            peak_bytes=peak,
            oom=oom,
            step_time_s=step,
            label=est.config.short(),
            context_bytes=context_of(est, result),
        )

    @property
    def informative(self) -> bool:
        return self.peak_bytes is not None or self.step_time_s is not None


def context_of(est: Estimate, result: TrialResult) -> float | None:
    """The CUDA context a GPU trial measured: its device level (`mem_get_info` after each step)
    less its reserved peak and NCCL's buffers as the estimate counts them for the communicators
    the trial held (a one-rank group where the config's layout has none: trials before
    `TrialResult.process_group` always joined one). None without a device level."""
    if not result.measured or not result.device_peak_bytes or not result.peak_bytes:
        return None
    nccl = est.overhead.get("nccl", 0)
    if not nccl and result.nprocs <= 1 and result.process_group is not False:
        nccl = nccl_bytes("cuda", 1, "pcie", 1)
    return float(result.device_peak_bytes - result.peak_bytes - nccl)


NAPKIN_MEMORY = {
    **dict.fromkeys(MEMORY_TERMS, 1.0),
    **dict.fromkeys(OFFLOADED_TERMS, 0.0),
    **dict.fromkeys(MEMORY_MODE_TERMS, 0.0),
}
NAPKIN_SPEED = {**dict.fromkeys(TIME_FACTOR_TERMS, 1.0), **dict.fromkeys(SPEED_MODE_TERMS, 0.0)}


PRIOR_NAMES = {
    "none": "the napkin",
    "stored": "this machine's stored calibration",
    "study": "the study's earlier calibration",
}


@dataclass(frozen=True)
class SideCheck:
    """Whether the fitted correction of one side (memory or speed) paid for itself on the trials
    it was fitted on, and so was applied. Errors are the median |relative error| over the measured
    trials (an OOM counts only where a prediction fell below the bound it ran past), in the
    measure the plan reports: estimated / measured - 1 of the peak, and of tokens/s."""

    side: str  # memory, speed
    applied: bool
    prior: str  # the prior's source (`SOURCES`): what the fit was held against
    n: int  # trials compared on
    prior_error: float | None  # the prior's error on them
    fitted_error: float | None  # the fit's, each trial predicted by a fit that did not see it
    in_sample_error: float | None  # the fit's, by the fit on all of them
    reason: str = ""  # in words, for the plan's output

    @property
    def note(self) -> str:
        """A line for the plan's output when the correction was not applied, else ""."""
        return "" if self.applied else self.reason


@dataclass(frozen=True)
class Calibration:
    """Factors per napkin term and a constant, for memory and for speed, with the relative error
    the calibration was measured to have (`memory_band`, `speed_band`)."""

    memory: dict[str, float] = field(default_factory=lambda: dict(NAPKIN_MEMORY))
    memory_constant: float = 0.0  # bytes
    speed: dict[str, float] = field(default_factory=lambda: dict(NAPKIN_SPEED))
    speed_constant: float = 0.0  # seconds per micro-step
    memory_band: float = MEMORY_ERROR
    speed_band: float = NAPKIN_SPEED_BAND
    source: str = "none"  # none (the napkin), stored (this machine's), study (fitted on trials)
    n_trials: int = 0  # measured trials it was fitted on (stored ones included)
    memory_error: float | None = None  # median leave-one-out |error| over its trials
    speed_error: float | None = None
    # posterior covariance of the parameters (log-factors, shares, constant) where fitted; else
    # the prior's widths (`spreads`)
    memory_cov: Any = field(default=None, compare=False, repr=False)
    speed_cov: Any = field(default=None, compare=False, repr=False)
    # whether each side's fitted correction paid for itself and was applied (None: not fitted)
    memory_check: SideCheck | None = None
    speed_check: SideCheck | None = None
    # the CUDA context this machine's GPU trials measured (the median of their `context_bytes`);
    # None: not measured, the estimate's default stands (`estimate.memory.CUDA_CONTEXT_BYTES`)
    context_bytes: float | None = None

    @property
    def is_napkin(self) -> bool:
        return self.source == "none"

    @property
    def notes(self) -> list[str]:
        """What the plan says of a side whose correction was not applied (and why)."""
        checks = (self.memory_check, self.speed_check)
        return [c.note for c in checks if c is not None and c.note]

    # One estimate at a time (plan output) ...
    def peak_bytes(self, est: Estimate) -> float:
        f = self._memory_vector()
        return max(float(np.dot(f, memory_terms(est))) + self.memory_constant, 1.0)

    def step_time_s(self, est: Estimate) -> float:
        micro_steps = np.array([est.config.grad_accum], dtype=float)
        return float(self.step_times(np.array([time_terms(est)]), micro_steps)[0])

    def tokens_per_s(self, est: Estimate) -> float:
        return tokens(est) / self.step_time_s(est)

    def apply(self, est: Estimate) -> Estimate:
        """The estimate as this calibration corrects it: peak (its breakdown scaled term by term,
        the constant beside it) and step time (time breakdown scaled likewise)."""
        if self.is_napkin:
            return est
        f, g = self.memory, self.speed
        breakdown = {k: int(round(v * f.get(k, 1.0))) for k, v in est.breakdown.items()}
        overhead = dict(est.overhead)
        if self.context_bytes is not None and overhead.get("cuda_context"):  # a GPU's
            overhead["cuda_context"] = int(self.context_bytes)
        usable = (
            est.usable_bytes + est.overhead.get("cuda_context", 0) - overhead.get("cuda_context", 0)
        )
        if "allocator" in overhead:
            overhead["allocator"] = int(round(overhead["allocator"] * f["allocator"]))
        peak = int(round(self.peak_bytes(est)))
        rest = peak - overhead.get("allocator", 0) - sum(breakdown.values())
        if rest:  # shares and constant: what no breakdown term of the napkin holds
            breakdown["calibration"] = rest
        times = {k: v * g.get(k, 1.0) for k, v in est.time_breakdown.items()}
        step = self.step_time_s(est)
        if step - sum(times.values()):  # mode shares and the cost per micro-step
            times["calibration"] = step - sum(times.values())
        return replace(
            est,
            peak_bytes=peak,
            peak_allocated_bytes=peak - overhead.get("allocator", 0),
            breakdown=breakdown,
            overhead=overhead,
            usable_bytes=usable,
            within_capacity=peak <= usable
            and est.host_bytes <= usable_host_bytes(est.host_capacity_bytes),
            step_time_s=step,
            tokens_per_s=tokens(est) / step,
            time_breakdown=times,
        )

    # ... and a whole space at once (the search re-ranks every candidate after each trial).
    def peaks(self, memory: np.ndarray) -> np.ndarray:
        """Calibrated peaks of the rows of `memory` (n x len(PEAK_TERMS) napkin terms)."""
        return np.maximum(memory @ self._memory_vector() + self.memory_constant, 1.0)

    def step_times(self, time: np.ndarray, micro_steps: np.ndarray) -> np.ndarray:
        """Calibrated step times of the rows of `time` (n x len(SPEED_TERMS)), each at least
        `MIN_STEP_SHARE` of the napkin's own (a fit on a few trials can give a mode a share past
        its whole step, which would make the step free and its tokens/s endless)."""
        steps = time @ self._speed_vector() + self.speed_constant * micro_steps
        napkin = time[:, : len(TIME_FACTOR_TERMS)].sum(axis=1)
        return np.maximum(steps, np.maximum(MIN_STEP_SHARE * napkin, 1e-9))

    def spreads(
        self, memory: np.ndarray, time: np.ndarray, micro_steps: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """How uncertain the calibrated peak and step time of each row are: the standard
        deviation of their logarithm. Beside the measured error the fitted terms leave (the band
        is the 90th percentile of |leave-one-out error|), a fitted calibration's parameters'
        posterior covariance seen through the row's terms (a row whose terms mix like the
        measured ones is known well; one unlike them is not). Without a fit of its own (the
        napkin, a stored calibration) the band alone: the estimate's known error, not a prior
        over parameters no trial has tested (which put a 7B LoRA estimated at 78% of the line
        at a 62% chance to fit, against the 2.3% the estimate was measured to be within).

        The modes' shares are not independent gains (`_mode_capped_variance`): a row is as
        unsure as its least known mode, so a config does not look promising for the number of
        modes it turns on."""
        k = len(MEMORY_TERMS)
        f = self._memory_vector()
        peaks = self.peaks(memory)
        g_mem = np.column_stack([memory[:, :k] * f[:k], memory[:, k:], np.ones(len(memory))])
        g_mem /= peaks[:, None]
        g = self._speed_vector()
        steps = self.step_times(time, micro_steps)
        ks = len(TIME_FACTOR_TERMS)
        g_spd = np.column_stack([time[:, :ks] * g[:ks], time[:, ks:], micro_steps])
        g_spd /= steps[:, None]
        rest_mem = max(MEMORY_NOISE, self.memory_band / Z90)
        rest_spd = max(SPEED_NOISE, self.speed_band / Z90)
        var_mem = np.full(len(memory), rest_mem**2)
        var_spd = np.full(len(time), rest_spd**2)
        mem_modes = slice(k + len(OFFLOADED_TERMS), k + len(OFFLOADED_TERMS) + len(MODES))
        if self.memory_cov is not None:
            var_mem += _mode_capped_variance(g_mem, self.memory_cov, mem_modes)
        if self.speed_cov is not None:
            var_spd += _mode_capped_variance(g_spd, self.speed_cov, slice(ks, ks + len(MODES)))
        return np.sqrt(var_mem), np.sqrt(var_spd)

    def _memory_vector(self) -> np.ndarray:
        return self._vectors[0]

    def _speed_vector(self) -> np.ndarray:
        return self._vectors[1]

    @functools.cached_property
    def _vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """The memory and speed factors in `PEAK_TERMS`' and `SPEED_TERMS`' order: made once
        per calibration (its fields do not change), read for every candidate it applies to."""
        return (
            np.array([self.memory.get(k, NAPKIN_MEMORY[k]) for k in PEAK_TERMS]),
            np.array([self.speed.get(k, NAPKIN_SPEED[k]) for k in SPEED_TERMS]),
        )


def _mode_capped_variance(g: np.ndarray, cov: np.ndarray, modes: slice) -> np.ndarray:
    """`g cov g'` of each row of `g`, with the modes' part (the columns `modes`) capped at its
    largest single mode's: the variance without any mode, plus the most that one mode adds
    (`2 g_j (g_base cov)_j + g_j^2 cov_jj`). A mode no trial has run keeps its prior width
    (`MODE_SIGMA`), and summed independently k such modes would make a row k times as
    uncertain, so the expected gain (its log-normal mean) would rank configs by how many modes
    they turn on (issue 32: int8 + chunked + selective + compile outranked the napkin's best)."""
    base = g.copy()
    base[:, modes] = 0.0
    base_cov = base @ cov
    var = np.einsum("ij,ij->i", base_cov, base)
    gm = g[:, modes]
    added = 2 * gm * base_cov[:, modes] + gm * gm * np.diag(cov)[modes]
    return var + np.maximum(added.max(axis=1, initial=0.0), 0.0)


NAPKIN = Calibration()
"""The uncalibrated napkin: every factor 1, no constant, the napkin's stated error as its band."""
