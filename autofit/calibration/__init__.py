"""Calibration: the napkin as the prior, measured trials as the correction.

The napkin (`autofit.estimate`) predicts a peak as a sum of named memory terms and a step time as a
sum of named time terms. A calibration multiplies each term by a factor and adds a constant:

    peak = sum_k f_k x memory_term_k + c_mem            (bytes)
    step = sum_k g_k x time_term_k   + c_time x micro-steps (seconds)

`fit_calibration` finds the factors that explain the measured trials of a study (OOMs as lower
bounds on memory), as a maximum a-posteriori fit: log-factors with a Gaussian prior at the prior
calibration (the napkin's 1.0, or a stored calibration of this machine), measurement residuals
on a log scale with a Huber loss (a trial that went strange is down-weighted, not believed), solved
by damped Gauss-Newton. Two trials move the factors sensibly (the prior holds what they cannot
tell apart); twenty pin them down.

A calibration also carries its own measured error: the leave-one-out relative error of its
predictions over the trials it was fitted on (`memory_band`, `speed_band`). The search prunes with
that band instead of the napkin's stated error (`autofit.estimate.MEMORY_ERROR`).

A correction has to pay for itself: for memory and for speed apart, the fit's error on the
study's own trials, each predicted by a fit that did not see it (leave-one-out: the prior never
saw them either), is held against the prior's error on the same trials, in the measure the plan
reports (median |error| of the peak, of tokens/s). A side whose fit does not do better keeps the
prior's factors, and its band is the prior's error measured on those trials (`SideCheck`: what
was kept and why, which the plan prints).

Pure arithmetic on numpy; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from autofit.estimate import BREAKDOWN_KEYS, MEMORY_ERROR, TIME_KEYS, Estimate
from autofit.estimate.memory import usable_host_bytes
from autofit.trials.result import TrialResult

__all__ = [
    "MEMORY_TERMS",
    "NAPKIN",
    "OFFLOADED_TERMS",
    "PEAK_TERMS",
    "SPEED_TERMS",
    "Calibration",
    "Observation",
    "SideCheck",
    "fit_calibration",
    "memory_terms",
    "time_terms",
]

MEMORY_TERMS: tuple[str, ...] = (*BREAKDOWN_KEYS, "allocator")
"""What a peak is made of: the napkin's breakdown at its peak moment, and the caching allocator's
slack (`Estimate.overhead["allocator"]`; 0 on CPU). Each has a factor, 1.0 in the napkin."""
OFFLOADED_TERMS: tuple[str, ...] = ("offloaded_params", "offloaded_optimizer")
"""What the napkin holds on the host per GPU, under `offload: params` and `offload: optimizer`:
none of it should show on the device, so each has a share (0.0 in the napkin) that measurements
may find does (staging copies, a device that is the host: CPU trials)."""
MODES: tuple[str, ...] = (
    "lora", "quant=nf4", "quant=int8", "checkpointing=full", "checkpointing=every-2",
    "checkpointing=selective", "offload=params", "offload=optimizer", "wrap=none", "compile",
)  # fmt: skip
"""Knob values that change how a step runs. Where the napkin is off for one of them alone (its
layout under param offload, recomputation's working set, peft's or NF4's kernels), a share of
the dynamic memory (activations and logits) and of the step time under that mode, 0 in the napkin,
lets a calibration correct those candidates without moving the factors every candidate shares."""
MEMORY_MODE_TERMS: tuple[str, ...] = tuple(f"activations|{m}" for m in MODES)
PEAK_TERMS: tuple[str, ...] = (*MEMORY_TERMS, *OFFLOADED_TERMS, *MEMORY_MODE_TERMS)
TIME_FACTOR_TERMS: tuple[str, ...] = TIME_KEYS
SPEED_MODE_TERMS: tuple[str, ...] = tuple(f"step|{m}" for m in MODES)
SPEED_TERMS: tuple[str, ...] = (*TIME_FACTOR_TERMS, *SPEED_MODE_TERMS)
SHARE_TERMS = frozenset((*OFFLOADED_TERMS, *MEMORY_MODE_TERMS, *SPEED_MODE_TERMS))
"""Terms fitted as an added share (0 in the napkin), not a factor."""
"""What a step time is made of: the napkin's `time_breakdown`."""

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
# Prior width of the constants, as a share of the median measured peak / step time per
# micro-step: memory the terms do not carry (NCCL buffers, the CPU tracker's own) is small; a
# fixed cost per micro-step (kernel launches, Python, collective latency) may be most of a small
# model's step.
MEMORY_CONSTANT_SIGMA = 0.05
SPEED_CONSTANT_SIGMA = 0.5
# Prior width of the share of offloaded bytes that shows on the device (prior mean 0).
OFFLOADED_SIGMA = 0.15
# Prior width of a mode's share (prior mean 0): wider than a factor's, so where only the
# candidates of one mode are off, their share moves rather than every candidate's factors.
MODE_SIGMA = 0.5
# Residuals count as a Cauchy (Lorentzian) loss with this many noise widths as its scale: a few
# widths off counts nearly squared, far off hardly more than a little off, so a config the
# napkin's terms cannot explain widens the calibration's band instead of dragging every factor.
ROBUST = 2.0
# The Laplace prior's quadratic stand-in is taken no sharper than at this distance from its mean.
LAPLACE_EPS = 1e-4
SQRT2 = math.sqrt(2.0)
# The smallest band a calibration prunes with, however well it explains its trials: two runs of
# one config differ by about this much.
MIN_BAND = 0.01
# Before any measurement the napkin's speed error is not known; this is its stated spread.
NAPKIN_SPEED_BAND = 0.25
SOURCES = ("none", "stored", "study")
Z90 = 1.6449  # |x| of a standard normal is below this 90% of the time


def mode_on(cfg: Any, mode: str) -> bool:
    """Whether `cfg` runs in `mode` (one of `MODES`)."""
    if mode == "lora":
        return cfg.lora_rank > 0
    if mode == "compile":
        return bool(cfg.compile)
    knob, value = mode.split("=")
    return str(getattr(cfg, knob)) == value


def memory_terms(est: Estimate) -> tuple[float, ...]:
    """The napkin's memory terms of an estimate, in `PEAK_TERMS` order."""
    b = est.breakdown
    cfg = est.config
    host = float(est.host_bytes) / max(est.host_ranks, 1)  # per GPU: one node's host
    dynamic = float(b.get("activations", 0) + b.get("logits_loss", 0))
    return (
        *(float(b.get(k, 0)) for k in BREAKDOWN_KEYS),
        float(est.overhead.get("allocator", 0)),
        host if cfg.offload == "params" else 0.0,
        host if cfg.offload == "optimizer" else 0.0,
        *(dynamic if mode_on(cfg, m) else 0.0 for m in MODES),
    )


def time_terms(est: Estimate) -> tuple[float, ...]:
    """The napkin's time terms of an estimate, in `SPEED_TERMS` order."""
    t = est.time_breakdown
    step = float(est.step_time_s)
    return (
        *(float(t.get(k, 0.0)) for k in TIME_FACTOR_TERMS),
        *(step if mode_on(est.config, m) else 0.0 for m in MODES),
    )


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

    @classmethod
    def of(cls, est: Estimate, result: TrialResult) -> Observation:
        """`est`: the napkin's estimate of the trial's config (on the hardware and cap it ran
        under); `result`: what the trial measured."""
        peak: float | None = None
        step: float | None = None
        oom = False
        if result.status == "ok":
            peak = float(result.peak_bytes) if result.peak_bytes else None
            # the step time of the tokens the search ranks by (what tokens/s was measured of)
            step = _tokens(est) / result.tokens_per_s if result.tokens_per_s else None
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
        )

    @property
    def informative(self) -> bool:
        return self.peak_bytes is not None or self.step_time_s is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory": list(self.memory),
            "time": list(self.time),
            "micro_steps": self.micro_steps,
            "peak_bytes": self.peak_bytes,
            "oom": self.oom,
            "step_time_s": self.step_time_s,
            "label": self.label,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Observation:
        return cls(
            memory=tuple(float(x) for x in d["memory"]),
            time=tuple(float(x) for x in d["time"]),
            micro_steps=int(d.get("micro_steps", 1)),
            peak_bytes=d.get("peak_bytes"),
            oom=bool(d.get("oom", False)),
            step_time_s=d.get("step_time_s"),
            label=str(d.get("label", "")),
        )


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "prior": self.prior,
            "n": self.n,
            "prior_error": self.prior_error,
            "fitted_error": self.fitted_error,
            "in_sample_error": self.in_sample_error,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, side: str, d: dict[str, Any]) -> SideCheck:
        return cls(
            side=side,
            applied=bool(d.get("applied", True)),
            prior=str(d.get("prior", "none")),
            n=int(d.get("n", 0)),
            prior_error=d.get("prior_error"),
            fitted_error=d.get("fitted_error"),
            in_sample_error=d.get("in_sample_error"),
            reason=str(d.get("reason", "")),
        )


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
        g = self._speed_vector()
        step = float(np.dot(g, time_terms(est))) + self.speed_constant * est.config.grad_accum
        return max(step, 1e-9)

    def tokens_per_s(self, est: Estimate) -> float:
        return _tokens(est) / self.step_time_s(est)

    def apply(self, est: Estimate) -> Estimate:
        """The estimate as this calibration corrects it: peak (its breakdown scaled term by term,
        the constant beside it) and step time (time breakdown scaled likewise)."""
        if self.is_napkin:
            return est
        f, g = self.memory, self.speed
        breakdown = {k: int(round(v * f.get(k, 1.0))) for k, v in est.breakdown.items()}
        overhead = dict(est.overhead)
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
            within_capacity=peak <= est.usable_bytes
            and est.host_bytes <= usable_host_bytes(est.host_capacity_bytes),
            step_time_s=step,
            tokens_per_s=_tokens(est) / step,
            time_breakdown=times,
        )

    # ... and a whole space at once (the search re-ranks every candidate after each trial).
    def peaks(self, memory: np.ndarray) -> np.ndarray:
        """Calibrated peaks of the rows of `memory` (n x len(PEAK_TERMS) napkin terms)."""
        return np.maximum(memory @ self._memory_vector() + self.memory_constant, 1.0)

    def step_times(self, time: np.ndarray, micro_steps: np.ndarray) -> np.ndarray:
        """Calibrated step times of the rows of `time` (n x len(SPEED_TERMS))."""
        steps = time @ self._speed_vector() + self.speed_constant * micro_steps
        return np.maximum(steps, 1e-9)

    def spreads(
        self, memory: np.ndarray, time: np.ndarray, micro_steps: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """How uncertain the calibrated peak and step time of each row are: the standard
        deviation of their logarithm, from the parameters' posterior covariance (a row whose
        terms mix like the measured ones is known well; one unlike them is not) and the
        measurement noise."""
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
        cov_mem = self.memory_cov if self.memory_cov is not None else self._prior_cov("memory")
        cov_spd = self.speed_cov if self.speed_cov is not None else self._prior_cov("speed")
        # beside the parameters' uncertainty, what the fitted terms leave unexplained: its
        # measured error (the band is the 90th percentile of |leave-one-out error|)
        rest_mem = max(MEMORY_NOISE, self.memory_band / Z90)
        rest_spd = max(SPEED_NOISE, self.speed_band / Z90)
        var_mem = np.einsum("ij,jk,ik->i", g_mem, cov_mem, g_mem) + rest_mem**2
        var_spd = np.einsum("ij,jk,ik->i", g_spd, cov_spd, g_spd) + rest_spd**2
        return np.sqrt(var_mem), np.sqrt(var_spd)

    def _prior_cov(self, side: str) -> np.ndarray:
        """Without a fit of its own: the prior's widths (the constant taken as known)."""
        stored = self.source != "none"
        if side == "memory":
            width = STORED_MEMORY_SIGMA if stored else NAPKIN_MEMORY_SIGMA
            sd = [width] * len(MEMORY_TERMS) + [OFFLOADED_SIGMA] * len(OFFLOADED_TERMS)
            sd += [MODE_SIGMA] * len(MEMORY_MODE_TERMS) + [0.0]
        else:
            width = STORED_SPEED_SIGMA if stored else NAPKIN_SPEED_SIGMA
            sd = [width] * len(TIME_FACTOR_TERMS) + [MODE_SIGMA] * len(SPEED_MODE_TERMS) + [0.0]
        return np.diag(np.square(sd))

    def _memory_vector(self) -> np.ndarray:
        return np.array([self.memory.get(k, NAPKIN_MEMORY[k]) for k in PEAK_TERMS])

    def _speed_vector(self) -> np.ndarray:
        return np.array([self.speed.get(k, NAPKIN_SPEED[k]) for k in SPEED_TERMS])

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "n_trials": self.n_trials,
            "memory": {k: round(v, 4) for k, v in self.memory.items()},
            "memory_constant_bytes": int(round(self.memory_constant)),
            "speed": {k: round(v, 4) for k, v in self.speed.items()},
            "speed_constant_s": self.speed_constant,
            "memory_band": self.memory_band,
            "speed_band": self.speed_band,
            "memory_error": self.memory_error,
            "speed_error": self.speed_error,
            **{
                f"{c.side}_check": c.to_dict()
                for c in (self.memory_check, self.speed_check)
                if c is not None
            },
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        return cls(
            memory={k: float(d.get("memory", {}).get(k, v)) for k, v in NAPKIN_MEMORY.items()},
            memory_constant=float(d.get("memory_constant_bytes", 0.0)),
            speed={k: float(d.get("speed", {}).get(k, v)) for k, v in NAPKIN_SPEED.items()},
            speed_constant=float(d.get("speed_constant_s", 0.0)),
            memory_band=float(d.get("memory_band", MEMORY_ERROR)),
            speed_band=float(d.get("speed_band", NAPKIN_SPEED_BAND)),
            source=str(d.get("source", "stored")),
            n_trials=int(d.get("n_trials", 0)),
            memory_error=d.get("memory_error"),
            speed_error=d.get("speed_error"),
            memory_check=_check_of(d, "memory"),
            speed_check=_check_of(d, "speed"),
        )


def _check_of(d: dict[str, Any], side: str) -> SideCheck | None:
    check = d.get(f"{side}_check")
    return SideCheck.from_dict(side, check) if isinstance(check, dict) else None


NAPKIN = Calibration()
"""The uncalibrated napkin: every factor 1, no constant, the napkin's stated error as its band."""


def _tokens(est: Estimate) -> float:
    c = est.config
    return float(c.micro_batch * c.grad_accum * max(est.n_gpus, 1) * c.seq_len)


# ---------------------------------------------------------------------------------------------
# The fit


@dataclass(frozen=True)
class _Problem:
    """One side (memory or speed) as a least-squares problem: log-factors of the terms in `x`,
    linear coefficients of the columns in `lin` (the shares of offloaded bytes, the constant)."""

    x: np.ndarray  # n x k napkin terms, each times a factor exp(theta)
    lin: np.ndarray  # n x a columns, each times a coefficient theta (the last: the constant's)
    y: np.ndarray  # n: measured (or the bound)
    lower: np.ndarray  # n: bool, y is a lower bound (OOM)
    mu: np.ndarray  # k + a: prior means (log-factors, then coefficients)
    sigma: np.ndarray  # k + a: prior widths
    noise: float
    nonneg: np.ndarray  # k + a: bool, kept at 0 or above (the shares of offloaded bytes)

    @property
    def k(self) -> int:
        return self.x.shape[1]

    def predict(self, theta: np.ndarray) -> np.ndarray:
        return self.x @ np.exp(theta[: self.k]) + self.lin @ theta[self.k :]

    def residuals(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Log residuals (0 for a bound that holds) and their Jacobian."""
        p = self.predict(theta)
        safe = np.maximum(p, self.y * 1e-3)
        r = np.log(safe / self.y)
        jac = np.empty((len(self.y), len(theta)))
        jac[:, : self.k] = self.x * np.exp(theta[: self.k]) / safe[:, None]
        jac[:, self.k :] = self.lin / safe[:, None]
        jac[p <= self.y * 1e-3] = 0.0
        held = self.lower & (r >= 0)
        r[held] = 0.0
        jac[held] = 0.0
        return r, jac

    def objective(self, theta: np.ndarray) -> float:
        """Twice the negative log posterior: Huber on the residuals; a Laplace prior (scale
        sigma / sqrt 2, the same spread) on the terms' factors and shares, which moves only the
        terms the measurements need moved and leaves the rest at the prior; a Gaussian one on
        the constant."""
        r, _ = self.residuals(theta)
        z = r / self.noise
        data = ROBUST**2 * np.log1p((z / ROBUST) ** 2)
        d = (theta - self.mu) / self.sigma
        prior = np.where(self.laplace, 2 * SQRT2 * np.abs(d), d * d)
        return float(np.sum(data) + np.sum(prior))

    @property
    def laplace(self) -> np.ndarray:
        """Which parameters have a Laplace prior: all but the constant (the last)."""
        out = np.ones(len(self.mu), dtype=bool)
        out[-1] = False
        return out

    def solve(self, start: np.ndarray | None = None, iters: int = 40) -> np.ndarray:
        """MAP estimate by damped Gauss-Newton, Huber and Laplace terms as reweighted squares
        (IRLS: each majorized by a quadratic at the current point)."""
        theta = self.mu.copy() if start is None else start.copy()
        lam = 1e-3
        best = self.objective(theta)
        laplace = self.laplace
        for _ in range(iters):
            r, jac = self.residuals(theta)
            z = np.abs(r) / self.noise
            w = 1.0 / (1.0 + (z / ROBUST) ** 2) / self.noise**2
            d = np.abs(theta - self.mu)
            p_inv = np.where(
                laplace, SQRT2 / (self.sigma * np.maximum(d, LAPLACE_EPS)), 1.0 / self.sigma**2
            )
            h = jac.T @ (jac * w[:, None]) + np.diag(p_inv)
            g = jac.T @ (w * r) + p_inv * (theta - self.mu)
            improved = False
            for _ in range(8):
                step = np.linalg.solve(h + lam * np.diag(np.diag(h)), -g)
                trial = theta + step
                # a share of offloaded bytes on the device is at least none (projected)
                trial[self.nonneg] = np.maximum(trial[self.nonneg], 0.0)
                step = trial - theta
                value = self.objective(trial)
                if value < best:
                    theta, best, improved = trial, value, True
                    lam = max(lam / 3, 1e-9)
                    break
                lam *= 10
            if not improved or np.max(np.abs(step)) < 1e-7:
                break
        return theta

    def covariance(self, theta: np.ndarray) -> np.ndarray:
        """The parameters' posterior covariance at `theta` (Laplace's approximation: the inverse
        of the Gauss-Newton Hessian, the priors taken as Gaussians of the same widths)."""
        r, jac = self.residuals(theta)
        z = np.abs(r) / self.noise
        w = 1.0 / (1.0 + (z / ROBUST) ** 2) / self.noise**2
        h = jac.T @ (jac * w[:, None]) + np.diag(1.0 / self.sigma**2)
        return np.linalg.inv(h)

    def rows(self, keep: np.ndarray) -> _Problem:
        return replace(self, x=self.x[keep], lin=self.lin[keep], y=self.y[keep],
                       lower=self.lower[keep])  # fmt: skip


def _problem(
    obs: Sequence[Observation],
    side: str,
    prior: Calibration,
    stored: bool,
) -> _Problem | None:
    if side == "memory":
        rows = [o for o in obs if o.peak_bytes]
        if not rows:
            return None
        terms = np.array([o.memory for o in rows], dtype=float)
        k = len(MEMORY_TERMS)
        y = np.array([o.peak_bytes for o in rows], dtype=float)
        lower = np.array([o.oom for o in rows])
        lin = np.column_stack([terms[:, k:], np.ones(len(rows))])
        factors = [prior.memory.get(t, NAPKIN_MEMORY[t]) for t in MEMORY_TERMS]
        shares = [prior.memory.get(t, NAPKIN_MEMORY[t]) for t in OFFLOADED_TERMS]
        modes = [prior.memory.get(t, NAPKIN_MEMORY[t]) for t in MEMORY_MODE_TERMS]
        width = STORED_MEMORY_SIGMA if stored else NAPKIN_MEMORY_SIGMA
        measured = y[~lower] if (~lower).any() else y
        scale = float(np.median(measured))
        mu = [*np.log(np.maximum(factors, 1e-6)), *shares, *modes, prior.memory_constant]
        sigma = [width] * k + [OFFLOADED_SIGMA] * len(shares) + [MODE_SIGMA] * len(modes)
        sigma += [MEMORY_CONSTANT_SIGMA * scale]
        nonneg = np.zeros(len(mu), dtype=bool)
        nonneg[k : k + len(shares)] = True
        return _Problem(terms[:, :k], lin, y, lower, np.array(mu), np.array(sigma), MEMORY_NOISE,
                        nonneg)  # fmt: skip
    rows = [o for o in obs if o.step_time_s]
    if not rows:
        return None
    terms = np.array([o.time for o in rows], dtype=float)
    ks = len(TIME_FACTOR_TERMS)
    micro = np.array([o.micro_steps for o in rows], dtype=float)
    lin = np.column_stack([terms[:, ks:], micro])
    y = np.array([o.step_time_s for o in rows], dtype=float)
    factors = [prior.speed.get(t, 1.0) for t in TIME_FACTOR_TERMS]
    modes = [prior.speed.get(t, 0.0) for t in SPEED_MODE_TERMS]
    width = STORED_SPEED_SIGMA if stored else NAPKIN_SPEED_SIGMA
    scale = float(np.median(y / micro))
    mu = [*np.log(np.maximum(factors, 1e-6)), *modes, prior.speed_constant]
    sigma = [width] * ks + [MODE_SIGMA] * len(modes) + [SPEED_CONSTANT_SIGMA * scale]
    lower = np.zeros(len(rows), dtype=bool)
    nonneg = np.zeros(len(mu), dtype=bool)
    return _Problem(terms[:, :ks], lin, y, lower, np.array(mu), np.array(sigma), SPEED_NOISE,
                    nonneg)  # fmt: skip


def _loo_predictions(problem: _Problem, theta: np.ndarray) -> np.ndarray:
    """Each row predicted by a fit that did not see it (none with fewer than two rows)."""
    n = len(problem.y)
    if n < 2:
        return np.array([])
    out = np.empty(n)
    for i in range(n):
        t = problem.rows(np.arange(n) != i).solve(theta, iters=15)
        out[i] = float(problem.rows(np.arange(n) == i).predict(t)[0])
    return out


def _errors(problem: _Problem, predicted: np.ndarray) -> np.ndarray:
    """Relative error of each row's prediction, predicted / measured - 1 (for a bound: how far
    below the bound it was predicted, else 0): the measure of the bands."""
    err = predicted / problem.y - 1
    return np.where(problem.lower, np.minimum(err, 0.0), err)


def _plan_errors(problem: _Problem, predicted: np.ndarray, side: str) -> np.ndarray:
    """Relative errors as the plan reports them (`autofit.search.calibrated.summary`): of the peak
    (as `_errors`, the prediction floored as `Calibration.peaks` floors it), and of tokens/s,
    the inverse of the step time (measured step / predicted step - 1)."""
    if side == "speed":
        return problem.y / np.maximum(predicted, 1e-9) - 1
    return _errors(problem, np.maximum(predicted, 1.0))


def _median_abs(errors: np.ndarray) -> float:
    return float(np.median(np.abs(errors)))


def _judge(
    problem: _Problem, theta: np.ndarray, loo: np.ndarray, prior: Calibration, side: str
) -> SideCheck:
    """Whether the fit `theta` of one side pays for itself on the trials it was fitted on: its
    error on them, each trial predicted by a fit that did not see it (`loo`; the prior did not
    see them either: the same footing), below the prior's, and its error as fitted on them all
    not above it. The plan's measure (`_plan_errors`), over the measured trials and the OOMs
    that a prediction put below their bound (an OOM either one held says nothing between them).
    With one such trial nothing is left out to judge a fit by: it is applied only when the
    prior misses that trial by more than measurement noise (within the noise no fit can tell a
    correction from it)."""
    name = PRIOR_NAMES.get(prior.source, prior.source)
    what = "the peak" if side == "memory" else "tokens/s"
    noise = MEMORY_NOISE if side == "memory" else SPEED_NOISE
    e_prior = _plan_errors(problem, problem.predict(problem.mu), side)
    e_fit = _plan_errors(problem, problem.predict(theta), side)
    rows = ~problem.lower | (e_prior < 0) | (e_fit < 0)
    e_loo = _plan_errors(problem, loo, side) if len(loo) else None
    if e_loo is not None:
        rows |= e_loo < 0
    n = int(rows.sum())
    check = {"side": side, "prior": prior.source, "n": n}
    if n == 0:  # OOMs alone, each bound held by the prior and the fit alike
        why = (
            f"calibration not applied to {side}: {name} held every OOM's bound and nothing "
            "else was measured"
        )
        return SideCheck(**check, applied=False, prior_error=None, fitted_error=None,
                         in_sample_error=None, reason=why)  # fmt: skip
    prior_err, in_sample = _median_abs(e_prior[rows]), _median_abs(e_fit[rows])
    if n == 1 or e_loo is None:
        applied = prior_err > noise and in_sample < prior_err
        why = (
            f"{name} missed the one measured trial by {prior_err:.1%} ({what}), more than "
            f"measurement noise ({noise:.0%})"
            if applied
            else f"calibration not applied to {side}: {name} was within {prior_err:.1%} of the "
            f"one measured trial ({what}), inside measurement noise ({noise:.0%})"
        )
        return SideCheck(**check, applied=applied, prior_error=prior_err, fitted_error=None,
                         in_sample_error=in_sample, reason=why)  # fmt: skip
    fitted = _median_abs(e_loo[rows])
    applied = fitted < prior_err and in_sample <= prior_err
    if applied:
        why = (
            f"{side} calibrated: median |error| of {what} over {n} measured trials "
            f"{prior_err:.1%} ({name}) -> {fitted:.1%} (each trial left out of the fit)"
        )
    else:
        why = (
            f"calibration not applied to {side}: {name} was already within {prior_err:.1%} "
            f"(median |error| of {what} over the study's {n} measured trials); the fitted "
            f"correction did no better: {fitted:.1%} on each trial left out of its fit, "
            f"{in_sample:.1%} fitted on them all"
        )
    return SideCheck(**check, applied=applied, prior_error=prior_err, fitted_error=fitted,
                     in_sample_error=in_sample, reason=why)  # fmt: skip


def _band(errors: np.ndarray, fallback: float) -> float:
    """The calibration's measured error: the 90th percentile of its |leave-one-out| errors."""
    if len(errors) == 0:
        return fallback
    return max(float(np.quantile(np.abs(errors), 0.9, method="higher")), MIN_BAND)


