"""The enumerate-and-estimate loop: every valid config of a space with its estimate, split into what
may fit (ranked) and what the estimate rules out; `plan_estimates` is the estimate-only plan
(`--no-trials`, `trials=0`). The search starts from the same list and replaces estimates with
measurements."""

from __future__ import annotations

from collections import Counter

from autofit.estimate import estimate
from autofit.plan.explain import infeasible_advice, loss_note, winner_reason
from autofit.plan.prune import prune_reason
from autofit.plan.rank import rank_key
from autofit.plan.types import Candidate, Plan
from autofit.request import PlanRequest


def estimate_all(request: PlanRequest) -> tuple[list[Candidate], Counter[str], int]:
    """Every valid config of the request's space with its estimate (space order), the
    combinations the space's rules skipped (by reason), and how many were considered in all."""
    r = request
    configs, skipped = r.space.candidates(
        r.hardware.n_gpus, seq_len=r.seq_len, global_batch=r.global_batch, device=r.device
    )
    cands = [Candidate(cfg, estimate(r.model, r.hardware, cfg, device=r.device)) for cfg in configs]
    return cands, Counter(skipped), len(configs) + sum(skipped.values())


def estimate_space(
    request: PlanRequest,
) -> tuple[list[Candidate], list[Candidate], Counter[str], int]:
    """(fitting candidates ranked best first, pruned candidates, prune counts, considered)."""
    cands, pruned_counts, considered = estimate_all(request)
    fitting: list[Candidate] = []
    rejected: list[Candidate] = []
    for cand in cands:
        reason = prune_reason(cand.estimate, request.margin, request.hardware)
        if reason:
            pruned_counts[reason] += 1
            rejected.append(cand)
        else:
            fitting.append(cand)
    fitting.sort(key=rank_key)
    return fitting, rejected, pruned_counts, considered


def plan_estimates(request: PlanRequest) -> Plan:
    """An estimate-only plan: the candidate with the highest estimated tokens/s that fits."""
    r = request
    fitting, rejected, pruned, considered = estimate_space(r)
    plan = Plan(
        request=r,
        best=fitting[0] if fitting else None,
        ranked=fitting,
        pruned=pruned,
        considered=considered,
    )
    if fitting:
        plan.reason = winner_reason(fitting[0], fitting[1:], r.hardware, measured=False)
        plan.reason += loss_note(fitting[0], r)
    else:
        plan.advice = infeasible_advice(
            r.model, r.hardware, r.space, rejected, r.seq_len, r.global_batch, r.margin,
            r.device, skipped=pruned,
        )  # fmt: skip
    return plan
