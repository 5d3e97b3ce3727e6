"""The picture of a search (PNG, Agg): per trial, estimated vs measured peak against capacity and
the headroom line, and measured vs estimated tokens/s, the winner marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autofit.units import GiB, MiB


def plot_trials(plan: Any, path: Path, allowed_bytes: float) -> Path | None:
    """Write the picture; None when there is nothing to draw (no trials ran)."""
    if not plan.trials:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cap = plan.hardware.capacity_bytes
    unit, scale = ("MiB", MiB) if cap < 4 * GiB else ("GiB", GiB)
    trials = plan.trials
    xs = list(range(len(trials)))
    labels = [c.config.short() for c in trials]
    est_peak = [c.estimate.peak_bytes / scale for c in trials]
    meas_peak = [(c.trial.peak_bytes or 0) / scale for c in trials]
    status = [c.trial.status for c in trials]
    best = plan.best

    fig = Figure(figsize=(max(8.5, 0.6 * len(trials) + 5), 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    w = 0.38
    ax1.bar([x - w / 2 for x in xs], est_peak, w, label="estimated peak", color="#b0c4de")
    colors = [
        "#2e8b57" if s == "ok" and m * scale <= allowed_bytes else "#d2691e"
        for s, m in zip(status, meas_peak, strict=True)
    ]
    ok_x = [x for x, s in zip(xs, status, strict=True) if s == "ok"]
    ok_h = [m for m, s in zip(meas_peak, status, strict=True) if s == "ok"]
    ok_c = [c for c, s in zip(colors, status, strict=True) if s == "ok"]
    ax1.bar([x + w / 2 for x in ok_x], ok_h, w, color=ok_c, label="measured peak")
    for x, s in zip(xs, status, strict=True):
        if s != "ok":
            ax1.annotate(s.upper(), (x + w / 2, cap / scale), ha="center", va="bottom",
                         color="#b22222", fontsize=8, fontweight="bold")  # fmt: skip
            ax1.plot([x + w / 2], [cap / scale], marker="x", color="#b22222", markersize=9)
    ax1.axhline(cap / scale, color="#b22222", lw=1.5, label=f"capacity {cap / scale:.1f} {unit}")
    ax1.axhline(allowed_bytes / scale, color="#b22222", lw=1, ls="--",
                label=f"headroom line ({plan.margin:.0%} margin)")  # fmt: skip
    ax1.set_ylabel(f"peak per GPU ({unit})")
    ax1.set_title(f"{plan.model.name} on {plan.hardware.describe()}, seq_len {plan.seq_len}")
    ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)

    est_tps = [c.estimate.tokens_per_s for c in trials]
    meas_tps = [(c.trial.tokens_per_s or 0) if c.trial.status == "ok" else 0 for c in trials]
    bar_colors = [
        "#daa520" if best is not None and c.config == best.config else "#4682b4" for c in trials
    ]
    ax2.bar(xs, meas_tps, 0.6, color=bar_colors)
    ax2.bar([], [], color="#4682b4", label="measured tokens/s")
    ax2.plot(xs, est_tps, "o", mfc="none", color="#333333", label="estimated tokens/s")
    if best is not None:
        ax2.plot([], [], "s", color="#daa520", label="winner")
    ax2.set_ylabel("tokens/s (all GPUs)")
    ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax2.set_xticks(xs)
    ax2.set_xticklabels([f"#{i} {lab}" for i, lab in zip(xs, labels, strict=True)],
                        rotation=60, ha="right", fontsize=7)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    tmp.replace(path)
    return path
