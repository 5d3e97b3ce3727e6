"""The examples run: a one-GPU plan trained by examples/train_with_plan.py with the model and
optimizer `autofit.apply` returns (the plain module on CPU, no torchrun, no process group)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.plan import plan_estimates
from autofit.request import PlanRequest
from autofit.space_file import load_space
from tests.example_runs import peaks_as_its_trial

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_train_with_plan_trains_a_one_gpu_plan_without_torchrun(tmp_path):
    plan = plan_estimates(PlanRequest.of(
        resolve_model("llama-debug"), resolve_hardware("1xrtx3090"),
        load_space(ROOT / "examples" / "tiny_space.yaml"), seq_len=64,
    ))  # fmt: skip
    assert plan.best is not None and plan.best.config.wrap == "none"  # one GPU: plain module
    (path,) = plan.export("autofit", tmp_path / "plan.yaml")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "4"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_with_plan.py"), "--plan", str(path),
         "--steps", "4"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sharding: none" in proc.stdout
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, proc.stdout


def test_a_malformed_plan_is_one_paragraph_and_exit_2_from_the_example(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "autofit_plan: 1\nhardware: {n_gpus: 1, gpu: rtx3090}\nconfig: {lora_rank: 8}\n"
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_with_plan.py"), "--plan", str(path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"{path} is not a valid autofit plan: `hardware.gpu` is not a")
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


# The spaces of the trainer and TRL export tests: each plan's winner is trialled once, all four in
# one launch (`exported_plans`), as a plan measures its candidates.
EXPORT_SPACES = {
    # with the embedding and head trained: peft's bf16 copies beside fp32 adapters
    "lora": "launch: trainer\ntrain_embeddings: full\nknobs:\n  quant: [none]\n"
    "  lora_rank: [8]\n  micro_batch: [2, 4]\n  wrap: [none]\n  checkpointing: [none, full]\n",
    # a QLoRA script: from_pretrained with BitsAndBytesConfig, prepare_model_for_kbit_training
    "qlora": "launch: trainer\nquant_backend: bitsandbytes\nbnb_4bit_use_double_quant: true\n"
    "knobs:\n  quant: [nf4]\n  lora_rank: [8]\n  micro_batch: [2]\n  wrap: [none]\n"
    "  checkpointing: [none]\n",
    # a TRL script on the data's lengths, packed, the embedding and head trained too (peft's
    # copies through SFTTrainer)
    "trl": "launch: trl\ntrain_embeddings: full\nknobs:\n  quant: [none]\n  lora_rank: [8]\n"
    "  micro_batch: [2]\n  wrap: [none]\n  checkpointing: [none]\n  batching: [packed]\n",
    # a TRL QLoRA script (bf16-mixed is refused there: its adapters are turned to bf16)
    "trl-qlora": "launch: trl\nquant_backend: bitsandbytes\nknobs:\n  quant: [nf4]\n"
    "  lora_rank: [8]\n  micro_batch: [2]\n  wrap: [none]\n  checkpointing: [none]\n"
    "  precision: [bf16-mixed, bf16]\n",
}
NEEDS = {"qlora": ("bitsandbytes",), "trl": ("trl",), "trl-qlora": ("trl", "bitsandbytes")}


def _missing(kind: str) -> str | None:
    import importlib.util

    return next((m for m in NEEDS.get(kind, ()) if importlib.util.find_spec(m) is None), None)


@pytest.fixture(scope="module")
def exported_plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """(plan, trial of its winner) of each export space whose libraries are installed: the plans
    on CPU (the TRL one on the data's lengths), the trials in one launch (rows of `seq_len`, as
    the examples train: each row a document)."""
    from autofit.data.read import read_length_file
    from autofit.trials import run_trials

    spec = resolve_model("llama-debug")
    folder = tmp_path_factory.mktemp("export-spaces")  # not in examples/: traces not shipped
    hist = read_length_file(ROOT / "examples" / "instruct_lengths.json")
    plans = {}
    for kind, text in EXPORT_SPACES.items():
        if _missing(kind):
            continue
        space = folder / f"{kind}.yaml"
        space.write_text("seq_len: 64\n" + text)
        plans[kind] = plan_estimates(PlanRequest.of(
            spec, resolve_hardware("1", device="cpu"), load_space(space), seq_len=64,
            device="cpu", lengths=hist if kind == "trl" else None,
        ))  # fmt: skip
        assert plans[kind].best is not None, kind
    configs = [plan.best.config for plan in plans.values()]
    trials = run_trials(spec, configs, nprocs=1, device="cpu", steps=2, warmup=1, timeout_s=240)
    for kind, trial in zip(plans, trials, strict=True):
        assert trial.status == "ok", f"{kind}: {trial.message[-800:]}"
    return {kind: (plan, trial) for (kind, plan), trial in zip(plans.items(), trials, strict=True)}


def _exported(exported_plans: dict[str, tuple[Any, Any]], kind: str) -> tuple[Any, Any]:
    missing = _missing(kind)
    if missing:
        pytest.skip(f"{missing} is not installed")
    return exported_plans[kind]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_a_trainer_launch_export_trains_where_its_trial_peaked(exported_plans, tmp_path, kind):
    # A plan for an HF Trainer script (launch: trainer), exported as TrainingArguments JSON and
    # launched as its printed note says (examples/trainer_train.py: the model loaded as the
    # trial loaded it, Trainer with the exported arguments), peaks where the trial of its
    # winner measured: the trial ran the very arguments the export writes.
    from autofit.export.launch import launch_note

    plan, trial = _exported(exported_plans, kind)
    cfg = plan.best.config
    assert cfg.launch == "trainer"
    if kind == "lora":  # the export's lora section names the copies for peft
        assert cfg.train_embeddings == "full"
    paths = plan.export("trainer", tmp_path / "args.json")
    assert [p.name for p in paths] == ["args.json", "args.autofit.yaml"]
    note = launch_note(plan, "trainer", tmp_path / "args.json")
    assert "trainer_train.py --arguments" in note and "no autofit.apply" in note
    if kind == "qlora":  # the plan file names how the trials loaded the model
        header = paths[1].read_text()
        assert "bnb_4bit_use_double_quant=True" in header
        assert "prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)" in header
        assert "BitsAndBytesConfig" in note and "prepare_model_for_kbit_training" in note
    peaks_as_its_trial(ROOT / "examples" / "trainer_train.py", paths, trial, tmp_path)


@pytest.mark.timeout(400)
def test_a_trl_launch_export_trains_where_its_trial_peaked(exported_plans, tmp_path):
    # A plan for a TRL script (launch: trl) on the data's lengths, packed: exported as SFTConfig
    # JSON (packing, max_length, activation_checkpointing, the model's dtype) and launched as its
    # printed note says (examples/trl_train.py: the model loaded as the trial loaded it,
    # SFTTrainer wrapping it with peft itself), peaks where the trial of its winner measured.
    import json

    from autofit.export.launch import launch_note

    plan, trial = _exported(exported_plans, "trl")
    cfg = plan.best.config
    assert (cfg.launch, cfg.batching, cfg.train_embeddings) == ("trl", "packed", "full")
    paths = plan.export("trainer", tmp_path / "args.json")
    arguments = json.loads(paths[0].read_text())
    assert arguments["packing"] is True and arguments["packing_strategy"] == "bfd"
    assert arguments["activation_checkpointing"] is False  # SFTConfig's default is True
    assert arguments["max_length"] == 64
    assert arguments["model_init_kwargs"] == {"dtype": "bfloat16"}  # a LoRA base
    note = launch_note(plan, "trainer", tmp_path / "args.json")
    assert "trl_train.py --arguments" in note and "no autofit.apply" in note
    peaks_as_its_trial(ROOT / "examples" / "trl_train.py", paths, trial, tmp_path)


@pytest.mark.timeout(400)
def test_a_trl_qlora_export_trains_where_its_trial_peaked(exported_plans, tmp_path):
    # A plan for a TRL QLoRA script: its SFTConfig's model_init_kwargs hold the BitsAndBytesConfig
    # (a dict), and examples/trl_train.py hands SFTTrainer a saved model's path, which SFTTrainer
    # loads in 4 bits itself and wraps with peft (its adapters turned to bf16), as the trial did.
    import json

    from autofit.export.launch import launch_note

    plan, trial = _exported(exported_plans, "trl-qlora")
    cfg = plan.best.config
    assert (cfg.launch, cfg.quant, cfg.precision) == ("trl", "nf4", "bf16")  # bf16-mixed: refused
    paths = plan.export("trainer", tmp_path / "args.json")
    kwargs = json.loads(paths[0].read_text())["model_init_kwargs"]
    assert kwargs["quantization_config"]["load_in_4bit"] is True
    assert "no prepare_model_for_kbit_training" in paths[1].read_text()
    note = launch_note(plan, "trainer", tmp_path / "args.json")
    assert "trl_train.py --arguments" in note and "BitsAndBytesConfig" in note
    peaks_as_its_trial(ROOT / "examples" / "trl_train.py", paths, trial, tmp_path)
