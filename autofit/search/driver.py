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
from dataclasses import dataclass, field
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
from autofit.trials.budget import measured_context, trial_limit
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
        lead = _Lead(setting, cands, calibrator, opt_study, run_trial, listener,
                     (name, url, folder), cluster)  # fmt: skip
        plan = lead.run()
    except BaseException as exc:
        if cluster is not None:
            cluster.finish(str(exc) or type(exc).__name__)
        raise
    if cluster is not None:
        cluster.finish()
    return plan


@dataclass
class _Lead:
    """The search of one node, or of node 0 of several (see the module docstring), as the steps
    it takes: say what it will do, run the trials, verify the winner, assemble the plan and keep
    this machine's calibration."""

    setting: Setting
    cands: Candidates
    calibrator: Calibrator
    study: optuna.Study
    run_trial: Callable[..., TrialResult]
    display: SearchListener
    where: tuple[str, str, Path]  # the study's name, its storage URL, the run folder
    cluster: Cluster | None = None
    hooks: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        display = self.display
        self.hooks = {"on_progress": display.trial_progress, "on_wait": display.waiting}
        if self.setting.lengths is not None:  # trials draw micro-batches from the data's lengths
            self.hooks["lengths"] = self.setting.lengths

    def run(self) -> Plan:
        setting, budget = self.setting, self.setting.budget
        self.calibrator.refresh(self.study)  # a resumed study: its finished trials calibrate
        finished = len([t for t in st.real_trials(self.study) if st.finished(t)])
        self.intro(finished)
        with shown(self.display, budget.trials, min(finished, budget.trials),
                   setting.allowed_bytes):  # fmt: skip
            if self.cands.trialable and finished < budget.trials:
                self.trials()
            if self.calibrator.on:
                self.join_other_planners()
            trial_cands = rebuild_trials(self.study, self.cands)
            best = self.verify(ranked_under_line(setting, trial_cands))
        name, url, folder = self.where
        plan = assemble(setting, self.cands, self.study, trial_cands, best, url, folder,
                        limits=(budget.trials, budget.timeout, budget.trial_timeout))  # fmt: skip
        self.store_calibration(plan)
        return plan

    def intro(self, finished: int) -> None:
        budget, cands, display = self.setting.budget, self.cands, self.display
        display.intro(self.setting, cands, *self.where, finished)
        if self.cluster is not None:
            nodes = self.cluster.nodes
            display.note(
                f"node 0 of {nodes}: it chooses every trial, which spans the {nodes} nodes (the "
                "other nodes' planners join it)"
            )
        if cands.trialable and finished < budget.trials:
            expected = expected_search(cands, budget.trials, budget.steps, budget.timeout, finished)
            display.note(expected.sentence())

    def trials(self) -> None:
        """The study's trials: re-runs of interrupted ones first, then what the calibrated search
        (or the seeds) queue, until the budget, the time or what may gain is spent."""
        cands, calibrator, display, study = self.cands, self.calibrator, self.display, self.study
        budget = self.setting.budget
        objective = Objective(
            cands, budget, self.run_trial,
            on_result=lambda t, c, r: display.finished(t.number, c, r),
            on_start=display.started, trial_kwargs=self.hooks, calibrator=calibrator,
        )  # fmt: skip
        again = objective.requeue(study)
        if again:
            display.note(
                f"re-running {len(again)} interrupted trial(s) first: "
                + ", ".join(f"#{t.number}" for t in again)
            )
        worth_a_trial = True
        if calibrator.on:  # a study that stopped as nothing may gain stays stopped
            worth_a_trial = bool(again) or enqueue_calibrated(study, cands, calibrator, display)
        else:
            enqueue_seeds(study, cands, n_seeds(budget.trials))
        stopper = _Stopper(cands, objective, budget.trials, time.monotonic(), budget.timeout)
        with quiet_optuna():
            run_reruns(study, objective)
            if worth_a_trial:
                self.optimize(objective, stopper)
            withdraw_queued(study)  # what it queued and did not run: none left waiting
        if self.cluster is not None:
            self.cluster.raise_if_failed()

    def optimize(self, objective: Objective, stopper: _Stopper) -> None:
        """Optuna's loop, started again where another planner of the study won a race for a
        trial (`lost_race`), at most `MAX_LOST_RACES` times, within the search's time."""
        timeout = self.setting.budget.timeout
        for _ in range(MAX_LOST_RACES + 1):
            left = None if timeout is None else timeout - (time.monotonic() - stopper.start)
            if left is not None and left <= 0:
                return
            try:
                self.study.optimize(
                    objective,
                    timeout=left,
                    catch=(TrialError,),
                    callbacks=[
                        stopper,
                        Recalibrate(self.cands, self.calibrator, self.display, over=stopper.over),
                        *([self.cluster.stop_if_failed] if self.cluster else []),
                    ],
                    gc_after_trial=False,
                )
                return
            except (ValueError, RuntimeError) as exc:
                if not lost_race(exc):
                    raise

    def join_other_planners(self) -> None:
        """This planner stopped as nothing it may try may gain: what other planners of the study
        measure now may (their trials teach the calibration as well)."""
        timeout = self.setting.budget.trial_timeout or TRIAL_TIMEOUT_S
        wait_for_other_planners(self.study, self.display, timeout)
        self.calibrator.refresh(self.study)
        self.study.set_user_attr(CALIBRATION_ATTR, calibration_to_dict(self.cands.calibration))

    def verify(self, ranked: list[Candidate]) -> Candidate | None:
        setting, display = self.setting, self.display
        budget, hardware = setting.budget, setting.hardware
        n_verify = verify_steps(budget.steps)

        def run_verification(cand: Candidate) -> TrialResult:
            display.verifying(cand, n_verify)
            limit = trial_limit(self.cands.trial_time(cand, n_verify), budget.trial_timeout)
            return self.run_trial(
                setting.model, cand.config, nprocs=hardware.n_gpus, device=setting.device,
                gpu_memory=budget.gpu_memory, steps=n_verify, timeout_s=limit,
                **measured_context(hardware), **self.hooks,
            )  # fmt: skip

        return verify_winner(
            self.study, setting, ranked, run_verification, n_verify, display.verified,
            hold=lambda: device_lock(setting.device, hardware.gpus_per_node, display.waiting),
        )  # fmt: skip

    def store_calibration(self, plan: Plan) -> None:
        try:
            stored = self.calibrator.store(self.study)
        except OSError as exc:  # a full disk: the plan stands without this machine's store
            self.display.note(
                f"this machine's calibration could not be stored ({exc.strerror or exc})"
            )
            return
        if stored is not None and plan.calibration is not None:
            path, kept = stored
            plan.calibration["stored"] = {"path": str(path), "n_trials": kept.n_trials}
            self.display.note(
                f"this machine's calibration now holds {kept.n_trials} measured trial(s): "
                f"{path} (the next plan here starts from it; --no-calibration ignores it)"
            )


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
