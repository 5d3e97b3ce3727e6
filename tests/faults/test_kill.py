"""A planner killed mid-trial (`kill -9`, SIGTERM) leaves no process, and a re-run at once measures
the interrupted candidate first (issue 8, faults 1 and 2: the exact repro, on a hung trial)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import optuna
import pytest

from autofit.search import study as st
from tests.faults.conftest import cli_env, plan_cmd, trial_processes, wait_for, workers_of
from tests.faults.inject import fault_env

pytestmark = pytest.mark.slow


def _start_hung_plan(spawn, tmp_path: Path):  # type: ignore[no-untyped-def]
    """The issue's repro: a 2-rank CPU plan whose trial hangs, --trial-timeout 20."""
    cmd = plan_cmd(tmp_path, "--trials", "2", "--storage", f"sqlite:///{tmp_path}/h.db",
                   "--study", "h", "--trial-timeout", "20")  # fmt: skip
    env = cli_env(tmp_path, **fault_env("hang"))
    planner = spawn(cmd, env, tmp_path)
    wait_for(lambda: len(workers_of(planner.pid)) == 2, 90, "both ranks of the hung trial")
    return planner


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_killed_planner_leaves_no_trial_process(spawn, tmp_path: Path, sig: int) -> None:
    planner = _start_hung_plan(spawn, tmp_path)
    assert len(trial_processes(planner.pid)) >= 3  # torchrun and two workers
    planner.send_signal(sig)
    # they die with it (PDEATHSIG, the watchdog), long before their own deadline (20 s + 30 s)
    wait_for(lambda: not trial_processes(planner.pid), 20, "the trial's processes to die")
    planner.wait(timeout=30)
    stderr = planner.stderr.read()
    if sig == signal.SIGTERM:  # like Ctrl-C: a clean exit that says how to resume
        assert planner.returncode == 128 + signal.SIGTERM
        assert "Interrupted (SIGTERM)" in stderr and "run the same command again" in stderr
        assert "Traceback" not in stderr
        assert not list(tmp_path.glob("autofit-trial-*"))  # its scratch folder is gone too


def test_rerun_right_after_a_kill_measures_the_interrupted_candidate_first(
    spawn, tmp_path: Path
) -> None:
    planner = _start_hung_plan(spawn, tmp_path)
    planner.kill()
    planner.wait(timeout=30)
    assert list(tmp_path.glob("autofit-trial-*"))  # kill -9: nobody could clean up
    study = optuna.load_study(study_name="h", storage=f"sqlite:///{tmp_path}/h.db")
    cut = [t for t in study.get_trials() if t.user_attrs.get("outcome") == st.TRIAL]
    assert len(cut) == 1 and cut[0].state == optuna.trial.TrialState.RUNNING
    interrupted = cut[0].user_attrs["config"]

    # at once (not after the 60 s heartbeat grace), with a budget of one trial
    cmd = plan_cmd(tmp_path, "--trials", "1", "--storage", f"sqlite:///{tmp_path}/h.db",
                   "--study", "h", "--trial-timeout", "120", "--json")  # fmt: skip
    rerun = spawn(cmd, cli_env(tmp_path), tmp_path)
    stdout, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    plan = json.loads(stdout)
    assert [t["config"] for t in plan["trials"]] == [interrupted]  # measured, and first
    assert plan["best"]["config"] == interrupted and plan["best"]["verified"]
    assert not list(tmp_path.glob("autofit-trial-*"))  # the dead planner's folder went away

    study = optuna.load_study(study_name="h", storage=f"sqlite:///{tmp_path}/h.db")
    by_number = {t.number: t for t in study.get_trials()}
    assert by_number[cut[0].number].state == optuna.trial.TrialState.FAIL  # its owner was gone
    reruns = [t for t in by_number.values() if t.user_attrs.get(st.RERUN_OF) == cut[0].number]
    assert len(reruns) == 1 and st.finished(reruns[0])
