"""The search's logic with a fake trial runner (no processes): what gets measured, in what order,
how OOMs and interruptions are recorded, and what resuming repeats (nothing finished)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from typing import Any

import optuna
import pytest
import sqlalchemy

from autofit.errors import AutofitError
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.report.run_folder import write_run_folder
from autofit.search import driver, load_study_plan, search
from autofit.search import study as st
from autofit.search.candidates import (
    Setting,
    distinct_seeds,
    enumerate_candidates,
    n_seeds,
)
from autofit.units import MiB

from .conftest import FakeTrials, wide_space


class FakeClock:
    """`time` for the search driver: `monotonic()` reads `now`, which the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def run(fake: FakeTrials, **kwargs: Any):  # type: ignore[no-untyped-def]
    return search(run_trial=fake, **kwargs)


def setting_of(kw: dict[str, Any], **changes: Any) -> Setting:
    s = Setting(kw["model"], kw["hardware"], kw["space"], kw["seq_len"], None, 0.05, "cpu")
    return replace(s, **changes)


def study_of(plan) -> optuna.Study:  # type: ignore[no-untyped-def]
    return st.load_study(plan.storage, plan.study_name)


def test_candidates_the_estimate_rules_out_never_cost_a_trial(fake, search_kwargs):
    kw = {**search_kwargs, "space": wide_space(), "trials": 10}
    plan = run(fake, **kw)
    cands = enumerate_candidates(setting_of(kw))
    assert cands.pruned, "the 56 MiB cap must rule some candidates out"
    assert not [c for c, _ in fake.calls if c in cands.pruned]
    assert sum(plan.pruned.values()) >= len(cands.pruned)
    limit = cands.setting.allowed_bytes * 1.10
    assert all(cands.all[c].estimate.peak_bytes <= limit for c, _ in fake.calls)


def test_first_trials_are_the_napkins_best_distinct_candidates(fake, search_kwargs):
    # without calibration the napkin's best distinct candidates seed the study (with it, the
    # calibrated best comes next after each trial: tests/search/test_calibrated.py)
    kw = {**search_kwargs, "space": wide_space(), "trials": 6, "calibration": "off"}
    run(fake, **kw)
    cands = enumerate_candidates(setting_of(kw))
    seeds = [c.config for c in distinct_seeds(cands.predicted_fit, n_seeds(6))]
    assert len(seeds) == n_seeds(6) == 4
    assert fake.search_configs[: len(seeds)] == seeds


def test_an_oom_is_a_completed_trial_with_its_constraint_violated(search_kwargs):
    # the estimate says everything fits; reality is 2.5x bigger for micro-batch 8, past the
    # capacity whatever the checkpointing
    fake = FakeTrials(peak_factor=lambda cfg: 2.5 if cfg.micro_batch == 8 else 1.0)
    plan = run(fake, **{**search_kwargs, "trials": 4})
    ooms = [c for c in plan.trials if c.trial.status == "oom"]
    assert ooms, "micro-batch 8 must OOM"
    for t in study_of(plan).get_trials():
        if t.user_attrs.get("result", {}).get("status") == "oom":
            assert t.state == optuna.trial.TrialState.COMPLETE
            assert t.value == 0.0
            assert t.constraints["memory"] > 0
    assert plan.best is not None and plan.best.config.micro_batch != 8
    assert plan.best.trial.peak_bytes <= 56 * MiB * 0.95


def test_winner_is_verified_with_more_steps_and_next_best_when_it_fails(search_kwargs):
    # the fastest candidate grows past the line when run longer; the next best holds
    fastest: list[Any] = []

    def grows(cfg):  # type: ignore[no-untyped-def]
        return 1.0

    fake = FakeTrials(peak_factor=grows)
    original = fake.__call__

    def runner(model, config, **kw):  # type: ignore[no-untyped-def]
        result = original(model, config, **kw)
        if kw["steps"] > 2 and not fastest:
            fastest.append(config)
            result.peak_bytes = 55 * MiB  # over the 53.2 MiB line, under capacity
        return result

    plan = search(run_trial=runner, **search_kwargs)
    assert fastest and plan.best is not None
    assert plan.best.config != fastest[0]
    assert plan.best.verified
    verify_steps = [s for _, s in fake.calls if s > 2]
    assert verify_steps == [4, 4]
    assert "Verified by a 4-step re-run" in plan.reason


