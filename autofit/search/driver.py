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

import contextlib
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from rich.markup import escape

from autofit.calibration import Calibration
from autofit.checks import check_steps, check_trial_timeout, default_run_dir
from autofit.errors import AutofitError
from autofit.plan import (
    Candidate,
    Outcome,
    Plan,
    infeasible_advice,
    loss_note,
    trial_status,
    winner_reason,
)
from autofit.report.live import SearchDisplay
from autofit.request import PlanRequest
from autofit.search import study as st
from autofit.search.calibrated import (
    CALIBRATION_ATTR,
    MIN_GAIN,
    Calibrator,
    stored_prior,
    summary,
)
from autofit.search.candidates import (
    Candidates,
    Setting,
    distinct_seeds,
    enumerate_candidates,
    n_seeds,
    rebuild_trials,
)
from autofit.search.objective import Objective, TrialError, enqueue
from autofit.search.verify import (
    ranked_under_line,
    stored_verification,
    under_line,
    verify_steps,
    verify_winner,
)
from autofit.trials import run_trial as trials_run_trial
from autofit.trials.cluster import Cluster
from autofit.trials.devlock import device_lock
from autofit.trials.result import TrialResult
from autofit.units import fmt_size

# After this many proposals in a row that cost no trial (pruned, duplicate, invalid), the
# napkin's best untried candidate is enqueued so a small or mostly-pruned space still progresses.
MAX_CHEAP_STREAK = 25
# How often a planner that has nothing left to try looks whether other planners' trials finished.
OTHERS_POLL_S = 1.0


