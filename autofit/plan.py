"""Plans: the winner among candidates, with the evidence (estimates, and trials when they ran).

`plan_estimates` is the estimate-only plan (`--no-trials`, `trials=0`): enumerate the space,
estimate every candidate, prune what cannot fit, rank the rest by estimated tokens/s. The search
(`autofit.search`) starts from the same ranked list and replaces estimates with measurements.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autofit.config import Config
from autofit.estimate import Estimate, estimate
from autofit.hardware import Hardware
from autofit.models import ModelSpec
from autofit.space import Space
from autofit.units import GiB, fmt_bytes

DEFAULT_MARGIN = 0.05

PRUNE_OVER_CAPACITY = "estimated peak above GPU memory"
PRUNE_OVER_MARGIN = "estimated peak within the headroom margin"
PRUNE_HOST_RAM = "offloaded state above host RAM"
PRUNE_NO_BF16 = "GPU has no bf16 support"


@dataclass
class Candidate:
    """One configuration with its napkin estimate and, if it ran, its measured trial."""

    config: Config
    estimate: Estimate
    trial: Any | None = None  # autofit.trial.TrialResult when a trial ran
    verified: bool = False  # re-run with more steps and still fit

    @property
    def measured(self) -> bool:
        return self.trial is not None and getattr(self.trial, "status", None) == "ok"

    @property
    def tokens_per_s(self) -> float:
        if self.measured and self.trial.tokens_per_s is not None:
            return float(self.trial.tokens_per_s)
        return self.estimate.tokens_per_s

    @property
    def peak_bytes(self) -> int:
        if self.measured and self.trial.peak_bytes is not None:
            return int(self.trial.peak_bytes)
        return self.estimate.peak_bytes

    @property
    def step_time_s(self) -> float:
        if self.measured and self.trial.step_time_s is not None:
            return float(self.trial.step_time_s)
        return self.estimate.step_time_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "label": self.config.short(),
            "measured": self.measured,
            "verified": self.verified,
            "tokens_per_s": self.tokens_per_s,
            "peak_bytes": self.peak_bytes,
            "step_time_s": self.step_time_s,
            "estimate": {
                "peak_bytes": self.estimate.peak_bytes,
                "peak_allocated_bytes": self.estimate.peak_allocated_bytes,
                "tokens_per_s": self.estimate.tokens_per_s,
                "step_time_s": self.estimate.step_time_s,
                "breakdown": self.estimate.breakdown,
            },
            "trial": self.trial.to_dict() if self.trial is not None else None,
        }


@dataclass
class Plan:
    """The outcome of planning: `best`, the evidence, and what was pruned and why."""

    model: ModelSpec
    hardware: Hardware
    space: Space
    seq_len: int
    global_batch: int | None
    margin: float
    device: str
    best: Candidate | None
    ranked: list[Candidate]  # candidates that fit, best first
    trials: list[Candidate] = field(default_factory=list)  # candidates that ran a trial
    pruned: Counter[str] = field(default_factory=Counter)
    considered: int = 0
    reason: str = ""
    advice: str = ""  # when nothing fits: what bound hardest and what would help
    storage: str | None = None
    study_name: str | None = None
    run_dir: str | None = None

    @property
    def capacity_bytes(self) -> int:
        return self.hardware.capacity_bytes

    def export(self, format: str, path: str | Path) -> list[Path]:
        """Write the winner as `autofit` YAML, an `accelerate` FSDP2 config or `trainer` JSON."""
        from autofit.export import export_plan

        return export_plan(self, format, path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "n_params": self.model.n_params,
            "hardware": self.hardware.to_dict(),
            "space": self.space.name,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "margin": self.margin,
            "device": self.device,
            "capacity_bytes": self.capacity_bytes,
            "best": self.best.to_dict() if self.best else None,
            "reason": self.reason,
            "advice": self.advice,
            "considered": self.considered,
            "fitting": len(self.ranked),
            "pruned": dict(self.pruned),
            "ranked": [c.to_dict() for c in self.ranked[:20]],
            "trials": [c.to_dict() for c in self.trials],
            "storage": self.storage,
            "study": self.study_name,
            "run_dir": self.run_dir,
        }


def complexity(cfg: Config) -> int:
    """How far a config departs from the plain recipe (AdamW, no offload, mixed precision, no
    recompute): among equally fast configs users want the plainest."""
    return (
        (cfg.optimizer != "adamw")
        + (cfg.offload != "none")
        + (cfg.precision != "bf16-mixed")
        + (cfg.checkpointing != "none")
        + (not cfg.reshard)
    )


def rank_key(c: Candidate) -> tuple[int, int, int]:
    """Fastest first; speeds within 0.5% count as equal, then the plainest, then the lower peak."""
    speed = int(math.log(max(c.tokens_per_s, 1e-9)) / math.log(1.005))
    return (-speed, complexity(c.config), c.peak_bytes)


def prune_reason(est: Estimate, margin: float, hardware: Hardware) -> str | None:
    """Why an estimate rules its candidate out, or None if it may fit with `margin` headroom."""
    if not hardware.gpu.bf16:
        return PRUNE_NO_BF16
    if est.host_bytes > 0.8 * est.host_capacity_bytes:
        return PRUNE_HOST_RAM
    if est.peak_bytes > est.usable_bytes:
        return PRUNE_OVER_CAPACITY
    if est.peak_bytes > est.usable_bytes * (1 - margin):
        return PRUNE_OVER_MARGIN
    return None


def estimate_all(
    model: ModelSpec,
    hardware: Hardware,
    space: Space,
    *,
    seq_len: int | None = None,
    global_batch: int | None = None,
    device: str = "cuda",
) -> tuple[list[Candidate], Counter[str], int]:
    """Every valid config of the space with its estimate (space order), the combinations the
    space's rules skipped (by reason), and how many combinations were considered in all."""
    configs, skipped = space.candidates(hardware.n_gpus, seq_len=seq_len, global_batch=global_batch)
    cands = [Candidate(cfg, estimate(model, hardware, cfg, device=device)) for cfg in configs]
    return cands, Counter(skipped), len(configs) + sum(skipped.values())