def test_interrupted_search_resumes_without_repeating_a_finished_trial(search_kwargs):
    fake = FakeTrials(interrupt_at=3)
    with pytest.raises(KeyboardInterrupt):
        run(fake, **search_kwargs)
    first = [c for c, _ in fake.calls[:2]]
    fake.interrupt_at = None
    fake.calls.clear()
    plan = run(fake, **search_kwargs)
    again = fake.search_configs
    assert not set(first) & set(again), "a finished trial ran again"
    assert len(plan.trials) == search_kwargs["trials"]
    measured = [c.config for c in plan.trials]
    assert len(set(measured)) == len(measured)
    states = [t.state for t in study_of(plan).get_trials()]
    assert optuna.trial.TrialState.FAIL in states  # the interrupted one, tried again later


def test_rerunning_a_finished_study_spends_no_trial(fake, search_kwargs):
    plan = run(fake, **search_kwargs)
    fake.calls.clear()
    again = run(fake, **search_kwargs)
    assert fake.calls == []
    assert again.best is not None and again.best.config == plan.best.config
    assert again.best.verified


def test_a_killed_workers_trial_is_failed_after_its_heartbeat_stops(fake, search_kwargs):
    kw = {**search_kwargs, "trials": 2}
    plan = run(fake, **kw)
    study = study_of(plan)
    # a worker that died mid-trial: RUNNING, outcome "trial", last heartbeat an hour ago (written
    # into Optuna's `trial_heartbeats` table, as a worker killed then would have left it)
    zombie = study.ask()
    zombie.set_user_attr("outcome", st.TRIAL)
    zombie.set_user_attr("config", plan.trials[0].config.replace(micro_batch=2).to_dict())
    storage = optuna.storages.RDBStorage(plan.storage)
    study_id = storage.get_study_id_from_name(plan.study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, zombie.number)
    storage.record_heartbeat(trial_id)
    with storage.engine.begin() as db:
        db.execute(
            sqlalchemy.text(
                "UPDATE trial_heartbeats SET heartbeat = datetime('now', '-1 hour') "
                "WHERE trial_id = :id"
            ),
            {"id": trial_id},
        )
    storage.engine.dispose()
    fake.calls.clear()
    run(fake, **{**kw, "trials": 3})
    assert study.get_trials()[zombie.number].state == optuna.trial.TrialState.FAIL
    assert len(fake.search_configs) == 1


def test_trial_budget_counts_real_trials_only(fake, search_kwargs):
    kw = {**search_kwargs, "space": wide_space(), "trials": 3}
    plan = run(fake, **kw)
    assert len(fake.search_configs) == 3 and len(plan.trials) == 3
    outcomes = [t.user_attrs.get("outcome") for t in study_of(plan).get_trials()]
    assert outcomes.count(st.TRIAL) == 3


def test_search_timeout_stops_new_trials(fake, search_kwargs, monkeypatch):
    clock = FakeClock()  # the search's clock; each trial takes a minute of it and no real time
    monkeypatch.setattr(driver, "time", clock)

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        clock.now += 60.0
        return fake(*args, **kwargs)

    plan = search(run_trial=slow, **{**search_kwargs, "trials": 10, "timeout": 30.0})
    assert len(fake.search_configs) == 1  # the first starts; none after the time is up
    assert plan.best is not None and plan.best.verified  # the winner is still verified


def test_nothing_fits_names_the_nearest_candidate_and_what_would_help(fake, search_kwargs):
    kw = {**search_kwargs, "gpu_memory": 8 * MiB}
    kw["hardware"] = kw["hardware"].with_capacity(8 * MiB)
    plan = run(fake, **kw)
    assert fake.calls == []
    assert plan.best is None
    assert "Nearest" in plan.advice and "What would make it fit" in plan.advice


