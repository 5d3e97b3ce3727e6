"""The enumerate-and-estimate loop: every valid config of a space with its estimate, split into what
may fit (ranked) and what the estimate rules out; `plan_estimates` is the estimate-only plan
(`--no-trials`, `trials=0`). The search starts from the same list and replaces estimates with
measurements."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from autofit.estimate import estimate, estimate_many
from autofit.plan.explain import infeasible_advice, loss_note, winner_reason
from autofit.plan.prune import prune_reason
from autofit.plan.rank import rank_key
from autofit.plan.types import Candidate, Plan
from autofit.request import PlanRequest

if TYPE_CHECKING:
    from autofit.calibration import Calibration


def estimate_all(request: PlanRequest) -> tuple[list[Candidate], Counter[str], int]:
    """Every valid config of the request's space with its estimate (space order), the
    combinations the space's rules skipped (by reason), and how many were considered in all."""
    r = request
    with _acyclic():
        configs, skipped = r.space.candidates(
            r.hardware.n_gpus, seq_len=r.seq_len, global_batch=r.global_batch, device=r.device,
            nodes=r.hardware.nodes, data=r.lengths is not None,
        )  # fmt: skip
        estimates = estimate_many(r.model, r.hardware, configs, device=r.device,
                                  lengths=r.lengths)  # fmt: skip
        cands = [Candidate(cfg, e) for cfg, e in zip(configs, estimates, strict=True)]
    return cands, Counter(skipped), len(configs) + sum(skipped.values())


@contextmanager
def _acyclic() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a space's candidates are made: a few
    hundred thousand objects without a reference cycle, which each collection would walk again
    as they pile up (a third of the time of scoring the default space). They outlive the batch,
    so on the way out they join the oldest generation at once (`gc.freeze` then `unfreeze`),
    where the next full collection finds them, rather than being walked by the younger two."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


def stored_calibration(request: PlanRequest) -> Calibration | None:
    """This machine's stored calibration when the request uses it (`calibration: auto`)."""
    from autofit.calibration import store

    return store.for_request(request)


def estimate_space(
    request: PlanRequest,
) -> tuple[list[Candidate], list[Candidate], Counter[str], int]:
    """(fitting candidates ranked best first, pruned candidates, prune counts, considered).
    Under `calibration: auto` with a stored calibration of this machine, the estimates are the
    calibrated ones (`stored_calibration`)."""
    return _estimate_space(request, stored_calibration(request))


def _estimate_space(
    request: PlanRequest, cal: Calibration | None
) -> tuple[list[Candidate], list[Candidate], Counter[str], int]:
    cands, pruned_counts, considered = estimate_all(request)
    if cal is not None:
        cands = [Candidate(c.config, cal.apply(c.estimate)) for c in cands]
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
    if request.device != "cpu":
        _replay_ranked_top(request, cal, fitting, rejected, pruned_counts)
    return fitting, rejected, pruned_counts, considered


TOP_REPLAYED = 5
"""The ranked top whose allocator slack is always read from a replay of its own step (a batch
replays the configs nearest the capacity line within its budget and derives the rest's slack
from them: `autofit.estimate.estimate_many`)."""


def _replay_ranked_top(
    request: PlanRequest, cal: Calibration | None, fitting: list[Candidate],
    rejected: list[Candidate], pruned_counts: Counter[str],
) -> None:  # fmt: skip
    """Estimate the ranked top again, each alone (its own replay), until the top
    `TOP_REPLAYED` are all replayed: one that no longer fits joins the rejected, in place."""
    done: set[int] = set()
    for _ in range(4):
        top = [c for c in fitting[:TOP_REPLAYED] if id(c.config) not in done]
        if not top:
            return
        for cand in top:
            done.add(id(cand.config))
            est = estimate(request.model, request.hardware, cand.config, device=request.device,
                           lengths=request.lengths)  # fmt: skip
            cand.estimate = cal.apply(est) if cal is not None else est
            reason = prune_reason(cand.estimate, request.margin, request.hardware)
            if reason:
                fitting.remove(cand)
                pruned_counts[reason] += 1
                rejected.append(cand)
        fitting.sort(key=rank_key)


def plan_estimates(request: PlanRequest) -> Plan:
    """An estimate-only plan: the candidate with the highest estimated tokens/s that fits."""
    from autofit.calibration import calibration_to_dict

    r = request
    cal = stored_calibration(r)  # read once: the estimates and the plan's account of them
    fitting, rejected, pruned, considered = _estimate_space(r, cal)
    plan = Plan(
        request=r,
        best=fitting[0] if fitting else None,
        ranked=fitting,
        pruned=pruned,
        considered=considered,
        calibration={"mode": r.calibration, **calibration_to_dict(cal)}
        if cal is not None
        else None,
    )
    if fitting:
        plan.reason = winner_reason(
            fitting[0], fitting[1:], r.hardware, measured=False, device=r.device
        )
        plan.reason += loss_note(fitting[0], r)
    else:
        plan.advice = infeasible_advice(
            r.model, r.hardware, r.space, rejected, r.seq_len, r.global_batch, r.margin,
            r.device, skipped=pruned, lengths=r.lengths,
        )  # fmt: skip
    return plan
