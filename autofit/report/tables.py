"""Rich tables and reports for the CLI: hardware, models, an estimate, a trial, a plan."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autofit.arch import structure_of
from autofit.estimate import Estimate
from autofit.hardware import GPU_PRESETS, Hardware
from autofit.layout import AUTO_WRAP
from autofit.models import ModelSpec
from autofit.plan import Outcome, Plan
from autofit.plan.explain import mesh_line
from autofit.report.data import lengths_line
from autofit.report.ranked import plan_table
from autofit.report.style import styled
from autofit.report.trials import pct, trials_table
from autofit.trials.result import TrialResult
from autofit.units import fmt_bytes, fmt_count, fmt_size, fmt_tokens_per_s


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


def presets_table() -> Table:
    table = Table(title="GPU presets (--gpus KxNAME, NxKxNAME)", title_justify="left")
    left = ("name", "GPU", "interconnect", "between nodes")
    for col in ("name", "GPU", "memory", "bf16 TFLOP/s", "mem GB/s", "interconnect", "link GB/s",
                "between nodes"):  # fmt: skip
        table.add_column(col, justify="left" if col in left else "right")
    for p in GPU_PRESETS.values():
        table.add_row(
            p.name,
            p.full_name,
            fmt_bytes(p.memory_bytes),
            f"{p.bf16_tflops:g}",
            f"{p.mem_bw_gbs:g}",
            "NVLink" if p.interconnect == "nvlink" else f"PCIe gen{p.pcie_gen} x{p.pcie_width}",
            f"{p.link_bw_gbs:g}",
            f"{p.network} {p.inter_node_bw_gbs:g} GB/s per GPU",
        )
    return table


def models_table(models: Iterable[ModelSpec]) -> Table:
    table = Table(
        title="Model presets (--model NAME, or a path to config.json)", title_justify="left"
    )
    for col in ("name", "model", "family", "params", "layers", "hidden", "heads/kv", "ffn",
                "vocab"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("name", "model", "family") else "right")
    for m in models:
        n = structure_of(m).n_params
        table.add_row(
            m.name,
            m.description,
            m.model_type,
            f"{n:,} ({fmt_count(n)})",
            str(m.layers),
            str(m.hidden),
            f"{m.heads}/{m.kv_heads}",
            str(m.intermediate),
            str(m.vocab),
        )
    return table


BREAKDOWN_LABELS = {
    "base_weights": "frozen base weights (storage width, scales incl.)",
    "trainable_weights": "trainable weights (master copy)",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "gathered_params": "working bf16 weight copies (FSDP2 all-gathers / autocast casts)",
    "activations": "activations",
    "logits_loss": "LM head logits + loss",
    "workspace": "cuBLAS/cuBLASLt workspaces",
}


def memory_levels_line(est: Estimate) -> str:
    """The estimate's memory per GPU level by level, on two lines of under 80 columns: what
    tensors hold, what the caching allocator reserves beyond them (the peak the plan compares
    with the usable memory), what lies outside it, and what the card then holds."""
    outside = " + ".join(
        f"{label} {fmt_size(est.overhead[name])}"
        for name, label in (("cuda_context", "CUDA context"), ("nccl", "NCCL"))
        if est.overhead.get(name)
    )
    return (
        f"  per GPU: allocated {fmt_size(est.peak_allocated_bytes)} + allocator slack "
        f"{fmt_size(est.allocator_slack_bytes)} = reserved {fmt_size(est.peak_bytes)}\n"
        f"  + {outside or 'nothing outside the allocator'} = device "
        f"{fmt_size(est.device_bytes)}"
    )


def capacity_line(plan: Plan) -> str:
    """The one memory figure a plan's peaks are held to, named once: the usable memory per GPU
    (the capacity less what lies outside the allocator) and the headroom line below it."""
    usable, cap = plan.usable_bytes, plan.capacity_bytes
    where = "per CPU process" if plan.device == "cpu" else "per GPU"
    less = "" if usable >= cap else f" ({fmt_size(cap)} less the CUDA context and NCCL buffers)"
    return (
        f"Memory: {fmt_size(usable)} usable {where}{less}; a winner keeps {plan.margin:.0%} of it "
        f"free, peaking at {fmt_size(plan.allowed_bytes)} at most."
    )


def held_as(sharding: str, wrap: str, requested: str | None, n: int, device: str = "cuda") -> str:
    """How the model is held, and, when the wrap was left to `auto`, what it became here."""
    text = SHARDING_TEXT.get(sharding, sharding)
    if requested != AUTO_WRAP:
        return text
    each = "CPU process" if device == "cpu" else "GPU"
    on = f"one {each}" if n <= 1 else f"{n} {each}s"
    return f"{text}; wrap: auto, which is {wrap} on {on}"


def estimate_report(
    console: Console,
    model: ModelSpec,
    hw: Hardware,
    est: Estimate,
    device: str = "cuda",
    requested_wrap: str | None = None,
) -> None:
    """`autofit estimate`'s report; `requested_wrap`: the wrap asked for (`auto` when none was
    named), shown beside the one it became."""
    cfg = est.config
    console.print(
        f"[bold]{model.name}[/] ({fmt_count(structure_of(model).n_params)} params) on "
        f"{hw.describe()}  "
        f"[dim]{cfg.short()}, seq_len {cfg.seq_len}[/]"
    )
    console.print(
        "held as " + held_as(est.sharding, cfg.wrap, requested_wrap, est.n_gpus, device),
        highlight=False,
    )
    table = Table(title=f"Peak memory per GPU (at the {est.peak_phase} peak)", title_justify="left")
    table.add_column("part")
    table.add_column("size", justify="right")
    for key, value in est.breakdown.items():
        table.add_row(BREAKDOWN_LABELS.get(key, key), fmt_size(value))
    table.add_row("[bold]allocated peak[/] (max_memory_allocated)",
                  f"[bold]{fmt_size(est.peak_allocated_bytes)}[/]")  # fmt: skip
    table.add_row("allocator slack (reserved - allocated)", fmt_size(est.allocator_slack_bytes))
    table.add_row(
        "[bold]reserved peak[/] (max_memory_reserved)", f"[bold]{fmt_size(est.peak_bytes)}[/]"
    )
    table.add_row("CUDA context (outside the allocator)", fmt_size(est.overhead["cuda_context"]))
    if est.overhead.get("nccl"):
        table.add_row("NCCL buffers (outside the allocator)", fmt_size(est.overhead["nccl"]))
    table.add_row("[bold]device-level peak[/] (NVML)", f"[bold]{fmt_size(est.device_bytes)}[/]")
    table.add_row("GPU capacity", fmt_size(est.capacity_bytes))
    console.print(table)
    if est.host_bytes:
        console.print(
            f"Host RAM for offloaded state{' per node' if hw.nodes > 1 else ''}: "
            f"{fmt_bytes(est.host_bytes)} of "
            f"{fmt_bytes(est.host_capacity_bytes)}"
        )
    verdict = "[green]fits[/]" if est.within_capacity else "[red]does not fit[/]"
    console.print(
        f"{verdict}: {fmt_size(est.device_bytes)} of "
        f"{fmt_size(est.capacity_bytes)}; step {est.step_time_s:.3f} s "
        f"({', '.join(f'{k} {v:.3f}' for k, v in est.time_breakdown.items() if v)}), "
        f"~{fmt_tokens_per_s(est.tokens_per_s, est.n_gpus, device)}"
    )
    if hw.nodes > 1:
        links = est.communication_by_link
        console.print(
            f"communication exposed inside nodes {links.get('intra', 0.0):.3f} s, between nodes "
            f"{links.get('inter', 0.0):.3f} s; the network is busy "
            f"{links.get('network_busy', 0.0):.3f} s per step"
            + (" (HSDP: shard: node)" if cfg.shard == "node" else ""),
            highlight=False,
        )
    if not est.within_capacity:
        console.print(next_step(model, hw, est, device), markup=False, highlight=False)


def next_step(model: ModelSpec, hw: Hardware, est: Estimate, device: str) -> str:
    """What would make an estimate that does not fit fit: only the changes the estimate says
    fit (`autofit.plan.fixes`), or that nothing does."""
    from autofit.plan.fixes import fitting_changes, more_gpus_that_fit, too_small

    cfg = est.config
    small = too_small(est, hw.describe())
    if small is not None:
        return small

    def fits(e: Estimate, _: Hardware) -> bool:
        return e.within_capacity

    fitting, together = fitting_changes(model, hw, cfg, device, fits)
    tips = [c.flags for c in fitting]
    if together is not None:
        tips.append(f"all of {together.flags}")
    n = more_gpus_that_fit(model, hw, cfg, device, fits)
    if n is not None:
        tips.append(f"{n} GPUs of this kind")
    if not tips:
        return (
            "Next step: by the estimate nothing autofit could change fits here (the chunked "
            "loss, full recomputation, a smaller micro-batch, NF4, offload, alone or together, "
            "or up to 64x the GPUs): plan for GPUs with more memory."
        )
    return (
        "Next step, each of which fits by the estimate: "
        + "; or ".join(tips)
        + ". `autofit plan` searches these and more."
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


SHARDING_TEXT = {
    "none": "the plain module (no sharding)",
    "ddp": "DDP replicas",
    "fsdp2": "FSDP2",
}


def trial_report(console: Console, result: TrialResult, requested_wrap: str | None = None) -> None:
    """`autofit trial`'s report; `requested_wrap` as `estimate_report` takes it."""
    status = styled(result.status)
    held = ""
    if result.sharding:
        wrap = str((result.config or {}).get("wrap", ""))
        held = held_as(result.sharding, wrap, requested_wrap, result.nprocs, result.device)
    console.print(
        f"trial {status}: {result.model} on {result.nprocs} x {result.device}"
        + (f", {held}" if held else "")
    )
    if result.status == Outcome.OK:
        device = (
            f"; device {fmt_size(result.device_peak_bytes)} with CUDA context"
            if result.device_peak_bytes
            else ""
        )
        console.print(
            f"  peak {fmt_size(result.peak_bytes)} reserved "
            f"({fmt_size(result.peak_allocated_bytes)} allocated) per GPU{device}; "
            f"build peak {fmt_size(result.build_peak_bytes)}"
        )
        speed = fmt_tokens_per_s(result.tokens_per_s or 0.0, result.nprocs, result.device)
        console.print(f"  {speed}; step {result.step_time_s:.3f} s", highlight=False)
        if result.compile_s is not None:
            console.print(
                f"  compiled: {result.graphs} graph(s), {result.graph_breaks} graph break(s), "
                f"{result.compile_s:.1f} s compiling (not in the step time)"
            )
        console.print("  losses: " + ", ".join(f"{x:.4f}" for x in result.losses))
    if result.message:
        console.print(f"  {result.message}")


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
        moved = [_term(k, v) for side in ("memory", "speed") for k, v in cal.get(side, {}).items()]
        moved = [m for m in moved if m]
        if moved:
            out[0] += "; moved from the napkin: " + ", ".join(moved)
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
        console.print(f"[red]No config fits.[/] {escape(plan.advice)}")
        return
    best = plan.best
    how = "measured" if best.measured else "estimated"
    if best.verified:
        how += ", verified"
    console.print(f"[bold green]Winner[/] ({how}): {best.config.short()}", highlight=False)
    if best.measured:
        console.print(
            f"  measured peak {fmt_size(best.peak_bytes)} reserved per GPU; the estimate:",
            highlight=False,
        )
    console.print(memory_levels_line(best.estimate), markup=False, highlight=False)
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
        f"{fmt_size(est.peak_bytes)})  {r.tokens_per_s or 0:,.0f} tokens/s of all {r.nprocs} "
        f"(napkin {est.tokens_per_s:,.0f})"
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
