"""`launch: trainer` on real CPU trials: HF `Trainer.train()` runs the steps in the trial process
(the model from `from_config`, peft LoRA, the trainer export's `TrainingArguments`), measured as
autofit's own trials are (the tracked live tensor bytes), and its estimate is held to that peak
within the error the napkin states (`autofit.estimate.MEMORY_ERROR`, docs/accuracy.md)."""

from __future__ import annotations

import pytest

from autofit.config import Config
from autofit.estimate import MEMORY_ERROR, estimate
from autofit.hardware import cpu_hardware
from autofit.models import resolve_model
from autofit.trials import TrialResult, run_trial, run_trials
from tests.trials.grouped import grouped_trials

pytestmark = pytest.mark.slow

BASE = {"seq_len": 64, "micro_batch": 2}
TRIALS = {
    "lora": {"lora_rank": 8, "launch": "trainer"},
    "full": {"launch": "trainer"},
    "lora-ckpt": {"lora_rank": 8, "checkpointing": "full", "launch": "trainer"},
    "lora-autofit": {"lora_rank": 8},  # the same LoRA under autofit's own loop
    # peft's bf16 copies of the embedding and head beside fp32 adapters (counted as fp32
    # copies, as autofit's builder holds them, the estimate was +30.5% over this trial)
    "lora-emb": {"lora_rank": 8, "train_embeddings": "full", "grad_accum": 2, "launch": "trainer",
                 "checkpointing": "full"},
    # the rows of 8 token ids, which peft upcasts with the adapters (fp32 under bf16-mixed)
    "lora-tokens": {"lora_rank": 8, "train_embeddings": "tokens:8", "launch": "trainer"},
}  # fmt: skip
STEPS, WARMUP = 2, 1


@pytest.fixture(scope="module")
def trials() -> dict[str, TrialResult]:
    # in one launch, as a plan measures its candidates: each config starts from what a fresh
    # process holds (`autofit.trials.rank.release`)
    return grouped_trials(BASE, TRIALS, STEPS, WARMUP)


def test_trainer_trials_run_trainers_loop_for_every_step(trials) -> None:  # type: ignore[no-untyped-def]
    for name in ("lora", "full", "lora-ckpt"):
        result = trials[name]
        assert result.sharding == "none"
        # Trainer logged a loss for every step it ran (logging_steps=1), warm-up included
        assert len(result.losses) == STEPS + WARMUP, (name, result.losses)
        assert result.losses[-1] < result.losses[0], (name, result.losses)
        assert result.step_time_s > 0 and result.tokens_per_s > 0


def test_trainer_measures_what_trainer_does_differently(trials) -> None:  # type: ignore[no-untyped-def]
    # Trainer's model keeps peft's cast of each adapter's input to the adapters' fp32 (autofit's
    # builder switches it off), so under autocast each adapted projection saves a bf16 copy of
    # its input: the same LoRA peaks higher under Trainer than under autofit's loop
    assert trials["lora"].peak_bytes > trials["lora-autofit"].peak_bytes


@pytest.mark.parametrize("name", ["lora", "full", "lora-ckpt", "lora-emb", "lora-tokens"])
def test_trainer_trial_is_within_the_estimates_error(trials, name) -> None:  # type: ignore[no-untyped-def]
    spec = resolve_model("llama-debug")
    cfg = Config(**BASE, **TRIALS[name])
    est = estimate(spec, cpu_hardware(1), cfg, device="cpu")
    measured = trials[name].peak_bytes
    error = est.peak_bytes / measured - 1
    assert abs(error) < MEMORY_ERROR, (name, est.peak_bytes, measured, dict(est.breakdown))


LENGTH_FILE_CHECKPOINTING = ("none", "full")


def _length_file() -> dict:  # type: ignore[type-arg]
    from pathlib import Path

    from autofit.data.read import read_length_file

    return read_length_file(Path(__file__).parents[2] / "examples" / "instruct_lengths.json")


def _length_file_config(checkpointing: str) -> Config:
    return Config(seq_len=256, micro_batch=4, lora_rank=8, checkpointing=checkpointing,
                  launch="trainer")  # fmt: skip


@pytest.fixture(scope="module")
def length_file_trials() -> dict[str, TrialResult]:
    configs = [_length_file_config(c) for c in LENGTH_FILE_CHECKPOINTING]
    results = run_trials(resolve_model("llama-debug"), configs, nprocs=1, device="cpu", steps=1,
                         warmup=1, timeout_s=240, lengths=_length_file())  # fmt: skip
    return dict(zip(LENGTH_FILE_CHECKPOINTING, results, strict=True))


@pytest.mark.parametrize("checkpointing", LENGTH_FILE_CHECKPOINTING)
def test_trainer_trial_on_a_length_file_is_within_the_estimates_error(  # type: ignore[no-untyped-def]
    length_file_trials, checkpointing
) -> None:
    # padded micro-batches of the data's lengths (rows of different lengths): Trainer's collator
    # passes their attention mask, which transformers turns into a 4-D mask for SDPA
    # (`padding_mask_applies`); the trial runs the rows in the drawn order (the longest
    # micro-batch after the optimizer's state exists)
    result = length_file_trials[checkpointing]
    assert result.status == "ok", result.message[-800:]
    assert len(result.losses) == 3  # a warm-up, the longest micro-batch's step, a measured one
    cfg = _length_file_config(checkpointing)
    est = estimate(resolve_model("llama-debug"), cpu_hardware(1), cfg, device="cpu",
                   lengths=_length_file())  # fmt: skip
    error = est.peak_bytes / result.peak_bytes - 1
    assert abs(error) < MEMORY_ERROR, (est.peak_bytes, result.peak_bytes, dict(est.breakdown))


