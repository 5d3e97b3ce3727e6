"""The study between trials: what to queue next (the napkin's seeds, the calibrated best, a
fallback), re-runs of interrupted trials first, waiting for other planners, and Optuna kept
quiet."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import optuna

from autofit.plan import Candidate
from autofit.search import study as st
from autofit.search.calibrated import MIN_GAIN, Calibrator
from autofit.search.candidates import Candidates, distinct_seeds, rebuild_trials
from autofit.search.events import SearchListener
from autofit.search.objective import Objective, TrialError, enqueue

# How often a planner that has nothing left to try looks whether other planners' trials finished.
OTHERS_POLL_S = 1.0


# SQLite has no row locks, so two workers can pop the same enqueued trial (optuna issue #4621);
# the slower one's `tell` then fails although the other finished the trial. That is a lost race,
# not an error: the worker goes on with the next trial. PostgreSQL/MySQL storages lock the row.
MAX_LOST_RACES = 5


class Recalibrate:
    """After each trial: refit the calibration when a real trial finished, and queue the
    calibrated best untried candidate when nothing is queued; stop when no untried candidate may
    beat the best measured one (`Calibrator.next_candidate`)."""

    def __init__(
        self,
        cands: Candidates,
        calibrator: Calibrator,
        display: SearchListener,
        over: Callable[[optuna.Study], bool] = lambda study: False,
    ) -> None:
        self.cands, self.calibrator, self.display = cands, calibrator, display
        self.over = over  # the search is over (its budget or time spent): nothing is queued
        self.given: set[str] = set()  # queued and then not measured by this worker: not again

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if not self.calibrator.on:
            return
        self.calibrator.refresh(study)
        if self.over(study):  # a candidate queued now would wait in the study for ever
            study.stop()
            return
        if trial.user_attrs.get("enqueued") == "calibrated" and not st.finished(trial):
            # the queued candidate cost no trial (another worker had it, the sampler's params
            # named another): queueing it again would spin; the sampler proposes instead
            self.given.add(st.config_key(trial.user_attrs.get("config")))
        if study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            return
        if not enqueue_calibrated(study, self.cands, self.calibrator, self.display, self.given):
            study.stop()


def enqueue_calibrated(
    study: optuna.Study,
    cands: Candidates,
    calibrator: Calibrator,
    display: SearchListener,
    given: set[str] | None = None,
) -> bool:
    """Queue the calibrated best untried candidate (not one of `given`); False when there is
    none worth a trial."""
    measured = rebuild_trials(study, cands)
    nxt = calibrator.next_candidate(taken_configs(study) | (given or set()), measured)
    if nxt is None:
        if any(c.measured for c in measured):
            display.note(
                "no untried candidate is expected to beat the best measured one by "
                f"{MIN_GAIN:.1%} or more (calibrated estimate and its uncertainty): the search "
                "stops here"
            )
        return False
    enqueue(study, cands, nxt.config, "calibrated")
    return True


def withdraw_queued(study: optuna.Study) -> None:
    """End, as skipped, the trials this planner queued that it did not run (the napkin's seeds,
    the calibrated next, a re-run, when the budget or the time ran out first): a finished search
    leaves no trial waiting in its study (a resumed one queues what it needs again)."""
    me = st.owner()
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
        if t.user_attrs.get(st.QUEUED_BY) != me:
            continue  # another planner's: it runs or withdraws it
        with st.claimed(study, t) as trial:
            if trial is None:
                continue  # another planner took it
            trial.set_user_attr("outcome", st.SKIPPED)
            if st.RERUN_OF in t.user_attrs:  # it repeats nothing: a resumed search re-queues
                trial.set_user_attr(st.RERUN_OF, None)  # the interrupted trial (`interrupted`)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)


def wait_for_other_planners(study: optuna.Study, display: SearchListener, limit: float) -> None:
    """Wait (at most `limit` + 30 s, a trial's own limit) while other planners of the study run a
    trial, so the winner is picked from every measurement there is; a planner that died is
    failed as the objective fails it (`study.fail_orphans`)."""
    deadline = time.monotonic() + limit + 30
    said = False
    while time.monotonic() < deadline:
        st.fail_orphans(study)
        running = [
            t
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
            if t.user_attrs.get("outcome") == st.TRIAL
        ]
        if not running:
            return
        if not said:
            display.note(f"waiting for {len(running)} trial(s) other planners are running ...")
            said = True
        time.sleep(OTHERS_POLL_S)


def run_reruns(study: optuna.Study, objective: Objective) -> None:
    """Run the queued re-runs of interrupted trials now, ahead of older queued candidates (the
    ask-and-tell of `Study.ask`, on a chosen waiting trial rather than the oldest)."""
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    for t in [t for t in waiting if st.RERUN_OF in t.user_attrs]:
        with st.claimed(study, t) as trial:
            if trial is None:
                continue  # another worker took it
            try:
                value = objective(trial)
            except optuna.TrialPruned:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            except TrialError:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                continue
            except BaseException:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
        study.tell(trial, value)


def lost_race(exc: BaseException) -> bool:
    """Another planner of the study finished the trial first: Optuna's storage raises its typed
    `UpdateFinishedTrialError`; `Study.tell` on a trial no longer running raises a plain
    `ValueError("Cannot tell a <STATE> trial.")` (optuna `study/_tell.py`), its only word for it."""
    if isinstance(exc, optuna.exceptions.UpdateFinishedTrialError):
        return True
    return isinstance(exc, ValueError) and str(exc).startswith("Cannot tell a ")


def untried(study: optuna.Study, cands: Candidates) -> list[Candidate]:
    taken = taken_configs(study)
    return [c for c in cands.trialable if st.config_key(c.config) not in taken]


def taken_configs(study: optuna.Study) -> set[str]:
    """Configs measured, being measured, or waiting in the queue."""
    taken: set[str] = set()
    for t in study.get_trials(deepcopy=False):
        cfg = t.user_attrs.get("config")
        if cfg is None:
            continue
        waiting = t.state == optuna.trial.TrialState.WAITING
        running = t.state == optuna.trial.TrialState.RUNNING
        if waiting or st.finished(t) or (running and t.user_attrs.get("outcome") == st.TRIAL):
            taken.add(st.config_key(cfg))
    return taken


def enqueue_seeds(study: optuna.Study, cands: Candidates, n: int) -> None:
    """The napkin's best distinct candidates first (skipping those measured or queued)."""
    taken = taken_configs(study)
    # With pruning off the estimate's memory verdict is not trusted: seed by estimated speed.
    pool = cands.predicted_fit if cands.setting.prune and cands.predicted_fit else cands.trialable
    for cand in distinct_seeds(pool, n):
        if st.config_key(cand.config) not in taken:
            enqueue(study, cands, cand.config, "napkin")


class quiet_optuna:
    """Optuna logs every trial at INFO and failed ones with a traceback; autofit shows its own
    lines, so Optuna says only errors while a search runs."""

    def __enter__(self) -> None:
        self.level = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        self.catch = warnings.catch_warnings()
        self.catch.__enter__()
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)

    def __exit__(self, *exc: object) -> None:
        self.catch.__exit__(*exc)
        optuna.logging.set_verbosity(self.level)
