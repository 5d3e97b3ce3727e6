"""Three `autofit plan` processes on one study in a real PostgreSQL 15 server; one is killed with
SIGKILL in the middle of a trial (issue 8, point 11)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import optuna
import pytest

from autofit.search import load_study_plan
from autofit.search import study as st
from tests.faults.conftest import cli_env, plan_cmd, trial_processes, wait_for, workers_of

pytestmark = pytest.mark.slow

SPACE4 = """\
seq_len: 32
knobs:
  lora_rank: [8]
  micro_batch: [1, 2, 4]
  checkpointing: [none, full]
"""


def test_three_planners_share_a_postgres_study_and_survive_a_killed_one(
    postgres: str, spawn, tmp_path: Path
) -> None:
    planners = []
    for i in range(3):
        cmd = plan_cmd(tmp_path, "--trials", "5", "--storage", postgres, "--study", "pg",
                       "--run-dir", str(tmp_path / f"w{i}"), "--json", gpus="1",
                       space_text=SPACE4)  # fmt: skip
        planners.append(spawn(cmd, cli_env(tmp_path), tmp_path))
        time.sleep(0.5)

    # the planner whose trial runs now (the others wait for the host's device lock)
    busy = wait_for(
        lambda: [p for p in planners if workers_of(p.pid)], 120, "a planner's trial to start"
    )[0]
    time.sleep(1.0)
    busy.kill()
    busy.wait(timeout=30)
    wait_for(lambda: not trial_processes(busy.pid), 5, "the killed planner's trial to die")

    survivors = [p for p in planners if p is not busy]
    outputs = []
    for p in survivors:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, (stdout, stderr)
        outputs.append(json.loads(stdout))

    study = optuna.load_study(study_name="pg", storage=st.open_storage(postgres))
    trials = study.get_trials()
    killed = [t for t in trials if t.user_attrs.get(st.OWNER, {}).get("process", "").startswith(
        f"{busy.pid}:") and t.user_attrs.get("outcome") == st.TRIAL]  # fmt: skip
    assert len(killed) == 1 and killed[0].state == optuna.trial.TrialState.FAIL
    assert not st.finished(killed[0])

    for t in trials:  # shown when an assertion below fails
        print(
            t.number,
            t.state.name,
            t.user_attrs.get("outcome"),
            t.user_attrs.get("label"),
            t.user_attrs.get(st.OWNER, {}).get("process"),
            t.user_attrs.get(st.RERUN_OF),
            t.user_attrs.get("enqueued"),
            (t.user_attrs.get("result") or {}).get("status"),
        )
    print("killed", busy.pid, "survivors", [p.pid for p in survivors])
    measured = [json.dumps(t.user_attrs["config"], sort_keys=True) for t in trials
                if st.finished(t)]  # fmt: skip
    assert len(measured) == len(set(measured)), "a config was measured twice"
    # the budget holds across planners; a calibrated search may stop before it (nothing left
    # that may beat the best), never before three measured trials
    assert 3 <= len(measured) <= 5
    again = [t for t in trials if st.finished(t) and t.user_attrs["config"] == killed[0].user_attrs[
        "config"]]  # fmt: skip
    assert len(again) == 1  # the killed trial's candidate, measured by a surviving planner
    assert again[0].user_attrs[st.OWNER]["process"].split(":")[0] in {str(p.pid) for p in survivors}

    plan = load_study_plan(postgres, "pg")
    assert plan.best is not None and plan.best.verified
    assert all(o["best"]["config"] == plan.best.config.to_dict() for o in outputs)
    verifications = [k for k in study.user_attrs if k.startswith("verify:")]
    assert len(verifications) >= 1
