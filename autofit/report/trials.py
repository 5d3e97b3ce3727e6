"""The table of a search's trials, sized for the terminal: each trial's measurement beside the
napkin's (and the calibrated) estimate made before it ran, sizes in one unit named in the title,
the estimate columns that would repeat another left out, the config last where it can wrap."""

from __future__ import annotations

from rich import box
from rich.table import Table

from autofit.plan import Plan, trial_status
from autofit.report.style import styled
from autofit.units import all_together, device_noun, fmt_size, size_unit


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def trials_table(plan: Plan) -> Table:
    """Every real trial of a search: the napkin and the calibrated estimate (made before the trial
    ran) beside the measurement, the winner marked, and the median |error| of each estimate over
    the study in the last row. `#` is the Optuna trial number, as in the progress lines; a run
    over the headroom line reads `over line`. The calibrated columns are left out where they
    equal the napkin's in every row."""
    line = plan.allowed_bytes
    n = plan.hardware.n_gpus
    each = device_noun(plan.device)
    sizes = [b for c in plan.trials for b in (c.trial.peak_bytes, c.estimate.peak_bytes) if b]
    unit, scale = size_unit(max(sizes, default=line))

    def size(b: float | None) -> str:
        return f"{b / scale:,.1f}" if b else "-"

    def speed(s: float | None) -> str:
        return f"{s:,.0f}" if s else "-"

    rows = []
    for i, c in enumerate(plan.trials):
        t, cal = c.trial, c.calibrated or {}
        ok = t.measured
        rows.append((
            str(c.number if c.number is not None else i), trial_status(t, line), c,
            [size(t.peak_bytes), size(c.estimate.peak_bytes), size(cal.get("peak_bytes"))],
            [speed(t.tokens_per_s if ok else None), speed(c.estimate.tokens_per_s),
             speed(cal.get("tokens_per_s"))],
        ))  # fmt: skip
    cal_mem = any(r[3][2] not in ("-", r[3][1]) for r in rows)
    cal_speed = any(r[4][2] not in ("-", r[4][1]) for r in rows)
    together = f"; tokens/s: {all_together(n, plan.device)}" if n > 1 else ""
    title = f"Trials (peaks in {unit} per {each}, headroom line {fmt_size(line)}{together})"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    heads = ["#", "status", "peak", "napkin", *(["calib."] if cal_mem else []), "tokens/s",
             "napkin", *(["calib."] if cal_speed else []), "config"]  # fmt: skip
    for head in heads:
        left = head in ("status", "config")
        table.add_column(head, justify="left" if left else "right", no_wrap=not left or None)
    best = plan.best.config if plan.best is not None else None
    for number, status, c, mem, spd in rows:
        mark = " [bold]<- winner[/]" if c.config == best else ""
        table.add_row(
            number, styled(status), *mem[: 3 if cal_mem else 2], *spd[: 3 if cal_speed else 2],
            c.config.short() + mark,
        )  # fmt: skip
    summary = plan.calibration or {}
    if summary:
        mem_err = [pct(summary.get("napkin_memory_error"))]
        spd_err = [pct(summary.get("napkin_speed_error"))]
        if cal_mem:
            mem_err.append(pct(summary.get("calibrated_memory_error")))
        if cal_speed:
            spd_err.append(pct(summary.get("calibrated_speed_error")))
        table.add_section()
        table.add_row("", "", "", *mem_err, "", *spd_err, "[dim]median |error|[/]")
    return table