def test_measured_failures_are_explained_when_nothing_fits(search_kwargs):
    fake = FakeTrials(peak_factor=lambda cfg: 3.0)
    plan = run(fake, **{**search_kwargs, "trials": 3})
    assert plan.best is None
    n = len(plan.trials)  # a calibrated search may rule the rest out after the first OOMs
    assert n >= 1 and f"{n} trial{'s' if n > 1 else ''} ran ({n} oom)" in plan.advice


def test_the_study_rebuilds_the_plan_without_running_anything(fake, search_kwargs):
    plan = run(fake, **search_kwargs)
    fake.calls.clear()
    loaded = load_study_plan(plan.storage, plan.study_name)
    assert fake.calls == []
    assert loaded.best.config == plan.best.config and loaded.best.verified
    assert [c.config for c in loaded.trials] == [c.config for c in plan.trials]
    assert loaded.pruned == plan.pruned


def test_unknown_study_lists_the_studies_there(fake, search_kwargs):
    plan = run(fake, **search_kwargs)
    with pytest.raises(AutofitError, match=plan.study_name):
        load_study_plan(plan.storage, "no-such-study")


def test_a_study_for_another_model_is_not_resumed(fake, search_kwargs):
    plan = run(fake, **search_kwargs)
    other = replace(resolve_model("llama-debug"), name="other", layers=2)
    with pytest.raises(AutofitError, match="another setting"):
        run(fake, **{**search_kwargs, "model": other, "study": plan.study_name})


