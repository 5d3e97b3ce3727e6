"""The sentences users read about a plan: why the winner won, what to do when nothing fits, and
where every considered combination went (`tally`)."""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from autofit.estimate import Estimate, estimate
from autofit.estimate.memory import HOST_RAM_USABLE, usable_host_bytes
from autofit.hardware import Hardware
from autofit.models import ModelSpec
from autofit.plan.fixes import MORE_GPUS, fitting_changes, more_gpus_that_fit, too_small
from autofit.plan.outcome import Outcome, trial_status
from autofit.plan.prune import PruneReason, headroom_line, host_ram_bound, prune_reason
from autofit.plan.rank import RECIPE_KNOBS, TIE_TOLERANCE, faster, recipe_key, slower
from autofit.rules import derive_grad_accum
from autofit.space import Space
from autofit.units import device_noun, fmt_bytes, fmt_size, fmt_tokens_per_s
from autofit.values import Loss, Shard, Wrap

if TYPE_CHECKING:
    from autofit.data import LengthHistogram
    from autofit.plan.types import Candidate, Plan
    from autofit.request import PlanRequest

ESTIMATE_REASONS = {r.value for r in PruneReason}
"""Prune reasons that come from the estimate (the others are rules of the space)."""

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


def tally(plan: Plan) -> list[tuple[str, int, list[tuple[str, int]]]]:
    """Where each of the `considered` combinations went, as (what, how many, [(reason, how
    many)]); every combination is in exactly one row, so the counts add up to `considered`.
    A search's measured configs count once each (by their latest trial)."""
    by_estimate = Counter({r: n for r, n in plan.pruned.items() if r in ESTIMATE_REASONS})
    by_rule = Counter({r: n for r, n in plan.pruned.items() if r not in ESTIMATE_REASONS})
    rows: list[tuple[str, int, list[tuple[str, int]]]] = []
    if plan.searched:
        latest = {c.config: c for c in plan.trials}
        outcomes = Counter(trial_status(c.trial, plan.allowed_bytes) for c in latest.values())
        rows.append((TALLY_FIT_MEASURED, outcomes.pop(Outcome.OK, 0), []))
        for status, n in outcomes.most_common():
            rows.append((TALLY_OUTCOMES.get(status, status), n, []))
        untried = plan.considered - sum(plan.pruned.values()) - len(latest)
        rows.append((TALLY_NOT_TRIED, max(untried, 0), []))
    else:
        rows.append((TALLY_FIT_ESTIMATED, len(plan.ranked), []))
    rows.append((TALLY_BY_ESTIMATE, sum(by_estimate.values()), by_estimate.most_common()))
    rows.append((TALLY_INVALID, sum(by_rule.values()), by_rule.most_common()))
    return rows


def winner_reason(
    best: Candidate,
    others: list[Candidate],
    hardware: Hardware,
    *,
    measured: bool,
    device: str = "cuda",
) -> str:
    """Why `best` won, against `others` (ranked best first): its speed beside the runner-up's,
    the first of `others` that differs in a knob of the recipe (`RECIPE_KNOBS`: the next row of
    the plan's table), and, when estimates tie (within `TIE_TOLERANCE`), that they do and how
    the tie was broken (the plainest config first, then the lower peak: the short form of
    `TIE_BREAK`, which the plan's table prints whole). Every tokens/s is the whole run's, all GPUs
    together."""
    what = "measured" if measured else "estimated"
    speed = fmt_tokens_per_s(best.tokens_per_s, hardware.n_gpus, device)
    if not others:
        return f"the only config that fits ({what} {speed})."
    quicker = [c for c in others if faster(c.tokens_per_s, best.tokens_per_s)]
    # by identity: comparing candidates field by field made this quadratic in slow equality
    # checks (minutes for a space where ten thousand configs fit)
    passed = {id(c) for c in quicker}
    ties = [c for c in others if id(c) not in passed and not slower(c.tokens_per_s,
                                                                    best.tokens_per_s)]  # fmt: skip
    key = recipe_key(best.config)
    runner = next((c for c in others if id(c) not in passed and recipe_key(c.config) != key), None)
    parts = [f"{what} {speed}"]
    if ties:
        parts.append(
            f"a tie: {len(ties):,} other config(s) are {what} within {TIE_TOLERANCE:.1%} of "
            "its tokens/s, closer than a few trial steps tell apart; the tie-break puts the "
            "plainest config first, then the lower peak"
        )
    if runner is None:
        parts.append(
            "every other config that fits is a variant of its recipe (another reshard, offload, "
            "optimizer or precision)"
        )
    else:
        label, r = runner.config.short(), runner.tokens_per_s
        differs = ", ".join(
            f"{k}: {getattr(runner.config, k)}"
            for k in RECIPE_KNOBS
            if getattr(runner.config, k) != getattr(best.config, k)
        )
        ratio = best.tokens_per_s / r if r else float("inf")
        if slower(r, best.tokens_per_s):
            parts.append(
                f"{ratio:.2f}x the {what} tokens/s of the runner-up '{label}' ({r:,.0f}; "
                f"differs in {differs})"
            )
        else:
            parts.append(f"the runner-up '{label}' ({r:,.0f}; differs in {differs}) ties with it")
    if quicker and measured:
        parts.append(
            f"{len(quicker)} faster config(s) fit in their first trial but failed verification "
            "(over the headroom line or not ok when re-run with more steps)"
        )
    return "; ".join(parts) + "."


