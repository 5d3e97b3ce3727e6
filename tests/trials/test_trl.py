"""`launch: trl` on real CPU trials: TRL's `SFTTrainer.train()` runs the steps in the trial process
(the model from `from_config`, for QLoRA in bitsandbytes' 4 bits, LoRA wrapped by SFTTrainer's
own peft, the trainer export's `SFTConfig`: packing for `batching: packed`), measured as
autofit's own trials are (the tracked live tensor bytes), and its estimate, which counts TRL's
fused LM head and its padding-free packed rows (docs/estimator.md), is held to that peak within
1%."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from autofit.config import Config
from autofit.estimate import estimate
from autofit.hardware import cpu_hardware
from autofit.models import resolve_model
from autofit.trials import TrialResult, run_trials
from tests.trials.grouped import grouped_trials

pytest.importorskip("trl")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

BASE = {"seq_len": 64, "micro_batch": 2, "launch": "trl"}
TRIALS = {
    "lora-packed": {"lora_rank": 8, "batching": "packed"},  # two rows flattened into one
    "lora": {"lora_rank": 8},
    "full": {},
    # peft's bf16 copies of the embedding and head: the fused head makes the copy's fp32
    # gradient in its backward (-3.5% before that was counted)
    "lora-emb": {"lora_rank": 8, "train_embeddings": "full"},
}
QLORA = {"lora_rank": 8, "quant": "nf4", "quant_backend": "bitsandbytes", "precision": "bf16"}
if importlib.util.find_spec("bitsandbytes") is not None:  # a TRL QLoRA script's model
    TRIALS["qlora"] = QLORA
    TRIALS["qlora-double-quant-ckpt"] = {**QLORA, "bnb_4bit_use_double_quant": True,
                                         "checkpointing": "full"}  # fmt: skip
LENGTHS = {"seq_len": 128, "micro_batch": 2, "lora_rank": 8, "batching": "packed",
           "launch": "trl"}  # fmt: skip
STEPS, WARMUP = 2, 1
ERROR = 0.01
"""The bound held here: the trials measured +0.02% to +0.6%, QLoRA +0.07% and +0.09%
(docs/estimator.md)."""


@pytest.fixture(scope="module")
def trials() -> dict[str, TrialResult]:
    return grouped_trials(BASE, TRIALS, STEPS, WARMUP)


def test_trl_trials_run_sfttrainers_loop_for_every_step(trials) -> None:  # type: ignore[no-untyped-def]
    for name, result in trials.items():
        assert result.sharding == "none"
        # SFTTrainer logged a loss for every step it ran, warm-up included
        assert len(result.losses) == STEPS + WARMUP, (name, result.losses)
        assert result.losses[-1] < result.losses[0], (name, result.losses)
        assert result.step_time_s > 0 and result.tokens_per_s > 0


@pytest.mark.parametrize("name", list(TRIALS))
def test_trl_trial_is_within_one_percent_of_its_estimate(trials, name) -> None:  # type: ignore[no-untyped-def]
    spec = resolve_model("llama-debug")
    est = estimate(spec, cpu_hardware(1), Config(**BASE, **TRIALS[name]), device="cpu")
    measured = trials[name].peak_bytes
    assert abs(est.peak_bytes / measured - 1) < ERROR, (name, est.peak_bytes, measured,
                                                        dict(est.breakdown))  # fmt: skip


def test_trls_packing_flattens_the_micro_batch_and_the_estimate_counts_its_mask(trials) -> None:  # type: ignore[no-untyped-def]
    # padding-free: the two rows reach the model as one row of two documents, whose
    # block-diagonal mask SDPA is given; a padded row of one sequence has none
    assert trials["lora-packed"].peak_bytes > trials["lora"].peak_bytes
    spec, hw = resolve_model("llama-debug"), cpu_hardware(1)
    packed = estimate(spec, hw, Config(**BASE, **TRIALS["lora-packed"]), device="cpu")
    padded = estimate(spec, hw, Config(**BASE, **TRIALS["lora"]), device="cpu")
    assert packed.breakdown["activations"] > padded.breakdown["activations"]
    one = {**BASE, "micro_batch": 1, "lora_rank": 8}  # one row of one document: the same run
    assert (
        estimate(spec, hw, Config(**one, batching="packed"), device="cpu").peak_bytes
        == estimate(spec, hw, Config(**one), device="cpu").peak_bytes
    )


def test_trl_packs_a_length_file_itself_within_one_percent() -> None:
    # documents at the data's lengths, packed by SFTTrainer (best-fit decreasing, padding-free);
    # the micro-batch of the most tokens runs once the optimizer's state exists
    from autofit.data.read import read_length_file

    hist = read_length_file(Path(__file__).parents[2] / "examples" / "instruct_lengths.json")
    spec = resolve_model("llama-debug")
    cfg = Config(**LENGTHS)
    (result,) = run_trials(spec, [cfg], nprocs=1, device="cpu", steps=1, warmup=1,
                           timeout_s=240, lengths=hist)  # fmt: skip
    assert result.status == "ok", result.message[-800:]
    assert len(result.losses) == 3  # a warm-up, the fullest micro-batch's step, a measured one
    est = estimate(spec, cpu_hardware(1), cfg, device="cpu", lengths=hist)
    error = est.peak_bytes / result.peak_bytes - 1
    assert abs(error) < ERROR, (est.peak_bytes, result.peak_bytes, dict(est.breakdown))