def search(
    request: PlanRequest | None = None,
    *,
    console: Any = None,
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
    node 0 searches, the others join its trials and return its plan).
    """
    setting = Setting.from_request(request if request is not None else PlanRequest.of(**fields))
    model, hardware, budget = setting.model, setting.hardware, setting.budget
    device = setting.device
    check_steps(budget.steps)
    check_trial_timeout(budget.trial_timeout)
    if run_trial is None:
        run_trial = trials_run_trial
    prior = stored_prior(setting)
    cands = enumerate_candidates(setting, prior)  # judged by the prior from the start
    calibrator = Calibrator(cands, prior)
    name = setting.study.name or st.default_study_name(
        model, hardware, setting.space, setting.seq_len, setting.global_batch, device
    )
    run_dir = setting.study.run_dir
    folder = Path(run_dir) if run_dir is not None else default_run_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    url = setting.study.storage or st.default_storage(folder)
    store = st.open_storage(url)
    sampler = optuna.samplers.TPESampler(
        seed=seed, multivariate=True, constant_liar=True, n_startup_trials=5
    )
    with _quiet_optuna():
        opt_study = optuna.create_study(
            study_name=name, storage=store, direction="maximize", sampler=sampler,
            load_if_exists=True,
        )  # fmt: skip
    st.check_metadata(opt_study, setting)
    cluster = None
    if hardware.nodes > 1:
        cluster = Cluster(store, name, hardware.nodes, node_rank, launch=run_trial)
        if node_rank > 0:
            return _follow(cluster, opt_study, console, url, name)
        cluster.lead(hardware.gpus_per_node)
        run_trial = cluster.run_trial
    try:
        plan = _lead(setting, cands, calibrator, opt_study, run_trial, console, name, url,
                     folder, cluster)  # fmt: skip
    except BaseException as exc:
        if cluster is not None:
            cluster.finish(str(exc) or type(exc).__name__)
        raise
    if cluster is not None:
        cluster.finish()
    return plan


def _follow(cluster: Cluster, study: optuna.Study, console: Any, url: str, name: str) -> Plan:
    """A node >0: run this node's part of node 0's every launch, then its plan from the study."""
    display = SearchDisplay(console, 0, 0, 0)

    def part(seq: int, result: TrialResult) -> None:
        head = (result.message or "").strip().splitlines()[:1]
        display.say(f"node {cluster.node_rank}: launch {seq} of node 0 ended {result.status}"
                    + (f" ({escape(head[0])})" if head and not result.ok else ""))  # fmt: skip

    cluster.say = display.say
    with display:
        cluster.follow(part, lambda process: _fail_trials_of(study, process))
        display.say(f"node 0's search is done; its plan, from study {escape(name)}:")
    return load_study_plan(url, name)


def _fail_trials_of(study: optuna.Study, process: str | None) -> list[int]:
    """Mark FAIL the running trials the planner `process` (`guard.identity()`) owned: their
    candidates run again when every planner is started again. Returns their numbers."""
    storage = study._storage  # noqa: SLF001 - the compare-and-set that Study.ask uses
    failed = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if process is None or (t.user_attrs.get(st.OWNER) or {}).get("process") != process:
            continue
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            if storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL):
                failed.append(t.number)
    return failed


def _lead(
    setting: Setting,
    cands: Candidates,
    calibrator: Calibrator,
    opt_study: optuna.Study,
    run_trial: Callable[..., TrialResult],
    console: Any,
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
    display = SearchDisplay(console, trials, min(len(finished), trials), setting.allowed_bytes)
    if console is not None:
        _intro(display, setting, cands, name, url, folder, len(finished))
        if cluster is not None:
            display.say(
                f"node 0 of {cluster.nodes}: it chooses every trial, which spans the "
                f"{cluster.nodes} nodes (the other nodes' planners join it)"
            )

    hooks = {"on_progress": display.trial_progress, "on_wait": display.waiting}

    def measure(cand: Candidate, n_steps: int) -> TrialResult:
        return run_trial(
            model, cand.config, nprocs=hardware.n_gpus, device=device,
            gpu_memory=budget.gpu_memory, steps=n_steps, timeout_s=budget.trial_timeout, **hooks,
        )  # fmt: skip

    with display:
        if cands.trialable and len(finished) < trials:
            objective = Objective(
                cands, budget, run_trial,
                on_result=lambda t, c, r: display.finished(t.number, c, r),
                on_start=display.started, trial_kwargs=hooks, calibrator=calibrator,
            )  # fmt: skip
            again = objective.requeue(opt_study)
            if again:
                display.say(
                    f"re-running {len(again)} interrupted trial(s) first: "
                    + ", ".join(f"#{t.number}" for t in again)
                )
            worth_a_trial = True
            if calibrator.on:  # a study that stopped as nothing may gain stays stopped
                worth_a_trial = bool(again) or _enqueue_calibrated(
                    opt_study, cands, calibrator, display
                )
            else:
                _enqueue_seeds(opt_study, cands, n_seeds(trials))
            start = time.monotonic()
            with _quiet_optuna():
                _run_reruns(opt_study, objective)
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
                                _Stopper(cands, objective, trials, start, timeout),
                                _Recalibrate(cands, calibrator, display),
                                *([cluster.stop_if_failed] if cluster else []),
                            ],
                            gc_after_trial=False,
                        )
                        break
                    except (ValueError, RuntimeError) as exc:
                        if not _lost_race(exc):
                            raise
            if cluster is not None:
                cluster.raise_if_failed()

        if calibrator.on:
            # this planner stopped as nothing it may try may gain: what other planners of the
            # study measure now may (their trials teach the calibration as well)
            _wait_for_other_planners(opt_study, display, budget.trial_timeout)
            calibrator.refresh(opt_study)
            opt_study.set_user_attr(CALIBRATION_ATTR, cands.calibration.to_dict())
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
    stored = calibrator.store(opt_study)
    if stored is not None and plan.calibration is not None:
        path, kept = stored
        plan.calibration["stored"] = {"path": str(path), "n_trials": kept.n_trials}
        if console is not None:
            display.say(
                f"this machine's calibration now holds {kept.n_trials} measured trial(s): "
                f"{escape(str(path))} (the next plan here starts from it; --no-calibration "
                "ignores it)"
            )
    return plan


# SQLite has no row locks, so two workers can pop the same enqueued trial (optuna issue #4621);
# the slower one's `tell` then fails although the other finished the trial. That is a lost race,
# not an error: the worker goes on with the next trial. PostgreSQL/MySQL storages lock the row.
MAX_LOST_RACES = 5


class _Recalibrate:
    """After each trial: refit the calibration when a real trial finished, and queue the
    calibrated best untried candidate when nothing is queued; stop when no untried candidate may
    beat the best measured one (`Calibrator.next_candidate`)."""

    def __init__(self, cands: Candidates, calibrator: Calibrator, display: SearchDisplay) -> None:
        self.cands, self.calibrator, self.display = cands, calibrator, display
        self.given: set[str] = set()  # queued and then not measured by this worker: not again

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if not self.calibrator.on:
            return
        self.calibrator.refresh(study)
        if trial.user_attrs.get("enqueued") == "calibrated" and not st.finished(trial):
            # the queued candidate cost no trial (another worker had it, the sampler's params
            # named another): queueing it again would spin; the sampler proposes instead
            self.given.add(st.config_key(trial.user_attrs.get("config")))
        if study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            return
        if not _enqueue_calibrated(study, self.cands, self.calibrator, self.display, self.given):
            study.stop()


def _enqueue_calibrated(
    study: optuna.Study,
    cands: Candidates,
    calibrator: Calibrator,
    display: SearchDisplay,
    given: set[str] | None = None,
) -> bool:
    """Queue the calibrated best untried candidate (not one of `given`); False when there is
    none worth a trial."""
    measured = rebuild_trials(study, cands)
    nxt = calibrator.next_candidate(_taken_configs(study) | (given or set()), measured)
    if nxt is None:
        if any(c.measured for c in measured):
            display.say(
                "no untried candidate is expected to beat the best measured one by "
                f"{MIN_GAIN:.1%} or more (calibrated estimate and its uncertainty): the search "
                "stops here"
            )
        return False
    enqueue(study, cands, nxt.config, "calibrated")
    return True


def _wait_for_other_planners(study: optuna.Study, display: SearchDisplay, limit: float) -> None:
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
            display.say(f"waiting for {len(running)} trial(s) other planners are running ...")
            said = True
        time.sleep(OTHERS_POLL_S)


def _run_reruns(study: optuna.Study, objective: Objective) -> None:
    """Run the queued re-runs of interrupted trials now, ahead of older queued candidates (the
    ask-and-tell of `Study.ask`, on a chosen waiting trial rather than the oldest)."""
    storage = study._storage  # noqa: SLF001 - the compare-and-set that Study.ask uses
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    for t in [t for t in waiting if st.RERUN_OF in t.user_attrs]:
        try:
            if not storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.RUNNING):
                continue  # another worker took it
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        trial = optuna.Trial(study, t._trial_id)
        with st.heartbeat(storage, t._trial_id):
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


def _lost_race(exc: BaseException) -> bool:
    text = str(exc)
    return "Cannot tell a" in text or "has already finished and can not be updated" in text


class _Stopper:
    """Stops the study when the budget is spent, the time is up, or nothing is left to try."""

    def __init__(
        self, cands: Candidates, objective: Objective, trials: int, start: float, timeout: Any
    ) -> None:
        self.cands, self.objective, self.trials = cands, objective, trials
        self.start, self.timeout = start, timeout

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        real = st.real_trials(study)
        if len([t for t in real if st.finished(t)]) >= self.trials:
            study.stop()
            return
        if self.timeout is not None and time.monotonic() - self.start >= self.timeout:
            study.stop()
            return
        if self.objective.cheap_streak >= MAX_CHEAP_STREAK:
            self.objective.cheap_streak = 0
            untried = _untried(study, self.cands)
            if not untried:
                study.stop()  # every candidate that may fit has been measured
                return
            enqueue(study, self.cands, untried[0].config, "fallback")


def _untried(study: optuna.Study, cands: Candidates) -> list[Candidate]:
    taken = _taken_configs(study)
    return [c for c in cands.trialable if st.config_key(c.config) not in taken]


def _taken_configs(study: optuna.Study) -> set[str]:
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


def _enqueue_seeds(study: optuna.Study, cands: Candidates, n: int) -> None:
    """The napkin's best distinct candidates first (skipping those measured or queued)."""
    taken = _taken_configs(study)
    # With pruning off the estimate's memory verdict is not trusted: seed by estimated speed.
    pool = cands.predicted_fit if cands.setting.prune and cands.predicted_fit else cands.trialable
    for cand in distinct_seeds(pool, n):
        if st.config_key(cand.config) not in taken:
            enqueue(study, cands, cand.config, "napkin")


