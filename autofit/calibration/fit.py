"""The fit: a maximum a-posteriori solve of the factors on a study's trials (damped Gauss-Newton,
a Cauchy loss on the residuals, Laplace priors), judged by leave-one-out against the prior."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autofit.calibration.model import (
    MEMORY_NOISE,
    MODE_SIGMA,
    NAPKIN,
    NAPKIN_MEMORY,
    NAPKIN_MEMORY_SIGMA,
    NAPKIN_SPEED_SIGMA,
    OFFLOADED_SIGMA,
    PRIOR_NAMES,
    SPEED_NOISE,
    STORED_MEMORY_SIGMA,
    STORED_SPEED_SIGMA,
    Calibration,
    Observation,
    SideCheck,
)
from autofit.calibration.terms import (
    MEMORY_MODE_TERMS,
    MEMORY_TERMS,
    OFFLOADED_TERMS,
    SPEED_MODE_TERMS,
    TIME_FACTOR_TERMS,
)

# Prior width of the constants, as a share of the median measured peak / step time per
# micro-step: memory the terms do not carry (NCCL buffers, the CPU tracker's own) is small; a
# fixed cost per micro-step (kernel launches, Python, collective latency) may be most of a small
# model's step.
MEMORY_CONSTANT_SIGMA = 0.05
SPEED_CONSTANT_SIGMA = 0.5
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
        """Twice the negative log posterior: a Cauchy loss on the residuals; a Laplace prior (scale
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
        """MAP estimate by damped Gauss-Newton, Cauchy and Laplace terms as reweighted squares
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


# Each side's measurement and term vector on an `Observation` (a trial that did not measure the
# side is no row of its fit).
_MEASURED = {"memory": ("peak_bytes", "memory"), "speed": ("step_time_s", "time")}


def _problem(
    obs: Sequence[Observation],
    side: str,
    prior: Calibration,
    stored: bool,
) -> _Problem | None:
    """The fit of one side over the observations that measured it (None: none did)."""
    measured, vector = _MEASURED[side]
    rows = [o for o in obs if getattr(o, measured)]
    if not rows:
        return None
    terms = np.array([getattr(o, vector) for o in rows], dtype=float)
    y = np.array([getattr(o, measured) for o in rows], dtype=float)
    build = _memory_problem if side == "memory" else _speed_problem
    return build(rows, terms, y, prior, stored)


def _memory_problem(
    rows: list[Observation], terms: np.ndarray, y: np.ndarray, prior: Calibration, stored: bool
) -> _Problem:
    k = len(MEMORY_TERMS)
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


def _speed_problem(
    rows: list[Observation], terms: np.ndarray, y: np.ndarray, prior: Calibration, stored: bool
) -> _Problem:
    ks = len(TIME_FACTOR_TERMS)
    micro = np.array([o.micro_steps for o in rows], dtype=float)
    lin = np.column_stack([terms[:, ks:], micro])
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
        context_bytes=_context(obs, prior),
    )


def _context(obs: list[Observation], prior: Calibration) -> float | None:
    """The CUDA context the observed GPU trials measured, their median (one process's context
    is the same from trial to trial: 1,324.8-1,326.8 MiB less NCCL's buffer over 16 trials of
    one H200); the prior's where none measured it."""
    found = [o.context_bytes for o in obs if o.context_bytes is not None]
    return float(np.median(found)) if found else prior.context_bytes


def median_abs(values: Iterable[float]) -> float | None:
    """Median |value| of `values`, or None when there are none."""
    v = [abs(x) for x in values if x is not None and math.isfinite(x)]
    return float(np.median(v)) if v else None