@dataclass
class _Side:
    """One side of a calibration as the fit leaves it."""

    theta: np.ndarray | None  # the fitted parameters where applied, else None (the prior's)
    band: float
    error: float | None
    cov: Any
    check: SideCheck | None


def _fit_side(problem: _Problem | None, side: str, prior: Calibration) -> _Side:
    """Fit one side and judge whether the fit pays for itself (`_judge`). Where it does: its
    parameters, and its leave-one-out error as its band. Where it does not: the prior's
    parameters, and the prior's own error on these trials as the band (with fewer than two
    trials, the prior's band)."""
    band = prior.memory_band if side == "memory" else prior.speed_band
    error = prior.memory_error if side == "memory" else prior.speed_error
    cov = prior.memory_cov if side == "memory" else prior.speed_cov
    if problem is None:
        return _Side(None, band, error, cov, None)
    theta = problem.solve()
    loo = _loo_predictions(problem, theta)
    check = _judge(problem, theta, loo, prior, side)
    if check.applied:
        kept, errors = theta, _errors(problem, loo) if len(loo) else np.array([])
    else:
        kept, errors = problem.mu, np.array([])
        if len(problem.y) >= 2:
            errors = _errors(problem, problem.predict(problem.mu))
    return _Side(
        theta if check.applied else None,
        _band(errors, band),
        _median_abs(errors) if len(errors) else error,
        problem.covariance(kept),
        check,
    )


