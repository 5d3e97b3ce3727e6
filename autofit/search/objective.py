"""The objective: one Optuna trial = one candidate, measured only when that can teach something.

The sampler proposes knob values; the objective maps them to a candidate and
- records it at no cost when it breaks a rule (`invalid`), the estimate rules it out (`pruned`,
  infeasible by the estimated overshoot) or a finished trial already measured it (`duplicate`,
  with that trial's value and constraint);
- otherwise runs the real trial and reports measured tokens/s (0 for oom or timeout) with the
  constraint `memory` = measured peak / headroom line - 1, so an OOM is a completed, infeasible
  trial that the sampler learns from (Optuna's `Trial.set_constraint`).

Every trial names its owner (host and process) first. Before each proposal the objective fails
the running trials of owners on this host that are gone and queues their candidates again
(`requeue`), so a killed planner's trial costs nothing but its own time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import optuna

from autofit.config import Config
from autofit.errors import AutofitError
from autofit.plan import Candidate, Outcome
from autofit.request import SearchBudget
from autofit.search import study as st
from autofit.search.calibrated import Calibrator
from autofit.search.candidates import Candidates
from autofit.trials.budget import TrialTime, measured_context, trial_limit
from autofit.trials.result import TrialResult

MEMORY = "memory"  # the constraint's name
# A worker whose proposal another worker is measuring waits this long before the next proposal.
BUSY_BACKOFF_S = 1.0


class TrialError(Exception):
    """A trial that failed for a reason other than memory (recorded as a FAIL trial)."""


def estimate_attrs(cand: Candidate) -> dict[str, Any]:
    e = cand.estimate
    return {
        "peak_bytes": e.peak_bytes,
        "peak_allocated_bytes": e.peak_allocated_bytes,
        "usable_bytes": e.usable_bytes,
        "tokens_per_s": e.tokens_per_s,
        "step_time_s": e.step_time_s,
    }


def timing_attrs(timing: TrialTime, limit: float) -> dict[str, float]:
    """A trial's budget as it records it (user attr `timing`): expected seconds, its limit and
    its slow mark."""
    return {"expected_s": timing.expected_s, "limit_s": limit, "slow_after_s": timing.slow_after_s}


def enqueue(study: optuna.Study, cands: Candidates, cfg: Config, why: str, **attrs: Any) -> None:
    """Queue `cfg` as the study's next fixed trial; `why` (user attr `enqueued`) says who asked,
    `st.QUEUED_BY` which planner (what it has not run when it ends, it withdraws:
    `steering.withdraw_queued`)."""
    attrs = {"config": cfg.to_dict(), "enqueued": why, st.QUEUED_BY: st.owner(), **attrs}
    study.enqueue_trial(cands.params(cfg), user_attrs=attrs)


def memory_constraint(cands: Candidates, cand: Candidate, result: TrialResult) -> float:
    """> 0: over the headroom line (infeasible). An OOM's peak is unknown: at least capacity."""
    allowed = cands.setting.allowed_bytes
    if result.measured and result.peak_bytes is not None:
        return result.peak_bytes / allowed - 1
    if result.status == Outcome.OOM:
        over = max(cand.estimate.peak_bytes, cands.setting.hardware.capacity_bytes)
        return max(over / allowed - 1, 1e-3)
    return 0.0


