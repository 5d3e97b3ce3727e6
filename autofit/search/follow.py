"""A planner on node > 0 of several: it runs its part of every launch of node 0's search, then
returns the plan node 0 stored (`autofit.trials.cluster`)."""

from __future__ import annotations

import optuna

from autofit.plan import Plan
from autofit.search import study as st
from autofit.search.assemble import load_study_plan
from autofit.search.events import SearchListener, shown
from autofit.trials.cluster import Cluster
from autofit.trials.result import TrialResult


def follow(
    cluster: Cluster, study: optuna.Study, display: SearchListener, url: str, name: str
) -> Plan:
    """A node >0: run this node's part of node 0's every launch, then its plan from the study."""

    def part(seq: int, result: TrialResult) -> None:
        head = (result.message or "").strip().splitlines()[:1]
        display.note(f"node {cluster.node_rank}: launch {seq} of node 0 ended {result.status}"
                     + (f" ({head[0]})" if head and not result.ok else ""))  # fmt: skip

    cluster.say = display.note
    with shown(display, 0, 0, 0):
        cluster.follow(part, lambda process: _fail_trials_of(study, process))
        display.note(f"node 0's search is done; its plan, from study {name}:")
    return load_study_plan(url, name)


def _fail_trials_of(study: optuna.Study, process: str | None) -> list[int]:
    """Mark FAIL the running trials the planner `process` (`guard.identity()`) owned: their
    candidates run again when every planner is started again. Returns their numbers."""
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    return [
        t.number
        for t in running
        if process is not None
        and (t.user_attrs.get(st.OWNER) or {}).get("process") == process
        and st.fail_running(study, t)
    ]
