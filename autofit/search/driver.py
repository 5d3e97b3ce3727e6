"""`search`: the Optuna study that turns estimates into a measured, verified winner.

1. enumerate the space and estimate every candidate; rule out what cannot fit even if the
   estimate is off by its known error (those never cost a trial);
2. open (or resume) the study; fail the trials of planners on this host that are gone and
   re-run every interrupted trial's candidate first; enqueue the napkin's best distinct
   candidates not yet measured;
3. let TPE propose the rest, one real trial at a time, until `trials` real trials are in the
   study (all workers together) or `timeout` seconds have passed;
4. verify the fastest candidate that fit with a longer run, then write the plan, the picture
   and the YAML plan into the run folder.

Planners on one host take turns on the devices (`autofit.trials.devlock`): a trial, or a
verification, waits while another planner's runs, and a verification found done once the lock is
held is not run again.

Hardware of several nodes runs one planner per node on one shared study (`autofit.trials.cluster`):
node 0 searches as above, every launch of it spanning the nodes; the others join each launch and,
when node 0 is done, return the plan it stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna

from autofit.calibration import calibration_to_dict
from autofit.checks import TRIAL_TIMEOUT_S, check_steps, check_trial_timeout, default_run_dir
from autofit.plan import Candidate, Plan
from autofit.request import PlanRequest
from autofit.search import study as st
from autofit.search.assemble import assemble
from autofit.search.calibrated import CALIBRATION_ATTR, Calibrator, stored_prior
from autofit.search.candidates import (
    Candidates,
    Setting,
    enumerate_candidates,
    n_seeds,
    rebuild_trials,
)
from autofit.search.events import SearchListener, Silent, shown
from autofit.search.follow import follow
from autofit.search.objective import Objective, TrialError, enqueue
from autofit.search.steering import (
    MAX_LOST_RACES,
    Recalibrate,
    enqueue_calibrated,
    enqueue_seeds,
    lost_race,
    quiet_optuna,
    run_reruns,
    untried,
    wait_for_other_planners,
    withdraw_queued,
)
from autofit.search.timing import expected_search
from autofit.search.verify import ranked_under_line, verify_steps, verify_winner
from autofit.trials import run_trial as trials_run_trial
from autofit.trials.budget import trial_limit
from autofit.trials.cluster import Cluster
from autofit.trials.devlock import device_lock
from autofit.trials.result import TrialResult

# After this many proposals in a row that cost no trial (pruned, duplicate, invalid), the
# napkin's best untried candidate is enqueued so a small or mostly-pruned space still progresses.
MAX_CHEAP_STREAK = 25


def search(
    request: PlanRequest | None = None,
    *,
    listener: SearchListener | None = None,
    seed: int | None = None,
    run_trial: Callable[..., TrialResult] | None = None,
    node_rank: int = 0,
    **fields: Any,
) -> Plan:
    """Find the fastest config that fits by measuring it; see the module docstring.

    `request`: what to plan for; or its flat keyword form as `fields` (`PlanRequest.of`: model,
    hardware, space, seq_len, ..., gpu_memory: the cap trials are held to in bytes).
    `run_trial`: the function that measures a config (default `autofit.trials.run_trial`; tests
    may wrap it). `node_rank`: which node of the hardware's this planner runs on (several nodes:
    node 0 searches, the others join its trials and return its plan). `listener`: told what
    happens as it happens (`autofit.search.events`; nothing when None).
    """
    setting = Setting.from_request(request if request is not None else PlanRequest.of(**fields))
    model, hardware, budget = setting.model, setting.hardware, setting.budget
    device = setting.device
    check_steps(budget.steps)
    check_trial_timeout(budget.trial_timeout)
    if run_trial is None:
        run_trial = trials_run_trial
    if listener is None:
        listener = Silent()
    prior = stored_prior(setting)
    cands = enumerate_candidates(setting, prior)  # judged by the prior from the start
    calibrator = Calibrator(cands, prior)
    name = setting.study.name or st.default_study_name(
        model, hardware, setting.space, setting.seq_len, setting.global_batch, device,
        lengths=setting.lengths,
    )  # fmt: skip
    run_dir = setting.study.run_dir
    folder = Path(run_dir) if run_dir is not None else default_run_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    url = setting.study.storage or st.default_storage(folder)
    store = st.open_storage(url)
    sampler = optuna.samplers.TPESampler(
        seed=seed, multivariate=True, constant_liar=True, n_startup_trials=5
    )
    with quiet_optuna():
        opt_study = optuna.create_study(
            study_name=name, storage=store, direction="maximize", sampler=sampler,
            load_if_exists=True,
        )  # fmt: skip
    st.check_metadata(opt_study, setting)
    cluster = None
    if hardware.nodes > 1:
        cluster = Cluster(store, name, hardware.nodes, node_rank, launch=run_trial)
        if node_rank > 0:
            return follow(cluster, opt_study, listener, url, name)
        cluster.lead(hardware.gpus_per_node)
        run_trial = cluster.run_trial
    try:
        plan = _lead(setting, cands, calibrator, opt_study, run_trial, listener, name, url,
                     folder, cluster)  # fmt: skip
    except BaseException as exc:
        if cluster is not None:
            cluster.finish(str(exc) or type(exc).__name__)
        raise
    if cluster is not None:
        cluster.finish()
    return plan


def _lead(
    setting: Setting,
    cands: Candidates,
    calibrator: Calibrator,
    opt_study: optuna.Study,
    run_trial: Callable[..., TrialResult],
    display: SearchListener,
    name: str,
    url: str,
    folder: Path,
    cluster: Cluster | None,
) -> Plan:
    """The search of one node, or of node 0 of several (see the module docstring)."""
    model, hardware, budget = setting.model, setting.hardware, setting.budget
    trials, timeout, device = budget.trials, budget.timeout, setting.device
    calibrator.refresh(opt_study)  # a resumed study: its finished trials calibrate at once

    finished = [t for t in st.real_trials(opt_study) if st.finished(t)]
    display.intro(setting, cands, name, url, folder, len(finished))
    if cluster is not None:
        display.note(
            f"node 0 of {cluster.nodes}: it chooses every trial, which spans the "
            f"{cluster.nodes} nodes (the other nodes' planners join it)"
        )

    hooks: dict[str, Any] = {"on_progress": display.trial_progress, "on_wait": display.waiting}
    if setting.lengths is not None:  # trials draw their micro-batches from the data's lengths
        hooks["lengths"] = setting.lengths

    def measure(cand: Candidate, n_steps: int) -> TrialResult:
        limit = trial_limit(cands.trial_time(cand, n_steps), budget.trial_timeout)
        return run_trial(
            model, cand.config, nprocs=hardware.n_gpus, device=device,
            gpu_memory=budget.gpu_memory, steps=n_steps, timeout_s=limit, **hooks,
        )  # fmt: skip

    if cands.trialable and len(finished) < trials:
        display.note(
            expected_search(cands, trials, budget.steps, timeout, len(finished)).sentence()
        )

    with shown(display, trials, min(len(finished), trials), setting.allowed_bytes):
        if cands.trialable and len(finished) < trials:
            objective = Objective(
                cands, budget, run_trial,
                on_result=lambda t, c, r: display.finished(t.number, c, r),
                on_start=display.started, trial_kwargs=hooks, calibrator=calibrator,
            )  # fmt: skip
            again = objective.requeue(opt_study)
            if again:
                display.note(
                    f"re-running {len(again)} interrupted trial(s) first: "
                    + ", ".join(f"#{t.number}" for t in again)
                )
            worth_a_trial = True
            if calibrator.on:  # a study that stopped as nothing may gain stays stopped
                worth_a_trial = bool(again) or enqueue_calibrated(
                    opt_study, cands, calibrator, display
                )
            else:
                enqueue_seeds(opt_study, cands, n_seeds(trials))
            start = time.monotonic()
            stopper = _Stopper(cands, objective, trials, start, timeout)
            with quiet_optuna():
                run_reruns(opt_study, objective)
                for _ in range(MAX_LOST_RACES + 1 if worth_a_trial else 0):
                    left = None if timeout is None else timeout - (time.monotonic() - start)
                    if left is not None and left <= 0:
                        break
                    try:
                        opt_study.optimize(
                            objective,
                            timeout=left,
                            catch=(TrialError,),
                            callbacks=[
                                stopper,
                                Recalibrate(cands, calibrator, display, over=stopper.over),
                                *([cluster.stop_if_failed] if cluster else []),
                            ],
                            gc_after_trial=False,
                        )
                        break
                    except (ValueError, RuntimeError) as exc:
                        if not lost_race(exc):
                            raise
                withdraw_queued(opt_study)  # what it queued and did not run: none left waiting
            if cluster is not None:
                cluster.raise_if_failed()

        if calibrator.on:
            # this planner stopped as nothing it may try may gain: what other planners of the
            # study measure now may (their trials teach the calibration as well)
            wait_for_other_planners(opt_study, display, budget.trial_timeout or TRIAL_TIMEOUT_S)
            calibrator.refresh(opt_study)
            opt_study.set_user_attr(CALIBRATION_ATTR, calibration_to_dict(cands.calibration))
        trial_cands = rebuild_trials(opt_study, cands)
        ranked = ranked_under_line(setting, trial_cands)
        n_verify = verify_steps(budget.steps)

        def run_verification(cand: Candidate) -> TrialResult:
            display.verifying(cand, n_verify)
            return measure(cand, n_verify)

        best = verify_winner(
            opt_study, setting, ranked, run_verification, n_verify, display.verified,
            hold=lambda: device_lock(device, hardware.gpus_per_node, display.waiting),
        )  # fmt: skip
    plan = assemble(setting, cands, opt_study, trial_cands, best, url, folder,
                    limits=(trials, timeout, budget.trial_timeout))  # fmt: skip
    try:
        stored = calibrator.store(opt_study)
    except OSError as exc:  # a full disk: the plan stands without this machine's store updated
        stored = None
        display.note(f"this machine's calibration could not be stored ({exc.strerror or exc})")
    if stored is not None and plan.calibration is not None:
        path, kept = stored
        plan.calibration["stored"] = {"path": str(path), "n_trials": kept.n_trials}
        display.note(
            f"this machine's calibration now holds {kept.n_trials} measured trial(s): "
            f"{path} (the next plan here starts from it; --no-calibration ignores it)"
        )
    return plan


class _Stopper:
    """Stops the study when the budget is spent, the time is up, or nothing is left to try."""

    def __init__(
        self, cands: Candidates, objective: Objective, trials: int, start: float, timeout: Any
    ) -> None:
        self.cands, self.objective, self.trials = cands, objective, trials
        self.start, self.timeout = start, timeout

    def over(self, study: optuna.Study) -> bool:
        """The trial budget is spent or the search's time is up: no trial starts after this."""
        real = st.real_trials(study)
        if len([t for t in real if st.finished(t)]) >= self.trials:
            return True
        return self.timeout is not None and time.monotonic() - self.start >= self.timeout

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if self.over(study):
            study.stop()
            return
        if self.objective.cheap_streak >= MAX_CHEAP_STREAK:
            self.objective.cheap_streak = 0
            left = untried(study, self.cands)
            if not left:
                study.stop()  # every candidate that may fit has been measured
                return
            enqueue(study, self.cands, left[0].config, "fallback")