def test_run_folder_keeps_study_plan_and_picture(fake, search_kwargs):
    plan = run(fake, **search_kwargs)
    folder = search_kwargs["run_dir"]
    assert (folder / "study.db").is_file()
    assert not (folder / "plan.json").exists()  # the search keeps its study; the caller the plan
    write_run_folder(plan, folder)
    data = json.loads((folder / "plan.json").read_text())
    assert data["best"]["config"] == plan.best.config.to_dict()
    assert "pruned" in data and data["trials"]
    assert (folder / "plan.yaml").read_text().startswith("# autofit plan")
    assert (folder / "trials.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_study_name_is_stable_and_names_the_setting(search_kwargs):
    kw = search_kwargs
    a = st.default_study_name(kw["model"], kw["hardware"], kw["space"], 64, None, "cpu")
    b = st.default_study_name(kw["model"], kw["hardware"], kw["space"], 64, None, "cpu")
    c = st.default_study_name(kw["model"], kw["hardware"], kw["space"], 128, None, "cpu")
    assert a == b != c
    assert a.startswith("llama-debug-2xcpu-gloo-tiny_space-s64-")


def test_a_space_listing_what_wrap_auto_stands_for_resumes_the_same_study(fake, search_kwargs):
    # on one GPU `wrap: auto` is the plain module, `wrap: none` (layout.resolve_wrap, README's
    # knob table): the two spaces make the same runs, so they name and resume the same study
    one = resolve_hardware("1", device="cpu", gpu_memory=112 * MiB)
    kw = {**search_kwargs, "hardware": one, "gpu_memory": 112 * MiB}
    space = kw["space"]
    auto, plain = (replace(space, knobs={**space.knobs, "wrap": (w,)}) for w in ("auto", "none"))
    first = search(run_trial=fake, **{**kw, "space": auto})
    calls = len(fake.calls)
    again = search(run_trial=fake, **{**kw, "space": plain})
    assert again.study_name == first.study_name and again.storage == first.storage
    assert again.best.config == first.best.config and first.best.config.wrap == "none"
    assert len(fake.calls) == calls  # its trials were measured already


class Turns:
    """Two search workers take turns at their search trials, strictly A, B, A, B...: a worker
    hands the turn over when it starts its next trial (after its previous one was recorded and the
    budget checked) or when it leaves the search (its first verification run). So what each
    worker sees when it checks the budget does not depend on thread timing."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turn, self.holding, self.done = 0, [False, False], [False, False]

    def runner(self, i: int, fake: FakeTrials):  # type: ignore[no-untyped-def]
        def run_one(*args: Any, steps: int, **kwargs: Any) -> Any:
            with self.cond:
                if steps > 2 or self.holding[i]:  # search over, or the next trial: hand over
                    self.holding[i] = False
                    self.done[i] = self.done[i] or steps > 2
                    if not self.done[1 - i]:
                        self.turn = 1 - i
                    self.cond.notify_all()
                if steps <= 2:
                    self.cond.wait_for(lambda: self.turn == i or self.done[1 - i], timeout=60)
                    self.holding[i] = True
            return fake(*args, steps=steps, **kwargs)

        return run_one

    def leave(self, i: int) -> None:
        with self.cond:
            self.done[i], self.holding[i], self.turn = True, False, 1 - i
            self.cond.notify_all()


def test_two_workers_on_one_storage_share_the_work(search_kwargs, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_LOCK_DIR", str(tmp_path / "locks"))  # the host's device lock
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    # the sampler's turns (calibration off: a calibrated search may stop before its budget)
    kw = {**search_kwargs, "space": wide_space(), "trials": 6, "storage": storage,
          "study": "shared", "calibration": "off"}  # fmt: skip
    fakes = [FakeTrials(), FakeTrials()]
    plans: list[Any] = [None, None]
    errors: list[BaseException] = []
    turns = Turns()

    def worker(i: int) -> None:
        try:
            runner = turns.runner(i, fakes[i])
            plans[i] = search(run_trial=runner, **{**kw, "run_dir": tmp_path / f"w{i}"})
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
        finally:
            turns.leave(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    measured = fakes[0].search_configs + fakes[1].search_configs
    assert len(measured) == len(set(measured)), "two workers measured the same config"
    # A1 B1 A2 B2 A3, then A's fourth would be the 7th trial counted (B3 is running): A stops;
    # B3, then B sees 6 finished and stops
    assert [len(f.search_configs) for f in fakes] == [3, 3]
    assert plans[0].best.config == plans[1].best.config
    verified = [c for f in fakes for c, steps in f.calls if steps > 2]
    assert len(verified) == len(set(verified)), "two workers on one host verified one config"


# ----- the LoRA settings: carried by every candidate, stored with the study ----------------------
def test_lora_settings_reach_every_trial_and_read_back_from_the_study(fake, search_kwargs):
    space = wide_space().with_settings(lora_targets=["q_proj", "v_proj"], lora_dropout=0.05)
    plan = run(fake, **{**search_kwargs, "space": space, "trials": 6, "calibration": "off"})
    measured = [cfg for cfg, _ in fake.calls]
    assert len(fake.search_configs) == 6  # the sampler's picks are candidates, none "invalid"
    assert any(cfg.is_lora for cfg in measured)
    assert {(cfg.lora_targets, cfg.lora_dropout) for cfg in measured} == {
        (("q_proj", "v_proj"), 0.05)
    }

    stored = st.stored_request(study_of(plan))
    assert stored is not None and stored.space.settings == space.settings
    assert stored.space.candidates(2, seq_len=64) == space.candidates(2, seq_len=64)
    loaded = load_study_plan(plan.storage, plan.study_name)
    assert loaded.best.config == plan.best.config
    assert loaded.best.config.lora_targets == ("q_proj", "v_proj")
    assert [c.config for c in loaded.trials] == [c.config for c in plan.trials]


def test_a_study_is_not_resumed_with_other_lora_settings(fake, search_kwargs):
    kw = {**search_kwargs, "trials": 2, "study": "lora-study"}
    run(fake, **{**kw, "space": wide_space().with_settings(lora_targets="q_proj")})
    with pytest.raises(AutofitError, match=r"other LoRA settings \(lora_targets=\['q_proj'\]"):
        run(fake, **{**kw, "space": wide_space()})


def test_default_study_name_tells_lora_settings_apart(search_kwargs):
    kw, space = search_kwargs, wide_space()
    names = {
        st.default_study_name(kw["model"], kw["hardware"], sp, 64, None, "cpu")
        for sp in (
            space,
            space.with_settings(lora_targets="all-linear"),  # the default: the same study
            space.with_settings(lora_targets="q_proj"),
            space.with_settings(lora_dropout=0.1),
        )
    }
    assert len(names) == 3
