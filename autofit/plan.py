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
from autofit.units import fmt_bytes, fmt_size

DEFAULT_MARGIN = 0.05

PRUNE_OVER_CAPACITY = "estimated peak above GPU memory"
PRUNE_OVER_MARGIN = "estimated peak within the headroom margin"
PRUNE_HOST_RAM = "offloaded state above host RAM"
PRUNE_NO_BF16 = "GPU has no bf16 support"

# How a plan's considered combinations split up (`Plan.tally`): each lands in exactly one.
TALLY_FIT_ESTIMATED = "fit (estimated)"
TALLY_FIT_MEASURED = "fit (measured under the headroom line)"
TALLY_OUTCOMES = {
    "over line": "ran, but peaked over the headroom line",
    "oom": "ran out of memory",
    "timeout": "timed out (--trial-timeout)",
    "error": "failed with an error",
}
TALLY_NOT_TRIED = "not tried (may fit; the trial budget or the search time ran out)"
TALLY_BY_ESTIMATE = "ruled out by the estimate"
TALLY_INVALID = "invalid (break a rule of the space or --global-batch)"


def estimate_reasons() -> set[str]:
    """The prune reasons that come from the estimate (the others are rules of the space)."""
    from autofit.search.candidates import PRUNE_BEYOND_ERROR

    return {PRUNE_OVER_CAPACITY, PRUNE_OVER_MARGIN, PRUNE_HOST_RAM, PRUNE_NO_BF16,
            PRUNE_BEYOND_ERROR}  # fmt: skip


def trial_status(result: Any, allowed_bytes: float) -> str:
    """What a trial's outcome reads as: its status, or 'over line' for a run that finished but
    peaked above the headroom line (it cannot be the winner)."""
    status = str(getattr(result, "status", "error"))
    peak = getattr(result, "peak_bytes", None)
    if status == "ok" and peak is not None and peak > allowed_bytes:
        return "over line"
    return status


@dataclass
class Candidate:
    """One configuration with its napkin estimate and, if it ran, its measured trial."""

    config: Config
    estimate: Estimate
    trial: Any | None = None  # autofit.trials.TrialResult when a trial ran
    verified: bool = False  # re-run with more steps and still fit
    number: int | None = None  # the Optuna trial number of `trial` (progress lines show it too)

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
            "trial_number": self.number,
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

    @property
    def allowed_bytes(self) -> float:
        """The headroom line: a measured winner's peak must stay at or below it."""
        from autofit.estimate.memory import usable_bytes

        return usable_bytes(self.capacity_bytes, self.device) * (1 - self.margin)

    @property
    def searched(self) -> bool:
        """A search's plan (a study with trials), not an estimate-only one."""
        return self.study_name is not None or bool(self.trials)

    def tally(self) -> list[tuple[str, int, list[tuple[str, int]]]]:
        """Where each of the `considered` combinations went, as (what, how many, [(reason, how
        many)]); every combination is in exactly one row, so the counts add up to `considered`.
        A search's measured configs count once each (by their latest trial)."""
        from_estimate = estimate_reasons()
        by_estimate = Counter({r: n for r, n in self.pruned.items() if r in from_estimate})
        by_rule = Counter({r: n for r, n in self.pruned.items() if r not in from_estimate})
        rows: list[tuple[str, int, list[tuple[str, int]]]] = []
        if self.searched:
            latest = {c.config: c for c in self.trials}
            outcomes = Counter(trial_status(c.trial, self.allowed_bytes) for c in latest.values())
            rows.append((TALLY_FIT_MEASURED, outcomes.pop("ok", 0), []))
            for status, n in outcomes.most_common():
                rows.append((TALLY_OUTCOMES.get(status, status), n, []))
            untried = self.considered - sum(self.pruned.values()) - len(latest)
            rows.append((TALLY_NOT_TRIED, max(untried, 0), []))
        else:
            rows.append((TALLY_FIT_ESTIMATED, len(self.ranked), []))
        rows.append((TALLY_BY_ESTIMATE, sum(by_estimate.values()), by_estimate.most_common()))
        rows.append((TALLY_INVALID, sum(by_rule.values()), by_rule.most_common()))
        return rows

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
            "tally": {what: n for what, n, _ in self.tally()},
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
                                        margin, device, skipped=pruned)  # fmt: skip
    return plan


def winner_reason(
    best: Candidate, others: list[Candidate], hardware: Hardware, *, measured: bool
) -> str:
    """One line on why `best` won, e.g. '1.8x the tokens/s of the next config; 21.3 of 24 GiB'."""
    what = "measured" if measured else "estimated"
    cap = best.estimate.usable_bytes
    mem = f"peak {fmt_size(best.peak_bytes)} of {fmt_size(cap)} usable"
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
    skipped: Counter[str] | None = None,
) -> str:
    """Nothing fits: name the nearest candidate, what dominates its memory, and what would help.
    `rejected`: the candidates ruled out by memory; `skipped`: combinations the space's rules
    (and --global-batch) skipped, by reason, for when there is no candidate at all."""
    if not hardware.gpu.bf16:
        return (
            f"{hardware.gpu.name} has no bf16 support (compute capability "
            f"{hardware.gpu.compute_capability}); autofit plans bf16 training, which needs an "
            "Ampere (8.0) or newer GPU."
        )
    if not rejected:
        return invalid_space_advice(space, hardware, global_batch, skipped or Counter())

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


def invalid_space_advice(
    space: Space, hardware: Hardware, global_batch: int | None, skipped: Counter[str]
) -> str:
    """No combination of the space is a valid config: which rules removed them, and the
    --global-batch hint only when the global batch alone leaves no micro_batch possible."""
    from autofit.config import derive_grad_accum

    n = hardware.n_gpus
    micro = list(space.knobs.get("micro_batch", ()))
    if global_batch and micro and all(derive_grad_accum(global_batch, mb, n) is None
                                      for mb in micro):  # fmt: skip
        step = min(micro) * n
        every = math.lcm(*(mb * n for mb in micro))
        example = -(-global_batch // every) * every
        return (
            f"--global-batch {global_batch} rules out every candidate: micro_batch x grad_accum x "
            f"{n} GPU(s) must equal it, and it is not a multiple of micro_batch x {n} for any "
            f"micro_batch of space '{space.name}' ({', '.join(map(str, micro))}). Use a multiple "
            f"of {step} (e.g. --global-batch {example}, which every micro_batch of the space "
            "divides), or leave --global-batch unset."
        )
    total = sum(skipped.values())
    reasons = "; ".join(f"{k:,} {r}" for r, k in skipped.most_common())
    return (
        f"No combination of space '{space.name}' is a valid config on {n} GPU(s): all {total:,} "
        f"break a rule ({reasons or 'none recorded'}). Widen the space's knob values (e.g. "
        "lora_rank above 0 for quantized bases, a wrap other than none for offload=params)."
    )