def assemble(
    setting: Setting,
    cands: Candidates,
    study: optuna.Study,
    trial_cands: list[Candidate],
    best: Candidate | None,
    storage: str,
    folder: Path | None,
    limits: tuple[int | None, float | None, float | None] = (None, None, None),
) -> Plan:
    """The plan of a study. `limits`: (--trials, --search-timeout, --trial-timeout) of the run
    that made it, named in the advice when nothing fits (None: not known, e.g. on export)."""
    s = setting
    ranked = ranked_under_line(s, trial_cands)
    if best is not None:
        ranked = [best] + [c for c in ranked if c.config != best.config]
    plan = Plan(
        request=s, best=best,
        ranked=ranked, trials=trial_cands, pruned=cands.counts, considered=cands.considered,
        storage=storage, study_name=study.study_name,
        run_dir=str(folder) if folder is not None else None,
        calibration=summary(cands, trial_cands),
    )  # fmt: skip
    if best is not None:
        plan.reason = winner_reason(best, ranked[1:], s.hardware, measured=True)
        plan.reason += loss_note(best, s)
        check = stored_verification(study, best)
        if check:
            speed = check.get("tokens_per_s") or 0
            plan.reason += (
                f" Verified by a {check.get('steps', '?')}-step re-run: peak "
                f"{fmt_size(check.get('peak_bytes'))}, {speed:,.0f} tokens/s."
            )
    else:
        trials, timeout, trial_timeout = limits
        plan.advice = no_winner_advice(s, cands, trial_cands, trials=trials, timeout=timeout,
                                       trial_timeout=trial_timeout)  # fmt: skip
    return plan


