"""Rich tables and reports for the CLI: hardware, models, a plan, a calibration (one config's
estimate and trial: `autofit.report.one_config`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.markup import escape
from rich.table import Table

from autofit.arch import structure_of
from autofit.hardware import GPU_PRESETS, Hardware
from autofit.models import ModelSpec
from autofit.plan import Outcome, Plan
from autofit.plan.explain import mesh_line
from autofit.report.data import lengths_line
from autofit.report.one_config import memory_levels_line
from autofit.report.ranked import plan_table
from autofit.report.trials import pct, trials_table
from autofit.units import device_noun, fmt_bytes, fmt_count, fmt_size, whose_tokens


def hardware_table(hw: Hardware) -> Table:
    table = Table(title=f"GPUs ({hw.source})", title_justify="left")
    for col in ("#", "name", "memory", "free", "cc", "bf16", "fp8", "PCIe", "NVLink links"):
        table.add_column(col, justify="right" if col in ("#", "memory", "free") else "left")
    for g in hw.gpus:
        pcie = f"gen{g.pcie_gen} x{g.pcie_width}" if g.pcie_gen else "?"
        table.add_row(
            str(g.index),
            g.name,
            fmt_bytes(g.memory_bytes),
            fmt_bytes(g.free_bytes) if g.free_bytes is not None else "-",
            f"{g.compute_capability[0]}.{g.compute_capability[1]}",
            "yes" if g.bf16 else "no",
            "yes" if g.fp8 else "no",
            pcie,
            str(g.nvlink_links),
        )
    return table


def pairs_table(hw: Hardware) -> Table | None:
    if not hw.pairs:
        return None
    table = Table(title="GPU pairs", title_justify="left")
    table.add_column("pair")
    table.add_column("link")
    for a, b, kind in hw.pairs:
        table.add_row(f"{a} <-> {b}", "NVLink" if kind == "nvlink" else "PCIe")
    return table


class Fitted:
    """The first of `layouts` (renderables, widest first) that fits the width where it is
    printed without cutting a cell that does not wrap (a name a user types, a number), else the
    last: at 80 columns a table makes way for a narrower one rather than print `llama…`."""

    def __init__(self, *layouts: RenderableType) -> None:
        self.layouts = layouts

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for layout in self.layouts[:-1]:
            # measured unclamped: `measure` caps the minimum at the width it is given
            narrowest = console.measure(layout, options=options.update_width(10_000)).minimum
            if narrowest <= options.max_width:
                yield layout
                return
        yield self.layouts[-1]


def _named_table(title: str, names: list[str]) -> Table:
    """A table whose first column holds the names a user types, never shortened or wrapped."""
    table = Table(title=title, title_justify="left")
    table.add_column("name", no_wrap=True, min_width=max(map(len, names), default=0))
    return table


def presets_table() -> Fitted:
    """The what-if GPU presets: a column per figure where the width allows, else the name, the
    GPU, its memory and one column of the rest that wraps."""
    presets = list(GPU_PRESETS.values())
    title = "GPU presets (--gpus KxNAME, NxKxNAME)"

    def interconnect(p: Any) -> str:
        return "NVLink" if p.interconnect == "nvlink" else f"PCIe gen{p.pcie_gen} x{p.pcie_width}"

    def network(p: Any) -> str:
        return f"{p.network} {p.inter_node_bw_gbs:g} GB/s per GPU"

    wide = _named_table(title, [p.name for p in presets])
    left = ("GPU", "interconnect", "between nodes")
    for col in ("GPU", "memory", "bf16 TFLOP/s", "mem GB/s", "interconnect", "link GB/s",
                "between nodes"):  # fmt: skip
        wide.add_column(col, justify="left" if col in left else "right", no_wrap=col not in left)
    narrow = _named_table(title, [p.name for p in presets])
    narrow.add_column("GPU")
    narrow.add_column("memory", justify="right", no_wrap=True)
    narrow.add_column("speed and links")
    for p in presets:
        wide.add_row(
            p.name, p.full_name, fmt_bytes(p.memory_bytes), f"{p.bf16_tflops:g}",
            f"{p.mem_bw_gbs:g}", interconnect(p), f"{p.link_bw_gbs:g}", network(p),
        )  # fmt: skip
        narrow.add_row(
            p.name, p.full_name, fmt_bytes(p.memory_bytes),
            f"bf16 {p.bf16_tflops:g} TFLOP/s, memory {p.mem_bw_gbs:g} GB/s; {interconnect(p)} "
            f"{p.link_bw_gbs:g} GB/s; between nodes: {network(p)}",
        )  # fmt: skip
    return Fitted(wide, narrow)


def models_table(models: Iterable[ModelSpec]) -> Fitted:
    """The model presets: a column per figure where the width allows, else the name, the exact
    parameter count and one column of the rest that wraps."""
    models = list(models)
    title = "Model presets (--model NAME, or a path to config.json)"
    wide = _named_table(title, [m.name for m in models])
    for col in ("model", "family", "params", "layers", "hidden", "heads/kv", "ffn", "vocab"):
        left = col in ("model", "family")
        wide.add_column(col, justify="left" if left else "right", no_wrap=col != "model")
    narrow = _named_table(title, [m.name for m in models])
    narrow.add_column("params", justify="right", no_wrap=True)
    narrow.add_column("model")
    for m in models:
        n = structure_of(m).n_params
        shape = [str(m.layers), str(m.hidden), f"{m.heads}/{m.kv_heads}", str(m.intermediate),
                 str(m.vocab)]  # fmt: skip
        wide.add_row(m.name, m.description, m.model_type, f"{n:,} ({fmt_count(n)})", *shape)
        narrow.add_row(
            m.name, f"{n:,}",
            f"{m.description} ({m.model_type}): {fmt_count(n)} params, {m.layers} layers, hidden "
            f"{m.hidden}, heads/kv {m.heads}/{m.kv_heads}, ffn {m.intermediate}, vocab {m.vocab}",
        )  # fmt: skip
    return Fitted(wide, narrow)


def capacity_line(plan: Plan) -> str:
    """The one memory figure a plan's peaks are held to, named once: the usable memory per GPU
    (the capacity less what lies outside the allocator) and the headroom line below it."""
    usable, cap = plan.usable_bytes, plan.capacity_bytes
    where = f"per {device_noun(plan.device)}"
    less = "" if usable >= cap else f" ({fmt_size(cap)} less the CUDA context and NCCL buffers)"
    return (
        f"Memory: {fmt_size(usable)} usable {where}{less}; a winner keeps {plan.margin:.0%} of it "
        f"free, peaking at {fmt_size(plan.allowed_bytes)} at most."
    )


def pruned_lines(plan: Plan) -> list[str]:
    """Where the considered combinations went, one row each way (`Plan.tally`), the reasons under
    each; the rows add up to the total on the first line."""
    lines = [f"{plan.considered:,} combinations considered:"]
    for i, (what, count, reasons) in enumerate(plan.tally()):
        if count or i == 0:
            lines.append(f"  {count:>7,}  {what}" + (":" if reasons else ""))
        for reason, n in reasons:
            lines.append(f"  {'':>7}    {n:>7,}  {reason}")
    return lines


def calibration_lines(plan: Plan) -> list[str]:
    """How measurements corrected the napkin: the source and the factors that moved."""
    cal = plan.calibration
    if not cal or cal.get("mode") == "off":
        return []
    source = {
        "none": "none (the napkin alone)",
        "stored": "this machine's stored calibration",
        "study": f"fitted on {cal.get('n_trials', 0)} measured trial(s)",
    }.get(cal.get("source", "none"), cal.get("source"))
    out = [f"Calibration: {source}"]
    if cal.get("source") != "none":
        moved = ", ".join(m for side in ("memory", "speed") if (m := _factors(cal.get(side, {}))))
        if moved:
            out[0] += "; moved from the napkin: " + moved
        out[0] += (
            f"; error band memory {cal.get('memory_band', 0):.1%}, speed "
            f"{cal.get('speed_band', 0):.1%}"
        )
        out += [str(note) for note in cal.get("notes", [])]
    return out


def plan_report(console: Console, plan: Plan, written: list[Any] | None = None) -> None:
    hw = plan.hardware
    console.print(
        f"[bold]{plan.model.name}[/] ({fmt_count(structure_of(plan.model).n_params)} params) on "
        f"{hw.describe()}, seq_len {plan.seq_len}"
        + (f", global batch {plan.global_batch}" if plan.global_batch else "")
        + f", space '{plan.space.name}'"
    )
    console.print(capacity_line(plan), markup=False, highlight=False)
    if plan.request.lengths is not None:
        console.print(lengths_line(plan.request.lengths, plan.seq_len), markup=False)
    if plan.trials:
        console.print(trials_table(plan))
    elif plan.ranked:
        console.print(plan_table(plan))
    for line in calibration_lines(plan):
        console.print(line, markup=False, highlight=False)
    for line in pruned_lines(plan):
        console.print(line, markup=False)  # reasons are plain text (`autofit[liger]`)
    if plan.best is None:
        # never "nothing fits" while what the estimate says fits was left untried
        head = "No config measured to fit yet." if plan.untried else "No config fits."
        console.print(f"[red]{head}[/] {escape(plan.advice)}")
        return
    best = plan.best
    how = "measured" if best.measured else "estimated"
    if best.verified:
        how += ", verified"
    console.print(f"[bold green]Winner[/] ({how}): {best.config.short()}", highlight=False)
    if best.measured:
        console.print(
            f"  measured peak {fmt_size(best.peak_bytes)} reserved per "
            f"{device_noun(plan.device)}; the estimate:",
            highlight=False,
        )
    console.print(memory_levels_line(best.estimate, plan.device), markup=False, highlight=False)
    console.print(f"Why: {escape(plan.reason)}")
    mesh = plan.mesh_comparison()
    if mesh is not None:
        console.print(mesh_line(mesh), markup=False, highlight=False)
    if not best.measured and hw.source != "cpu":
        console.print(
            "[dim]Estimates only. On the real GPUs, run without --no-trials to measure the top "
            "candidates before you launch.[/]"
        )
    if plan.run_dir:
        files = "study, plan.json, plan.yaml, trials.png"
        files += ", lengths.json" if plan.request.lengths is not None else ""
        console.print(f"Run folder: {plan.run_dir} ({files})")
    for path in written or []:
        console.print(f"wrote {path}")


def sweep_line(t: Any) -> str:
    """One trial of `autofit calibrate`: measured beside the napkin."""
    r, est = t.result, t.estimate
    if r.status != Outcome.OK:
        why = r.message.splitlines()[0][:80] if r.message else ""
        return f"  {r.status:<7} {t.model} {t.config.short()}  {why}"
    return (
        f"  ok      {t.model} {t.config.short()}  peak {fmt_size(r.peak_bytes)} (napkin "
        f"{fmt_size(est.peak_bytes)})  {r.tokens_per_s or 0:,.0f} tokens/s "
        f"{whose_tokens(r.nprocs, r.device)} (napkin {est.tokens_per_s:,.0f})"
    )


def calibration_report(console: Console, run: Any) -> None:
    """What `autofit calibrate` fitted and where it is kept."""
    from autofit.calibration.store import describe

    cal = run.calibration
    console.print(f"machine: {describe(run.machine)}", markup=False, highlight=False)
    if not run.path or cal is None:
        console.print(
            "[red]No trial measured anything[/]: nothing was stored. See the trials above.",
        )
        return
    memory = _factors(cal.memory)
    if cal.memory_constant:
        memory += f"{', ' if memory else ''}constant {fmt_size(cal.memory_constant)}"
    speed = _factors(cal.speed)
    if cal.speed_constant:
        speed += f"{', ' if speed else ''}{cal.speed_constant * 1e3:.2f} ms per micro-step"
    lines = [
        f"moved from the napkin: memory {memory or 'nothing'}; speed {speed or 'nothing'} "
        "(every other term is the napkin's, within 0.02)",
        f"measured error (leave-one-out, 90th percentile): memory {cal.memory_band:.1%}, "
        f"speed {cal.speed_band:.1%}; median memory {pct(cal.memory_error)}, "
        f"speed {pct(cal.speed_error)}",
        f"stored ({cal.n_trials} measured trials of this machine): {run.path}",
        "Every later `autofit plan` on this machine starts from it; --no-calibration ignores it.",
    ]
    for line in lines:
        console.print(line, markup=False, highlight=False)


def _factors(factors: dict[str, float]) -> str:
    """The fitted terms that moved from the napkin's value (`_term`)."""
    return ", ".join(t for k, v in factors.items() if (t := _term(k, v)))


def _term(name: str, value: float) -> str:
    """A fitted term as people read it: a factor `x1.23`, or a share `+0.45` (of the dynamic
    memory or step time under a mode, of the bytes offloaded; 0 in the napkin). Unmoved ones
    (within 0.02 of the napkin's value) are left out."""
    from autofit.calibration import SHARE_TERMS

    share = name in SHARE_TERMS
    if abs(value - (0.0 if share else 1.0)) < 0.02:
        return ""
    return f"{name} {value:+.2f}" if share else f"{name} x{value:.2f}"
