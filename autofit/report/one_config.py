"""One config's reports: `autofit estimate` (the memory levels, how the model is held, the
next step that fits) and `autofit trial`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autofit.arch import structure_of
from autofit.data import LengthHistogram
from autofit.estimate import Estimate
from autofit.hardware import Hardware
from autofit.layout import AUTO_WRAP
from autofit.models import ModelSpec
from autofit.plan import Outcome
from autofit.plan.fixes import MORE_GPUS, fitting_changes, more_gpus_that_fit, too_small
from autofit.report.style import styled
from autofit.trials.result import TrialResult
from autofit.units import device_noun, fmt_bytes, fmt_count, fmt_size, fmt_tokens_per_s
from autofit.values import Shard

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


def memory_levels_line(est: Estimate, device: str = "cuda") -> str:
    """The estimate's memory per GPU (per CPU process on `device` cpu) level by level, on two
    lines of under 80 columns: what tensors hold, what the caching allocator reserves beyond
    them (the peak the plan compares with the usable memory), what lies outside it, and what the
    card then holds."""
    outside = " + ".join(
        f"{label} {fmt_size(est.overhead[name])}"
        for name, label in (("cuda_context", "CUDA context"), ("nccl", "NCCL"))
        if est.overhead.get(name)
    )
    return (
        f"  per {device_noun(device)}: allocated {fmt_size(est.peak_allocated_bytes)} + "
        f"allocator slack "
        f"{fmt_size(est.allocator_slack_bytes)} = reserved {fmt_size(est.peak_bytes)}\n"
        f"  + {outside or 'nothing outside the allocator'} = device "
        f"{fmt_size(est.device_bytes)}"
    )


def held_as(sharding: str, wrap: str, requested: str | None, n: int, device: str = "cuda") -> str:
    """How the model is held, and, when the wrap was left to `auto`, what it became here."""
    text = SHARDING_TEXT.get(sharding, sharding)
    if requested != AUTO_WRAP:
        return text
    on = f"one {device_noun(device)}" if n <= 1 else f"{n} {device_noun(device, n)}"
    return f"{text}; wrap: auto, which is {wrap} on {on}"


def estimate_report(
    console: Console,
    model: ModelSpec,
    hw: Hardware,
    est: Estimate,
    device: str = "cuda",
    requested_wrap: str | None = None,
    lengths: LengthHistogram | None = None,
) -> None:
    """`autofit estimate`'s report; `requested_wrap`: the wrap asked for (`auto` when none was
    named), shown beside the one it became; `lengths`: the data's, which `est` was made on."""
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
    noun = device_noun(device)
    table = Table(
        title=f"Peak memory per {noun} (at the {est.peak_phase} peak)", title_justify="left"
    )
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
    table.add_row(f"{noun} capacity", fmt_size(est.capacity_bytes))
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
            + (" (HSDP: shard: node)" if cfg.shard == Shard.NODE else ""),
            highlight=False,
        )
    if not est.within_capacity:
        console.print(next_step(model, hw, est, device, lengths), markup=False, highlight=False)


def next_step(
    model: ModelSpec,
    hw: Hardware,
    est: Estimate,
    device: str,
    lengths: LengthHistogram | None = None,
) -> str:
    """What would make an estimate that does not fit fit: only the changes the estimate says
    fit (`autofit.plan.fixes`, estimated on the data's `lengths` as `est` was), or that nothing
    does."""
    cfg = est.config
    small = too_small(est, hw.describe())
    if small is not None:
        return small

    def fits(e: Estimate, _: Hardware) -> bool:
        return e.within_capacity

    fitting, together = fitting_changes(model, hw, cfg, device, fits, lengths)
    tips = [c.flags for c in fitting]
    if together is not None:
        tips.append(f"all of {together.flags}")
    n = more_gpus_that_fit(model, hw, cfg, device, fits, lengths)
    if n is not None:
        tips.append(f"{n} GPUs of this kind")
    if not tips:
        return (
            "Next step: by the estimate nothing autofit could change fits here (the chunked "
            "loss, full recomputation, a smaller micro-batch, NF4, offload, alone or together, "
            f"or up to {MORE_GPUS[-1]}x the GPUs): plan for GPUs with more memory."
        )
    return (
        "Next step, each of which fits by the estimate: "
        + "; or ".join(tips)
        + ". `autofit plan` searches these and more."
    )


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
    loop = {
        "trainer": ", HF Trainer's training loop (launch: trainer)",
        "trl": ", TRL's SFTTrainer (launch: trl)",
    }.get(str((result.config or {}).get("launch", "autofit")), "")
    console.print(
        f"trial {status}: {result.model} on {result.nprocs} x {result.device}"
        + (f", {held}" if held else "")
        + loop
    )
    if result.status == Outcome.OK:
        device = (
            f"; device {fmt_size(result.device_peak_bytes)} with CUDA context"
            if result.device_peak_bytes
            else ""
        )
        console.print(
            f"  peak {fmt_size(result.peak_bytes)} reserved "
            f"({fmt_size(result.peak_allocated_bytes)} allocated) per "
            f"{device_noun(result.device or 'cuda')}{device}; "
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