def no_winner_advice(
    s: Setting,
    cands: Candidates,
    trial_cands: list[Candidate],
    *,
    trials: int | None = None,
    timeout: float | None = None,
    trial_timeout: float | None = None,
) -> str:
    """Nothing measured fits: say what happened and what to change. Every candidate ruled out
    before a trial: what bound and what would help (`infeasible_advice`); no trial finished: the
    search time limit; trials timed out: --trial-timeout and its value; trials failed: the first
    error; trials ran out of memory or crossed the line: the nearest one; candidates left untried:
    the budget or time that ran out."""
    if not cands.trialable and not trial_cands:
        return _infeasible(s, cands, list(cands.all.values()))
    may_fit = len(cands.trialable)
    if not trial_cands:
        if timeout is not None:
            each = (
                f" (each may take up to --trial-timeout {trial_timeout:g} s)"
                if trial_timeout
                else ""
            )
            return (
                f"No trial ran within the search time limit (--search-timeout {timeout:g} s), so "
                f"none of the {may_fit:,} candidate(s) that may fit was measured. Raise "
                f"--search-timeout to leave time for at least one trial{each}, or leave it unset."
            )
        return (
            f"No trial has finished yet, so none of the {may_fit:,} candidate(s) that may fit was "
            "measured: run the same command again to measure them (finished trials are kept)."
        )
    latest = list({c.config: c for c in trial_cands}.values())
    outcome = {id(c): trial_status(c.trial, s.allowed_bytes) for c in latest}
    by_status: dict[str, int] = {}
    for c in latest:
        by_status[outcome[id(c)]] = by_status.get(outcome[id(c)], 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(by_status.items()))
    line = fmt_size(s.allowed_bytes)
    ran = f"{len(latest)} trial{'s' if len(latest) != 1 else ''} ran"
    lines = [f"{ran} ({summary}); none finished under the {line} headroom line."]
    timeouts = [c for c in latest if c.trial.status == Outcome.TIMEOUT]
    if timeouts:
        limit = trial_timeout or max(c.trial.wall_s for c in timeouts)
        lines.append(
            f"{len(timeouts)} timed out at the per-trial limit of {limit:g} s: raise "
            f"--trial-timeout (e.g. --trial-timeout {2 * limit:g}); a trial also builds the "
            "model and warms up before its measured steps."
        )
    errors = [c for c in latest if c.trial.status == Outcome.ERROR]
    if errors:
        first = errors[0]
        text = (first.trial.message or "").strip()
        msg = text.splitlines()[0][:200] if text else "(no message)"
        lines.append(
            f"{len(errors)} failed with an error; the first ('{first.config.short()}'): {msg} "
            "Fix that, or run the config alone with `autofit trial` to see its whole output."
        )
    memory = [c for c in latest if outcome[id(c)] in (Outcome.OOM, Outcome.OVER_LINE)]
    over = [c for c in latest if outcome[id(c)] == Outcome.OVER_LINE]
    if over:
        near = min(over, key=lambda c: c.trial.peak_bytes or 0)
        lines.append(
            f"Nearest measured: '{near.config.short()}' peaked at "
            f"{fmt_size(near.trial.peak_bytes)}."
        )
    measured = {c.config for c in latest}
    untried = [c for c in cands.trialable if c.config not in measured]
    if untried:
        if trials is not None and len(latest) >= trials:
            why, change = f"the trial budget (--trials {trials}) was spent", "raise --trials"
        elif timeout is not None:
            why = f"the search time limit (--search-timeout {timeout:g} s) ran out"
            change = "raise --search-timeout (or leave it unset)"
        else:
            why, change = "the search stopped", "run the same command again"
        lines.append(
            f"{len(untried):,} candidate(s) that may fit were not tried because {why}: {change} "
            "to measure them."
        )
    elif memory:
        lines.append(_infeasible(s, cands, [cands.all[cfg] for cfg in cands.pruned] + memory))
    return " ".join(lines)