class Objective:
    def __init__(
        self,
        cands: Candidates,
        budget: SearchBudget,
        run_trial: Callable[..., TrialResult],
        on_result: Callable[[optuna.Trial, Candidate, TrialResult], None] | None = None,
        on_start: Callable[[Candidate, TrialTime], None] | None = None,
        trial_kwargs: dict[str, Any] | None = None,
        calibrator: Calibrator | None = None,
    ) -> None:
        self.cands = cands
        self.budget = budget
        self.run_trial = run_trial
        self.on_result = on_result
        self.on_start = on_start
        self.trial_kwargs = trial_kwargs or {}  # e.g. on_progress, on_wait for run_trial
        self.cheap_streak = 0  # proposals in a row that cost no trial
        self.owner = st.owner()
        self.calibrator = calibrator

    def requeue(self, study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
        """Fail the running trials whose owner on this host is gone, and queue every interrupted
        trial's candidate again (once); return the interrupted trials queued."""
        st.fail_orphans(study)
        again = st.interrupted(study)
        for t in again:
            cfg = Config.from_dict(t.user_attrs["config"])
            enqueue(study, self.cands, cfg, "rerun", **{st.RERUN_OF: t.number})
        return again

    def __call__(self, trial: optuna.Trial) -> float:
        trial.set_user_attr(st.OWNER, self.owner)
        self.requeue(trial.study)
        params = {n: trial.suggest_categorical(n, d.choices)
                  for n, d in self.cands.distributions.items()}  # fmt: skip
        cfg = self.cands.config(params)
        if cfg is None:
            return self._cheap(trial, st.INVALID, 1.0, 0.0)
        cand = self.cands.all[cfg]
        trial.set_user_attr("config", cfg.to_dict())
        trial.set_user_attr("label", cfg.short())
        trial.set_user_attr("estimate", estimate_attrs(cand))
        reason = self.cands.pruned.get(cfg)
        if reason is not None:
            trial.set_user_attr("reason", reason.value)
            return self._cheap(trial, st.PRUNED, max(self.cands.overshoot(cand), 1e-3), 0.0)
        # Claim the config before looking for others measuring it: two workers that propose the
        # same config at once then both see each other's claim and at most one measures it (at
        # worst both step back and a later proposal measures it), never both.
        trial.set_user_attr("outcome", st.TRIAL)
        same = self._same_config(trial, cfg)
        done = [t for t in same if st.finished(t)]
        if done:
            first = done[0]
            trial.set_user_attr("duplicate_of", first.number)
            value = first.value if first.value is not None else 0.0
            return self._cheap(trial, st.DUPLICATE, first.constraints.get(MEMORY, 0.0), value)
        if any(t.state == optuna.trial.TrialState.RUNNING for t in same):
            self.cheap_streak += 1
            trial.set_user_attr("outcome", st.BUSY)
            time.sleep(BUSY_BACKOFF_S)  # do not spin on a space other workers have taken
            raise optuna.TrialPruned("another worker is measuring this config")
        if st.spent(trial.study) > self.budget.trials:
            self.cheap_streak += 1
            trial.set_user_attr("outcome", st.SKIPPED)
            trial.study.stop()
            raise optuna.TrialPruned("the trial budget is spent")
        return self._measure(trial, cand)

    def _measure(self, trial: optuna.Trial, cand: Candidate) -> float:
        self.cheap_streak = 0
        s = self.cands.setting
        if self.calibrator is not None:
            self.calibrator.record(trial, cand.config)
        # held to its own estimate: a limit from its expected time, a slow mark from its step
        timing = self.cands.trial_time(cand, self.budget.steps)
        limit = trial_limit(timing, self.budget.trial_timeout)
        trial.set_user_attr(st.TIMING, timing_attrs(timing, limit))
        if self.on_start:
            self.on_start(cand, timing)
        try:
            result = self.run_trial(
                s.model, cand.config, nprocs=s.hardware.n_gpus, device=s.device,
                gpu_memory=self.budget.gpu_memory, steps=self.budget.steps, timeout_s=limit,
                slow_after_s=timing.slow_after_s, **measured_context(s.hardware),
                **self.trial_kwargs,
            )  # fmt: skip
        except AutofitError as exc:  # it could not run (a node of it was lost): FAIL, no result
            trial.set_user_attr(st.STOPPED, str(exc))
            raise
        trial.set_user_attr("result", result.to_dict())
        if self.on_result:
            self.on_result(trial, cand, result)
        if result.status == Outcome.ERROR:
            raise TrialError(result.message.splitlines()[0] if result.message else "error")
        trial.set_constraint(MEMORY, memory_constraint(self.cands, cand, result))
        if result.measured and result.tokens_per_s:
            return float(result.tokens_per_s)
        return 0.0  # oom, timeout: nothing measured, the worst value

    def _cheap(self, trial: optuna.Trial, outcome: str, constraint: float, value: float) -> float:
        self.cheap_streak += 1
        trial.set_user_attr("outcome", outcome)
        trial.set_constraint(MEMORY, float(constraint))
        return float(value)

    def _same_config(self, trial: optuna.Trial, cfg: Config) -> list[optuna.trial.FrozenTrial]:
        want = cfg.to_dict()
        return [
            t
            for t in st.real_trials(trial.study)
            if t.number != trial.number and t.user_attrs.get("config") == want
        ]