def mesh_comparison(ranked: list[Candidate], hardware: Hardware) -> dict[str, Any] | None:
    """Past one node, the fastest HSDP config (`shard: node`) against the fastest flat FSDP2 one
    (`shard: all`, sharded over every GPU) among `ranked` (best first): each one's label,
    tokens/s, and seconds per step its collectives keep the network busy and leave exposed
    (`Estimate.communication_by_link`), and how much faster HSDP is (negative: slower). None on
    one node or when either kind has no config that fits."""
    if hardware.nodes <= 1:
        return None
    best: dict[str, Candidate] = {}
    for c in ranked:
        kind = (
            "hsdp" if c.config.shard == Shard.NODE else "fsdp" if c.config.wrap != Wrap.NONE else ""
        )
        if kind and kind not in best:
            best[kind] = c
            if len(best) == 2:
                break
    if len(best) < 2:
        return None
    out: dict[str, Any] = {}
    for kind, c in best.items():
        links = c.estimate.communication_by_link
        out[kind] = {
            "label": c.config.short(),
            "tokens_per_s": c.tokens_per_s,
            "network_busy_s": links.get("network_busy", 0.0),
            "network_exposed_s": links.get("inter", 0.0),
        }
    out["hsdp_speedup"] = out["hsdp"]["tokens_per_s"] / out["fsdp"]["tokens_per_s"] - 1.0
    return out


def mesh_line(comparison: dict[str, Any]) -> str:
    """`mesh_comparison` as one sentence."""
    h, f, gain = comparison["hsdp"], comparison["fsdp"], comparison["hsdp_speedup"]
    return (
        f"HSDP (shard: node) best: {h['tokens_per_s']:,.0f} tokens/s of all GPUs together "
        f"('{h['label']}') vs flat "
        f"FSDP best: {f['tokens_per_s']:,.0f} tokens/s ('{f['label']}'): "
        f"{abs(gain):.1%} {'faster' if gain >= 0 else 'slower'}; network busy "
        f"{h['network_busy_s']:.3f} s vs {f['network_busy_s']:.3f} s per step, exposed "
        f"{h['network_exposed_s']:.3f} s vs {f['network_exposed_s']:.3f} s."
    )


def loss_note(best: Candidate, request: PlanRequest) -> str:
    """Why a winner with a memory-lean loss (`chunked`, `fused`) needs it: its loss's bytes
    against the model's own, and, when the standard loss would not fit this config, the largest
    micro-batch of the space that would (every other knob the same). Empty for `standard`, or
    when the standard loss fits too (the winner then won on speed alone)."""
    cfg, r = best.config, request
    if cfg.loss == Loss.STANDARD:
        return ""
    own = estimate(r.model, r.hardware, cfg.replace(loss=Loss.STANDARD), device=r.device,
                   lengths=r.lengths)  # fmt: skip
    if prune_reason(own, r.margin, r.hardware) is None:
        return ""
    lean = best.estimate.breakdown["logits_loss"]
    text = (
        f" loss={cfg.loss} keeps {fmt_size(lean)} for the LM head and loss where the model's own "
        f"needs {fmt_size(own.breakdown['logits_loss'])} at micro-batch {cfg.micro_batch}, "
        f"which with it would peak at {fmt_size(own.peak_bytes)}, over the headroom line"
    )
    fits = []
    for mb in sorted(r.space.knobs["micro_batch"]):
        if mb >= cfg.micro_batch:
            break
        smaller = cfg.replace(loss=Loss.STANDARD, micro_batch=mb)
        if r.global_batch:
            ga = derive_grad_accum(r.global_batch, mb, r.hardware.n_gpus)
            if ga is None:
                continue
            smaller = smaller.replace(grad_accum=ga)
        est = estimate(r.model, r.hardware, smaller, device=r.device, lengths=r.lengths)
        if prune_reason(est, r.margin, r.hardware) is None:
            fits.append(mb)
    if fits:
        return f"{text}; the standard loss fits micro-batch {max(fits)} at most."
    return f"{text}; the standard loss fits no micro-batch of the space with these knobs."


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
    lengths: LengthHistogram | None = None,
) -> str:
    """Nothing fits: name the nearest candidate, what dominates its memory, and what would help.
    `rejected`: the candidates ruled out by memory; `skipped`: combinations the space's rules
    (and --global-batch) skipped, by reason, for when there is no candidate at all; `lengths`:
    the data's sequence lengths, which every change is estimated on (as the candidates were)."""
    gpu = hardware.smallest_gpu
    if not gpu.bf16:
        return (
            f"{gpu.name} has no bf16 support (compute capability "
            f"{gpu.compute_capability}); autofit plans bf16 training, which needs an "
            "Ampere (8.0) or newer GPU."
        )
    if not rejected:
        return invalid_space_advice(space, hardware, global_batch, skipped or Counter())
    nearest = _nearest(rejected, margin)
    est = nearest.estimate
    noun = device_noun("cpu" if hardware.source == "cpu" else "cuda")  # CPU processes' memory
    bound = _bound(est, noun)
    small = too_small(est, hardware.describe())
    if small is not None:
        return small
    nothing_fits = (
        f"Nothing in space '{space.name}' fits {hardware.describe()} "
        f"({fmt_size(est.usable_bytes)} usable per {noun}, {margin:.0%} headroom kept). Nearest: "
        f"'{nearest.config.short()}', bound by {bound}."
    )
    tips = _fitting_tips(model, hardware, space, nearest, seq_len, margin, device, lengths)
    return f"{nothing_fits} {_tips_sentence(tips)}"