def fit_calibration(
    observations: Iterable[Observation], prior: Calibration | None = None
) -> Calibration:
    """Fit factors to the measured `observations` with `prior` (default: the napkin) as the
    prior; see the module docstring. A side whose fit does not pay for itself on `observations`
    keeps the prior's factors (`Calibration.memory_check`, `speed_check`). No informative
    observation: the prior itself."""
    prior = prior or NAPKIN
    obs = [o for o in observations if o.informative]
    if not obs:
        return prior
    stored = prior.source != "none"
    mem = _fit_side(_problem(obs, "memory", prior, stored), "memory", prior)
    memory, memory_constant = dict(prior.memory), prior.memory_constant
    if mem.theta is not None:
        k = len(MEMORY_TERMS)
        memory = dict(zip(MEMORY_TERMS, (float(v) for v in np.exp(mem.theta[:k])), strict=True))
        shares = (*OFFLOADED_TERMS, *MEMORY_MODE_TERMS)
        memory.update(zip(shares, (float(v) for v in mem.theta[k:-1]), strict=True))
        memory_constant = float(mem.theta[-1])
    spd = _fit_side(_problem(obs, "speed", prior, stored), "speed", prior)
    speed, speed_constant = dict(prior.speed), prior.speed_constant
    if spd.theta is not None:
        ks = len(TIME_FACTOR_TERMS)
        speed = dict(
            zip(TIME_FACTOR_TERMS, (float(v) for v in np.exp(spd.theta[:ks])), strict=True)
        )
        speed.update(zip(SPEED_MODE_TERMS, (float(v) for v in spd.theta[ks:-1]), strict=True))
        speed_constant = float(spd.theta[-1])
    return Calibration(
        memory=memory,
        memory_constant=memory_constant,
        speed=speed,
        speed_constant=speed_constant,
        memory_band=mem.band,
        speed_band=spd.band,
        source="study",
        n_trials=prior.n_trials + len(obs),
        memory_error=mem.error,
        speed_error=spd.error,
        memory_cov=mem.cov,
        speed_cov=spd.cov,
        memory_check=mem.check,
        speed_check=spd.check,
    )


def median_abs(values: Iterable[float]) -> float | None:
    """Median |value| of `values`, or None when there are none."""
    v = [abs(x) for x in values if x is not None and math.isfinite(x)]
    return float(np.median(v)) if v else None