def estimate_space(
    model: ModelSpec,
    hardware: Hardware,
    space: Space,
    *,
    seq_len: int | None = None,
    global_batch: int | None = None,
    margin: float = DEFAULT_MARGIN,
    device: str = "cuda",
) -> tuple[list[Candidate], list[Candidate], Counter[str], int]:
    """(fitting candidates ranked best first, pruned candidates, prune counts, considered)."""
    cands, pruned_counts, considered = estimate_all(
        model, hardware, space, seq_len=seq_len, global_batch=global_batch, device=device
    )
    fitting: list[Candidate] = []
    rejected: list[Candidate] = []
    for cand in cands:
        reason = prune_reason(cand.estimate, margin, hardware)
        if reason:
            pruned_counts[reason] += 1
            rejected.append(cand)
        else:
            fitting.append(cand)
    fitting.sort(key=rank_key)
    return fitting, rejected, pruned_counts, considered


def plan_estimates(
    model: ModelSpec,
    hardware: Hardware,
    space: Space,
    *,
    seq_len: int | None = None,
    global_batch: int | None = None,
    margin: float = DEFAULT_MARGIN,
    device: str = "cuda",
) -> Plan:
    """An estimate-only plan: the candidate with the highest estimated tokens/s that fits."""
    seq = seq_len or space.seq_len
    fitting, rejected, pruned, considered = estimate_space(
        model, hardware, space, seq_len=seq, global_batch=global_batch, margin=margin,
        device=device,
    )  # fmt: skip
    plan = Plan(
        model=model,
        hardware=hardware,
        space=space,
        seq_len=seq,
        global_batch=global_batch,
        margin=margin,
        device=device,
        best=fitting[0] if fitting else None,
        ranked=fitting,
        pruned=pruned,
        considered=considered,
    )
    if fitting:
        plan.reason = winner_reason(fitting[0], fitting[1:], hardware, measured=False)
    else:
        plan.advice = infeasible_advice(model, hardware, space, rejected, seq, global_batch,
                                        margin, device)  # fmt: skip
    return plan