def test_a_trainer_trial_past_its_cap_is_an_oom() -> None:
    # the trial's cap holds inside Trainer's loop: the tracker's OOM is not swallowed by Trainer
    cfg = Config(**BASE, lora_rank=8, launch="trainer")
    result = run_trial(resolve_model("llama-debug"), cfg, nprocs=1, device="cpu", steps=1,
                       warmup=1, timeout_s=240, gpu_memory=12_000_000)  # fmt: skip
    assert result.status == "oom", result.message[-800:]
    assert "over the capacity of 12000000 bytes" in result.message


TWO_RANKS = {  # a Trainer or SFTTrainer script started by `torchrun --nproc-per-node 2`
    # a full fine-tune whose peak is the optimizer step (checkpointed, 32 tokens)
    "full": Config(seq_len=32, micro_batch=1, checkpointing="full", launch="trainer"),
    "lora-accum": Config(**BASE, lora_rank=8, grad_accum=2, launch="trainer"),
    "trl": Config(**BASE, lora_rank=8, launch="trl", precision="bf16-mixed"),
    "qlora": Config(
        **BASE, lora_rank=8, quant="nf4", quant_backend="bitsandbytes", launch="trainer"
    ),
    # the one candidate of `TWO_GPU_SPACE`, as its plan resolves it on two GPUs
    "lora": Config(**BASE, lora_rank=8, launch="trainer", wrap="none"),
}
TWO_GPU_SPACE = (
    "seq_len: 64\nlaunch: trainer\nknobs:\n  quant: [none]\n  lora_rank: [8]\n"
    "  micro_batch: [2]\n  checkpointing: [none]\n"
)


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, TrialResult]:
    spec = resolve_model("llama-debug")
    results = run_trials(spec, list(TWO_RANKS.values()), nprocs=2, device="cpu", steps=STEPS,
                         warmup=WARMUP, timeout_s=240)  # fmt: skip
    return dict(zip(TWO_RANKS, results, strict=True))


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_trainer_on_two_ranks_runs_ddp_within_the_estimates_error(two_ranks, name) -> None:  # type: ignore[no-untyped-def]
    # `wrap: auto` under launch=trainer/trl is DDP on several GPUs, as torchrun runs a Trainer
    # script: Accelerate wraps the model in DDP in every rank, Trainer's sampler deals the rows
    result = two_ranks[name]
    assert result.status == "ok", result.message[-800:]
    assert result.sharding == "ddp" and result.process_group
    assert len(result.losses) == STEPS + WARMUP and result.losses[-1] < result.losses[0]
    est = estimate(resolve_model("llama-debug"), cpu_hardware(2), TWO_RANKS[name], device="cpu")
    error = est.peak_bytes / result.peak_bytes - 1
    assert abs(error) < MEMORY_ERROR, (name, est.peak_bytes, result.peak_bytes, est.peak_phase)


def test_trainers_ddp_holds_each_gradient_twice(two_ranks) -> None:  # type: ignore[no-untyped-def]
    # Trainer's DDP is Accelerate's, without `gradient_as_bucket_view` (TrainingArguments cannot
    # set it), so each gradient is copied into an all-reduce bucket beside `.grad`. At the
    # optimizer step of the full fine-tune (bf16-mixed: fp32 params) every parameter holds 20 B:
    # its weight, its `.grad`, the bucket's copy and two AdamW moments; 16 B without the copy.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(resolve_model("llama-debug").to_hf_config())
    params = sum(p.numel() for p in model.parameters())
    peak = two_ranks["full"].peak_bytes
    assert params * 20 <= peak < params * 20 * 1.1, (params, peak, peak / params)


def test_a_two_gpu_trainer_export_runs_ddp_where_its_trial_peaked(two_ranks, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A plan for a Trainer script on two GPUs is DDP (`wrap: auto`); its trainer export,
    # started as its note says (torchrun, examples/trainer_train.py), peaks where the two-rank
    # trial of its winner did.
    import json
    import sys

    from autofit.export.launch import launch_note
    from autofit.hardware import resolve_hardware
    from autofit.plan import plan_estimates
    from autofit.request import PlanRequest
    from autofit.space_file import load_space
    from tests.example_runs import EXAMPLES, peaks_as_its_trial

    space = tmp_path / "lora_space.yaml"
    space.write_text(TWO_GPU_SPACE)
    plan = plan_estimates(PlanRequest.of(
        resolve_model("llama-debug"), resolve_hardware("2", device="cpu"), load_space(space),
        seq_len=64, device="cpu",
    ))  # fmt: skip
    assert plan.best is not None and plan.best.config.resolved(2) == TWO_RANKS["lora"]
    paths = plan.export("trainer", tmp_path / "args.json")
    assert json.loads(paths[0].read_text())["ddp_find_unused_parameters"] is False
    note = launch_note(plan, "trainer", tmp_path / "args.json")
    assert "(random weights): torchrun --nproc-per-node 2 " in note, note
    # `--standalone`: a free port of its own, beside the tests that run at the same time
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]  # fmt: skip
    peaks_as_its_trial(EXAMPLES / "trainer_train.py", paths, two_ranks["lora"], tmp_path, torchrun)