def _nearest(rejected: list[Candidate], margin: float) -> Candidate:
    """The rejected candidate nearest to fitting: the least overshoot of its headroom line (or
    of the host RAM a run may use)."""

    def overshoot(c: Candidate) -> float:
        e = c.estimate
        host = e.host_bytes / max(usable_host_bytes(e.host_capacity_bytes), 1)
        return max(e.peak_bytes / max(headroom_line(e.usable_bytes, margin), 1), host)

    return min(rejected, key=overshoot)


def _bound(est: Estimate, noun: str) -> str:
    """What bounds the estimate: the host RAM it offloads to, or the memory per device (`noun`)
    and its largest part."""
    part, size = max(est.breakdown.items(), key=lambda kv: kv[1])
    if host_ram_bound(est):
        return (
            f"host RAM: it offloads {fmt_bytes(est.host_bytes)} to a host with "
            f"{fmt_bytes(est.host_capacity_bytes)}"
        )
    return (
        f"{noun} memory: {fmt_bytes(est.peak_bytes)} per {noun}, mostly "
        f"{part.replace('_', ' ')} ({fmt_bytes(size)})"
    )


def _fitting_tips(
    model: ModelSpec,
    hardware: Hardware,
    space: Space,
    nearest: Candidate,
    seq_len: int,
    margin: float,
    device: str,
    lengths: LengthHistogram | None,
) -> list[str]:
    """What would make `nearest` fit, each checked by the estimate: more host RAM, more GPUs, a
    shorter --seq-len, the changes the space lacks alone (what it holds was estimated already)
    and all of them together."""

    def fits(e: Estimate, hw: Hardware) -> bool:
        return prune_reason(e, margin, hw) is None

    tips = []
    est, config = nearest.estimate, nearest.config
    if host_ram_bound(est):
        need = est.host_bytes / HOST_RAM_USABLE
        tips.append(f"a host with at least {fmt_bytes(need)} of RAM")
    n = more_gpus_that_fit(model, hardware, config, device, fits, lengths)
    if n is not None:
        tips.append(f"{n} GPUs of this kind")
    seq = seq_len
    while seq > 128:
        seq //= 2
        cfg = config.replace(seq_len=seq)
        if fits(estimate(model, hardware, cfg, device=device, lengths=lengths), hardware):
            tips.append(f"--seq-len {seq}")
            break
    knobs = space.knobs
    # the changes the space lacks (what it holds was estimated already), each checked
    fitting, together = fitting_changes(model, hardware, config, device, fits, lengths)
    tips += [
        f"a space with {c.space}"
        for c in fitting
        if any(v not in knobs.get(k, ()) for k, v in c.knobs.items())
    ]
    if together is not None:
        tips.append(
            "a space with all of " + ", ".join(f"{k} {v}" for k, v in together.knobs.items())
        )
    return tips


def _tips_sentence(tips: list[str]) -> str:
    """The sentence that lists `tips`, or says that nothing autofit could change helps."""
    if tips:
        return "What would make it fit, by the estimate: " + "; or ".join(tips) + "."
    return (
        "By the estimate, nothing autofit could change makes it fit: not up to "
        f"{MORE_GPUS[-1]}x the GPUs, a shorter --seq-len, nor the chunked loss, full "
        "recomputation, micro-batch 1, NF4 or offload, alone or together."
    )


def invalid_space_advice(
    space: Space, hardware: Hardware, global_batch: int | None, skipped: Counter[str]
) -> str:
    """No combination of the space is a valid config: which rules removed them, and the
    --global-batch hint only when the global batch alone leaves no micro_batch possible."""
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