def winner_reason(
    best: Candidate, others: list[Candidate], hardware: Hardware, *, measured: bool
) -> str:
    """One line on why `best` won, e.g. '1.8x the tokens/s of the next config; 21.3 of 24 GiB'."""
    what = "measured" if measured else "estimated"
    cap = best.estimate.usable_bytes
    unit, scale = ("MiB", 1024**2) if cap < 4 * GiB else ("GiB", GiB)  # CPU caps are small
    mem = f"peak {best.peak_bytes / scale:.1f} of {cap / scale:.1f} {unit} usable"
    if not others:
        return f"the only config that fits ({what} {best.tokens_per_s:,.0f} tokens/s; {mem})."
    faster = [c for c in others if c.tokens_per_s > best.tokens_per_s * 1.005]
    ties = [c for c in others if c not in faster and c.tokens_per_s >= best.tokens_per_s / 1.005]
    slower = [c for c in others if c.tokens_per_s < best.tokens_per_s / 1.005]
    text = ""
    if slower:
        nxt = max(slower, key=lambda c: c.tokens_per_s)
        ratio = best.tokens_per_s / nxt.tokens_per_s if nxt.tokens_per_s else float("inf")
        label = nxt.config.short()
        text = f"{ratio:.2f}x the {what} tokens/s of the next config that fits ('{label}')"
    if ties:
        tie = f"ties within 0.5% with {len(ties)} other config(s) and is the plainest of them"
        text = f"{text}; {tie}" if text else tie
    if faster and measured:
        text += (
            f"; {len(faster)} faster config(s) fit in their first trial but failed verification "
            "(over the headroom line or not ok when re-run with more steps)"
        )
    return f"{text.lstrip('; ')}; {mem}."


def infeasible_advice(
    model: ModelSpec,
    hardware: Hardware,
    space: Space,
    rejected: list[Candidate],
    seq_len: int,
    global_batch: int | None,
    margin: float,
    device: str,
) -> str:
    """Nothing fits: name the nearest candidate, what dominates its memory, and what would help."""
    if not hardware.gpu.bf16:
        return (
            f"{hardware.gpu.name} has no bf16 support (compute capability "
            f"{hardware.gpu.compute_capability}); autofit plans bf16 training, which needs an "
            "Ampere (8.0) or newer GPU."
        )
    if not rejected:
        return (
            "No candidate of the space is valid for these settings: check --global-batch against "
            "micro_batch x GPUs, and the space's knob values."
        )

    def overshoot(c: Candidate) -> float:
        e = c.estimate
        host = e.host_bytes / max(0.8 * e.host_capacity_bytes, 1)
        return max(e.peak_bytes / max(e.usable_bytes * (1 - margin), 1), host)

    nearest = min(rejected, key=overshoot)
    est = nearest.estimate
    part, size = max(est.breakdown.items(), key=lambda kv: kv[1])
    host_bound = est.host_bytes > 0.8 * est.host_capacity_bytes
    bound = (
        f"host RAM: it offloads {fmt_bytes(est.host_bytes)} to a host with "
        f"{fmt_bytes(est.host_capacity_bytes)}"
        if host_bound
        else f"GPU memory: {fmt_bytes(est.peak_bytes)} per GPU, mostly "
        f"{part.replace('_', ' ')} ({fmt_bytes(size)})"
    )
    lines = [
        f"Nothing in space '{space.name}' fits {hardware.describe()} "
        f"({fmt_bytes(est.usable_bytes)} usable per GPU, {margin:.0%} headroom kept). Nearest: "
        f"'{nearest.config.short()}', bound by {bound}."
    ]
    tips = []
    if host_bound:
        tips.append(f"a host with at least {fmt_bytes(est.host_bytes / 0.8)} of RAM")
    from dataclasses import replace as _replace

    gpus = hardware.gpus
    for k in (2, 4, 8, 16, 32, 64):
        n = len(gpus) * k
        more = _replace(hardware, gpus=tuple(_replace(gpus[0], index=i) for i in range(n)))
        more_est = estimate(model, more, nearest.config, device=device)
        if prune_reason(more_est, margin, more) is None:
            tips.append(f"{n} GPUs of this kind")
            break
    seq = seq_len
    while seq > 128:
        seq //= 2
        cfg = nearest.config.replace(seq_len=seq)
        if prune_reason(estimate(model, hardware, cfg, device=device), margin, hardware) is None:
            tips.append(f"--seq-len {seq}")
            break
    knobs = space.knobs
    if "nf4" not in knobs["quant"]:
        tips.append("a space with quant nf4 (--space qlora)")
    if "params" not in knobs["offload"]:
        tips.append("a space with offload params (--space full or default)")
    if "full" not in knobs["checkpointing"]:
        tips.append("checkpointing full")
    if tips:
        lines.append("What would make it fit: " + "; or ".join(tips) + ".")
    return " ".join(lines)
