"""The whole product on CPU: `autofit plan --device cpu` with 2 gloo processes of llama-debug under
a 56 MiB cap, interrupted and resumed, then exported for Accelerate and the HF Trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest

from autofit.search import search
from autofit.search import study as st
from autofit.trials import run_trial
from autofit.units import MiB

pytestmark = pytest.mark.slow

CAP = 56 * MiB


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory, request: Any) -> dict[str, Any]:
    """Run a search that is interrupted (Ctrl-C) during its 4th trial, then the same again."""
    kwargs = request.getfixturevalue("e2e_kwargs")
    calls: list[tuple[Any, int]] = []

    def interrupted(model, config, **kw):  # type: ignore[no-untyped-def]
        calls.append((config, kw["steps"]))
        if len(calls) == 4:
            raise KeyboardInterrupt
        return run_trial(model, config, **kw)

    with pytest.raises(KeyboardInterrupt):
        search(run_trial=interrupted, **kwargs)
    before = [c for c, _ in calls[:3]]
    calls.clear()

    def counted(model, config, **kw):  # type: ignore[no-untyped-def]
        calls.append((config, kw["steps"]))
        return run_trial(model, config, **kw)

    plan = search(run_trial=counted, **kwargs)
    return {"plan": plan, "before": before, "after": calls, "kwargs": kwargs}


@pytest.fixture(scope="module")
def e2e_kwargs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from autofit.hardware import resolve_hardware
    from autofit.models import resolve_model
    from autofit.space_file import load_space

    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    return {
        "model": resolve_model("llama-debug"),
        "hardware": resolve_hardware("2", device="cpu", gpu_memory=CAP),
        "space": load_space(Path(__file__).with_name("tiny_space.yaml")),
        "seq_len": 64,
        "trials": 6,
        "steps": 2,
        "device": "cpu",
        "gpu_memory": CAP,
        "run_dir": run_dir,
        "trial_timeout": 180,
        # no pruning: the estimate's memory verdict is not trusted, so the napkin's fastest
        # (unsharded, micro-batch 8) run for real under the cap and OOM
        "prune": False,
        # the sampler's path (the calibrated one stops once nothing may gain: test_calibrated)
        "calibration": "off",
    }


def test_search_measures_at_least_five_trials_with_an_oom_it_learns_from(resumed):
    plan = resumed["plan"]
    assert len(plan.trials) >= 5
    assert any(c.trial.status == "oom" for c in plan.trials)
    study = st.load_study(plan.storage, plan.study_name)
    ooms = [t for t in study.get_trials() if t.user_attrs.get("result", {}).get("status") == "oom"]
    assert ooms and all(t.state == optuna.trial.TrialState.COMPLETE for t in ooms)
    assert all(t.constraints["memory"] > 0 for t in ooms)


def test_winner_fits_with_the_margin_and_was_verified(resumed):
    plan = resumed["plan"]
    assert plan.best is not None and plan.best.verified
    assert plan.best.trial.status == "ok"
    assert plan.best.trial.peak_bytes <= CAP * (1 - 0.05)
    verify_runs = [cfg for cfg, steps in resumed["after"] if steps > 2]
    assert verify_runs[-1] == plan.best.config
    assert "measured" in plan.reason and "tokens/s for all 2 CPU processes" in plan.reason


def test_resumed_study_repeats_no_finished_trial(resumed):
    before = resumed["before"]
    after = [cfg for cfg, steps in resumed["after"] if steps == 2]
    assert len(before) == 3
    assert not set(before) & set(after)
    measured = [c.config for c in resumed["plan"].trials]
    assert len(measured) == len(set(measured))


def test_cli_rerun_of_the_finished_study_returns_the_plan_as_json(resumed, tmp_path):
    kw, plan = resumed["kwargs"], resumed["plan"]
    cmd = [
        sys.executable, "-m", "autofit", "plan", "-m", "llama-debug", "-g", "2",
        "--device", "cpu", "--gpu-memory", "56MiB", "--seq-len", "64", "--trials", "6",
        "--steps", "2", "--no-prune", "--space", str(kw["space"].path),
        "--run-dir", str(kw["run_dir"]), "--json",
        "--export", str(tmp_path / "plan.yaml"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["best"]["config"] == plan.best.config.to_dict()
    assert data["best"]["verified"] is True
    assert isinstance(data["pruned"], dict)
    assert len(data["trials"]) == len(plan.trials)
    assert data["study"] == plan.study_name


@pytest.mark.parametrize("fmt", ["accelerate", "trainer", "autofit"])
def test_cli_export_writes_files_their_tools_accept(resumed, tmp_path, fmt):
    plan = resumed["plan"]
    out = tmp_path / {"accelerate": "fsdp2.yaml", "trainer": "args.json"}.get(fmt, "plan.yaml")
    cmd = [sys.executable, "-m", "autofit", "export", "--storage", plan.storage,
           "--study", plan.study_name, "--format", fmt, "--output", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "launch:" in proc.stdout and "<your_train.py>" in proc.stdout
    assert "PYTORCH_CUDA_ALLOC_CONF" not in proc.stdout  # a CPU plan: no CUDA setting
    if fmt == "accelerate":
        from accelerate.commands.config.config_args import load_config_from_file

        cfg = load_config_from_file(str(out))
        assert cfg.fsdp_config["fsdp_version"] == 2
        assert cfg.num_processes == 2
    elif fmt == "trainer":
        import torch
        from transformers import TrainingArguments

        args = TrainingArguments(**json.loads(out.read_text()),
                                 use_cpu=not torch.cuda.is_available())  # fmt: skip
        assert args.per_device_train_batch_size == plan.best.config.micro_batch
    import autofit

    side = out if fmt == "autofit" else out.with_name(f"{out.stem}.autofit.yaml")
    assert autofit.load_plan(side).best.config == plan.best.config


def test_run_folder_has_the_picture_and_the_plan(resumed):
    folder = resumed["kwargs"]["run_dir"]
    assert (folder / "trials.png").stat().st_size > 10_000
    assert (folder / "plan.yaml").is_file() and (folder / "study.db").is_file()