def _infeasible(s: Setting, cands: Candidates, rejected: list[Candidate]) -> str:
    return infeasible_advice(
        s.model, s.hardware, s.space, rejected, s.seq_len, s.global_batch, s.margin, s.device,
        skipped=cands.counts,
    )  # fmt: skip


def load_study_plan(storage: str, study: str) -> Plan:
    """The plan of an existing study, from storage alone (no trial runs)."""
    opt_study = st.load_study(storage, study)
    request = st.stored_request(opt_study)
    if request is None:
        raise AutofitError(
            f"Study {study!r} in {storage} was not made by `autofit plan` (it has no autofit "
            "metadata), so there is no plan to export."
        )
    setting = Setting.from_request(request)
    cands = enumerate_candidates(setting)
    kept = opt_study.user_attrs.get(CALIBRATION_ATTR)
    if kept:  # judged as the search that made it last judged them
        cands.recalibrate(Calibration.from_dict(kept))
    trial_cands = rebuild_trials(opt_study, cands)
    ranked = ranked_under_line(setting, trial_cands)
    best = None

    for cand in ranked:
        stored = stored_verification(opt_study, cand)
        if stored is not None and under_line(setting, TrialResult.from_dict(stored)):
            cand.verified = True
            best = cand
            break
    if best is None and ranked:
        best = ranked[0]  # measured but not yet verified: say so in the reason
    plan = assemble(setting, cands, opt_study, trial_cands, best, storage, None)
    if best is not None and not best.verified:
        plan.reason += " Not yet verified with a longer run: run `autofit plan` again to verify."
    return plan


def _intro(
    display: SearchDisplay,
    setting: Setting,
    cands: Candidates,
    name: str,
    url: str,
    folder: Path,
    done: int,
) -> None:
    s = setting
    skipped = sum(cands.counts.values())
    display.say(
        f"[bold]{escape(s.model.name)}[/] on {s.hardware.describe()}: {cands.considered:,} "
        "combinations, "
        f"{len(cands.trialable):,} may fit, {skipped:,} ruled out without a trial; headroom line "
        f"{fmt_size(s.allowed_bytes)} per GPU."
    )
    display.say(calibration_line(cands, s.calibration))
    resumed = f", resuming with {done} trial(s) done" if done else ""
    display.say(
        f"study [bold]{escape(name)}[/] in {escape(url)}{resumed}; run folder {escape(str(folder))}"
    )


def calibration_line(cands: Candidates, mode: str) -> str:
    """What the search starts from: the napkin, this machine's stored calibration, or a resumed
    study's own."""
    cal = cands.calibration
    if mode == "off":
        return "calibration off: the napkin alone judges and orders candidates"
    if cal.source == "none":
        where = " (none stored for this machine yet)" if mode == "auto" else ""
        return f"starting from the napkin{where}; every trial calibrates the estimate"
    err = (
        f"; its measured error: memory {cal.memory_band:.1%}, speed {cal.speed_band:.1%}"
        if cal.n_trials >= 2
        else ""
    )
    if cal.source == "stored":
        return (
            f"starting from this machine's stored calibration ({cal.n_trials} measured trial(s)"
            f"{err}); --no-calibration ignores it"
        )
    return f"calibrated on {cal.n_trials} measured trial(s) so far{err}"


class _quiet_optuna:
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
