"""`train_embeddings` on real CPU trials (gloo): LoRA with trainable copies of the embedding and
the LM head, on the plain module and under FSDP2 on two ranks, against the same runs without them.

The outside truth is the trial's measured peak (the tracked live tensor bytes). The estimate is
held to it within the error the napkin states (`autofit.estimate.MEMORY_ERROR`, docs/accuracy.md),
and the measured difference to a hand count of what the copies must add: each trained weight in
fp32 (4 B) with AdamW's two fp32 moments (8 B) is alive at every moment of a measured step; its
gradient (4 B) and a transient or two (autocast's bf16 copy, FSDP2's unsharded gradient) come on
top at some moments, never more than 8 B in all. The weights are split over the ranks.
"""

from __future__ import annotations

import pytest

from autofit.config import Config
from autofit.estimate import MEMORY_ERROR, estimate
from autofit.hardware import cpu_hardware
from autofit.models import resolve_model
from autofit.trials import TrialResult, run_trial
from tests.batch import run_grouped

pytestmark = pytest.mark.slow

BASE = {"lora_rank": 8, "seq_len": 64, "micro_batch": 1}
# name -> (model, ranks, knobs): each `train_embeddings` run beside the same run without it
TRIALS = {
    "plain": ("llama-debug", 1, {"wrap": "none"}),
    "plain-full": ("llama-debug", 1, {"wrap": "none", "train_embeddings": "full"}),
    "fsdp2": ("llama-debug", 2, {"wrap": "layer"}),
    "fsdp2-full": ("llama-debug", 2, {"wrap": "layer", "train_embeddings": "full"}),
    "fsdp2-tokens": ("llama-debug", 2, {"wrap": "layer", "train_embeddings": "tokens:8"}),
    # a head tied to the embedding (as Qwen2.5-0.5B, Gemma): one trained copy, not two
    "tied-fsdp2": ("qwen2-debug", 2, {"wrap": "layer"}),
    "tied-fsdp2-full": ("qwen2-debug", 2, {"wrap": "layer", "train_embeddings": "full"}),
}


def config(name: str) -> Config:
    return Config(**BASE, **TRIALS[name][2])


@pytest.fixture(scope="module")
def trials() -> dict[str, TrialResult]:
    # The plain module's trials share a launch (its peak is the same bytes alone or after
    # another). An FSDP2 trial runs first in a launch of its own: run second in a launch after
    # fsdp2, fsdp2-full once measured 16.56 MiB (12.6% above the estimate, 6.19 MiB above
    # fsdp2, more than the hand count below allows; gloo's timing moves when the unsharded
    # buffers are freed), where its launches of its own stay within the 10%.
    kw = {"device": "cpu", "steps": 1, "warmup": 1, "timeout_s": 240}
    named = {name: (model, ranks, config(name)) for name, (model, ranks, _) in TRIALS.items()}
    out = run_grouped({n: t for n, t in named.items() if t[1] == 1}, **kw)
    for name, (model, ranks, cfg) in named.items():
        if ranks > 1:
            out[name] = run_trial(resolve_model(model), cfg, nprocs=ranks, **kw)
    for name, result in out.items():
        assert result.status == "ok", f"{name}: {result.message[-500:]}"
        assert result.losses[-1] < result.losses[0], name
    return out


def error(name: str, result: TrialResult) -> float:
    model, ranks, _ = TRIALS[name]
    est = estimate(resolve_model(model), cpu_hardware(ranks), config(name), device="cpu")
    return est.peak_allocated_bytes / result.peak_bytes - 1


@pytest.mark.parametrize("name", [n for n in TRIALS if "-" in n and n != "tied-fsdp2"])
def test_the_estimate_holds_the_measured_peak(trials, name):
    assert abs(error(name, trials[name])) <= MEMORY_ERROR, (
        f"{name}: measured {trials[name].peak_bytes / 2**20:.2f} MiB, "
        f"estimate off by {error(name, trials[name]):+.1%}"
    )


@pytest.mark.parametrize(
    ("name", "without", "copies"),
    [
        ("plain-full", "plain", 2),  # embedding and head: two vocab x hidden copies
        ("fsdp2-full", "fsdp2", 2),
        ("tied-fsdp2-full", "tied-fsdp2", 1),  # the tied head's copy is the embedding's
    ],
)
def test_the_copies_cost_what_a_hand_count_says(trials, name, without, copies):
    model, ranks, _ = TRIALS[name]
    spec = resolve_model(model)
    per_rank = copies * spec.vocab * spec.hidden / ranks  # trained parameters a rank holds
    extra = trials[name].peak_bytes - trials[without].peak_bytes
    assert (4 + 8) * per_rank <= extra <= (4 + 8 + 4 + 8) * per_rank, (
        f"{name}: {extra / 2**20:.2f} MiB more than {without}, for {per_rank:,.0f} trained "
        "parameters per rank"
    )


# How far two launches of the same LoRA run under FSDP2 on llama-debug measured apart (gloo's
# timing moves which all-gather buffers coexist): 18.7 and 19.6 MiB (docs/accuracy.md, section
# 1), and 0.56 MiB between the fsdp2 and fsdp2-tokens runs of two CI runs on 2026-11-26.
FSDP2_SPREAD = 1.0 * 2**20


def test_a_few_trained_rows_cost_little(trials):
    # tokens:8 trains 8 rows of each 1,024-row weight: far less than copies of the weights (it
    # adds peft's merged weight of the head, saved for backward, vocab x hidden in bf16: 128 KiB,
    # inside the runs' spread, so only the upper bounds tell)
    spec = resolve_model("llama-debug")
    extra = trials["fsdp2-tokens"].peak_bytes - trials["fsdp2"].peak_bytes
    assert -FSDP2_SPREAD < extra < 2 * spec.vocab * spec.hidden * 2  # under two bf16 weights
    assert extra < (trials["fsdp2-full"].peak_bytes - trials["fsdp2"].peak_bytes) / 4
