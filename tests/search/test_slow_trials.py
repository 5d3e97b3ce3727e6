"""A CPU plan whose first candidate crawls, and plans that run out of time: real trials of
llama-debug on one CPU process, the crawl made by the fault injector (`slow-step`: every step of
the matching config sleeps first, as a config whose kernels crawl on a GPU would)."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.report import plan_report
from autofit.search import search
from autofit.space_file import parse_space
from autofit.trials import TrialResult, run_trial
from autofit.trials.budget import SLOW_MIN_S
from autofit.units import MiB
from tests.faults.inject import fault_env
from tests.faults.inject.sitecustomize import SLOW_MATCH_ENV, SLOW_S_ENV

pytestmark = pytest.mark.slow

SLEEP_S = SLOW_MIN_S + 2.0  # each step of the crawling config: past the slow mark of any step


def kwargs(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    space = parse_space(
        {"seq_len": 64, "knobs": {"lora_rank": [8], "micro_batch": [1, 2, 4], "wrap": ["none"]}},
        "three", name="three",
    )  # fmt: skip
    kw = {
        "model": resolve_model("llama-debug"),
        "hardware": resolve_hardware("1", device="cpu", gpu_memory=256 * MiB),
        "space": space,
        "seq_len": 64,
        "trials": 3,
        "steps": 3,
        "device": "cpu",
        "gpu_memory": 256 * MiB,
        "run_dir": tmp_path / "run",
        "calibration": "study",
        "seed": 0,
    }
    kw.update(changes)
    return kw


def test_a_crawling_candidate_is_stopped_as_slow_ranked_and_the_search_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in fault_env("slow-step").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(SLOW_MATCH_ENV, "mb4x1")  # the napkin's fastest: the first trial
    monkeypatch.setenv(SLOW_S_ENV, str(SLEEP_S))
    calls: list[tuple[str, dict[str, Any]]] = []

    def recorded(model: Any, config: Any, **kw: Any) -> TrialResult:
        calls.append((config.short(), kw))
        return run_trial(model, config, **kw)

    plan = search(run_trial=recorded, **kwargs(tmp_path))
    first = plan.trials[0]
    assert "mb4x1" in first.config.short()
    assert first.trial.status == "slow", first.trial.message
    # stopped after its first measured step: one warm-up and one measured step of sleep, not
    # the warm-up and three it would have run. Its wall time is the start of a trial (a process,
    # its imports, the build: the next trial's wall time, whose steps do not sleep, bounds it) and
    # two sleeping steps, where running on would have added two more; how long a start takes
    # depends on the machine (7-10 s on the suite's, some days), so the bound is read off it
    assert len(first.trial.losses) == 2
    assert len(plan.trials) >= 2
    start = plan.trials[1].trial.wall_s
    assert first.trial.wall_s < start + 3 * SLEEP_S, (first.trial.wall_s, start)
    # what it measured ranks it (its speed is that of its sleeping steps) and taught the speed
    tokens = 4 * 64
    assert first.trial.tokens_per_s == pytest.approx(tokens / first.trial.step_time_s)
    assert first.trial.step_time_s > SLEEP_S
    assert any(c.config == first.config for c in plan.ranked)
    # the search went on and ended with another config, verified by a longer run
    assert len(plan.trials) >= 2
    assert plan.best is not None and plan.best.verified
    assert plan.best.config != first.config
    assert plan.best.tokens_per_s > first.trial.tokens_per_s
    # each trial was held to its own estimate: a limit and a slow mark, recorded with it
    limits = [kw["timeout_s"] for _, kw in calls]
    assert all(0 < limit < 600 for limit in limits)
    marks = [kw.get("slow_after_s") for _, kw in calls[: len(plan.trials)]]
    assert all(mark is not None and mark >= SLOW_MIN_S for mark in marks)
    assert calls[-1][1].get("slow_after_s") is None  # the verification runs to its end


def test_a_search_out_of_time_names_its_best_measured_and_what_it_left_untried(
    tmp_path: Path,
) -> None:
    # a search time limit that lets one trial start: the winner is that trial's config,
    # verified, and the plan says which candidates the estimate says fit were left untried
    plan = search(run_trial=run_trial, **kwargs(tmp_path, timeout=0.5))
    assert len(plan.trials) == 1
    assert plan.best is not None and plan.best.config == plan.trials[0].config
    assert plan.best.verified
    assert len(plan.untried) == 2
    assert all(c.config != plan.best.config for c in plan.untried)
    data = plan.to_dict()
    assert data["untried"]["count"] == 2


def test_a_search_whose_only_trial_timed_out_does_not_say_nothing_fits(tmp_path: Path) -> None:
    def timed_out(model: Any, config: Any, **kw: Any) -> TrialResult:
        time.sleep(1.0)  # past the search's time limit
        return TrialResult(status="timeout", config=config.to_dict(), model=model.name,
                           device="cpu", message="The trial ran past its limit of 5 s and was "
                           "killed.", wall_s=5.0)  # fmt: skip

    plan = search(run_trial=timed_out, **kwargs(tmp_path, timeout=0.5))
    assert plan.best is None and len(plan.trials) == 1
    text = io.StringIO()
    plan_report(Console(file=text, width=80), plan)
    out = " ".join(text.getvalue().split())  # the 80-column lines joined again
    assert "No config fits" not in out
    assert "No config measured to fit yet." in out
    assert "2 candidate(s) that may fit were not tried because the search time limit" in out
    assert "Untried, fastest first: 'lora r8 mb" in out
