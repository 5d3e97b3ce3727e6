"""The picture of a search (PNG, Agg): per trial, estimated vs measured peak against capacity and
the headroom line, and measured vs estimated tokens/s, the winner marked."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from autofit.files import atomic_write
from autofit.plan import Outcome, Plan, trial_status
from autofit.units import device_noun, fmt_size, size_unit

UNDER_COLOR = "#2e8b57"  # measured peak at or under the headroom line
OVER_COLOR = "#d2691e"  # measured peak above it: ran, but cannot be the winner


def plot_trials(plan: Plan, path: Path, allowed_bytes: float) -> Path | None:
    """Write the picture; None when there is nothing to draw (no trials ran)."""
    fig = trials_figure(plan, allowed_bytes)
    if fig is None:
        return None
    png = io.BytesIO()
    fig.savefig(png, dpi=110, format="png")
    atomic_write(path, png.getvalue())
    return path


def trials_figure(plan: Plan, allowed_bytes: float) -> Any:
    """The matplotlib Figure of `plot_trials` (None when no trial ran). Trials are labelled by
    their Optuna number, as in the progress lines and the trials table."""
    if not plan.trials:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cap = plan.hardware.capacity_bytes
    unit, scale = size_unit(cap)  # one axis unit, the one the capacity reads best in
    trials = plan.trials
    xs = list(range(len(trials)))
    numbers = [c.number if c.number is not None else i for i, c in enumerate(trials)]
    labels = [c.config.short() for c in trials]
    est_peak = [c.estimate.peak_bytes / scale for c in trials]
    meas_peak = [(c.trial.peak_bytes or 0) / scale for c in trials]
    status = [c.trial.status for c in trials]
    over = [trial_status(c.trial, allowed_bytes) == Outcome.OVER_LINE for c in trials]
    best = plan.best

    fig = Figure(figsize=(max(8.5, 0.6 * len(trials) + 5), 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    w = 0.38
    ax1.bar([x - w / 2 for x in xs], est_peak, w, label="napkin peak", color="#b0c4de")
    cal_x = [x for x, c in zip(xs, trials, strict=True) if c.calibrated]
    if cal_x:
        cal_peak = [c.calibrated["peak_bytes"] / scale for c in trials if c.calibrated]
        ax1.plot(cal_x, cal_peak, "D", color="#2e8b57", markersize=5,
                 label="calibrated peak (before the trial)")  # fmt: skip
    # measured peaks: one colour under the headroom line, one over it, each with its legend entry
    under_i = [i for i in range(len(trials)) if trials[i].measured and not over[i]]
    over_i = [i for i in range(len(trials)) if over[i]]
    bars = (
        (under_i, UNDER_COLOR, "measured peak (under the line)"),
        (over_i, OVER_COLOR, "measured peak over the headroom line"),
    )
    for picked, color, label in bars:
        if picked:
            ax1.bar([xs[i] + w / 2 for i in picked], [meas_peak[i] for i in picked], w,
                    color=color, label=label)  # fmt: skip
    for x, s in zip(xs, status, strict=True):
        if s not in (Outcome.OK, Outcome.SLOW):
            ax1.annotate(s.upper(), (x + w / 2, cap / scale), ha="center", va="bottom",
                         color="#b22222", fontsize=8, fontweight="bold")  # fmt: skip
            ax1.plot([x + w / 2], [cap / scale], marker="x", color="#b22222", markersize=9)
    if any(s not in (Outcome.OK, Outcome.SLOW) for s in status):
        ax1.plot([], [], "x", color="#b22222", label="no peak measured (oom, timeout, error)")
    ax1.axhline(cap / scale, color="#b22222", lw=1.5, label=f"capacity {fmt_size(cap)}")
    ax1.axhline(allowed_bytes / scale, color="#b22222", lw=1, ls="--",
                label=f"headroom line ({plan.margin:.0%} margin)")  # fmt: skip
    ax1.set_ylabel(f"peak per {device_noun(plan.device)} ({unit})")
    ax1.set_title(f"{plan.model.name} on {plan.hardware.describe()}, seq_len {plan.seq_len}")
    ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)

    est_tps = [c.estimate.tokens_per_s for c in trials]
    meas_tps = [(c.trial.tokens_per_s or 0) if c.trial.measured else 0 for c in trials]
    bar_colors = [
        "#daa520" if best is not None and c.config == best.config else "#4682b4" for c in trials
    ]
    ax2.bar(xs, meas_tps, 0.6, color=bar_colors)
    ax2.bar([], [], color="#4682b4", label="measured tokens/s")
    ax2.plot(xs, est_tps, "o", mfc="none", color="#333333", label="napkin tokens/s")
    if cal_x:
        cal_tps = [c.calibrated["tokens_per_s"] for c in trials if c.calibrated]
        ax2.plot(cal_x, cal_tps, "D", color="#2e8b57", markersize=5,
                 label="calibrated tokens/s (before the trial)")  # fmt: skip
    errors = _error_text(plan)
    if errors:
        ax2.set_title(errors, fontsize=9)
    if best is not None:
        ax2.plot([], [], "s", color="#daa520", label="winner")
    ax2.set_ylabel(f"tokens/s (all {device_noun(plan.device, 2)})")
    ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax2.set_xticks(xs)
    ax2.set_xticklabels([f"#{n} {lab}" for n, lab in zip(numbers, labels, strict=True)],
                        rotation=60, ha="right", fontsize=7)  # fmt: skip
    return fig


def _error_text(plan: Plan) -> str:
    """The median |error| of the napkin and the calibrated estimate over the study."""
    cal = plan.calibration or {}
    parts = []
    for what, key in (("memory", "memory_error"), ("tokens/s", "speed_error")):
        napkin, calibrated = cal.get(f"napkin_{key}"), cal.get(f"calibrated_{key}")
        if napkin is None:
            continue
        text = f"{what}: napkin {napkin:.1%}"
        if calibrated is not None:
            text += f", calibrated {calibrated:.1%}"
        parts.append(text)
    return "median |error| over the study's trials — " + "; ".join(parts) if parts else ""
