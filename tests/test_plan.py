"""Estimate-only plans: prune what cannot fit, rank the rest, explain the winner."""

from __future__ import annotations

import dataclasses

import pytest

import autofit
from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.errors import HardwareError
from autofit.hardware import GPU, Hardware, resolve_gpus
from autofit.models import PRESETS
from autofit.plan import (
    Candidate,
    PruneReason,
    estimate_space,
    plan_estimates,
    prune_reason,
    rank_key,
    winner_reason,
)
from autofit.request import PlanRequest
from autofit.space_file import load_space
from tests.conftest import LLAMA_7B


def test_plan_picks_a_winner_that_fits_with_headroom(qlora_plan):
    best = qlora_plan.best
    assert best is not None and best is qlora_plan.ranked[0]
    assert best.estimate.within_capacity
    assert best.peak_bytes <= best.estimate.usable_bytes * (1 - qlora_plan.margin)
    assert best.config.quant == "nf4"


def test_every_ranked_candidate_fits_and_is_ordered(qlora_plan):
    keys = [rank_key(c) for c in qlora_plan.ranked]
    assert keys == sorted(keys)
    assert all(c.estimate.within_capacity for c in qlora_plan.ranked)


def test_pruned_and_fitting_add_up_to_considered(qlora_plan):
    assert len(qlora_plan.ranked) + sum(qlora_plan.pruned.values()) == qlora_plan.considered
    assert qlora_plan.considered == load_space("qlora").size_on(1)


def test_winner_reason_names_the_speed_of_all_gpus_and_the_runner_up(qlora_plan):
    n = qlora_plan.hardware.n_gpus
    assert f"tokens/s for all {n} GPUs together" in qlora_plan.reason
    assert "the runner-up '" in qlora_plan.reason


def test_estimate_space_splits_fitting_and_pruned():
    fitting, rejected, counts, considered = estimate_space(
        PlanRequest.of(LLAMA_7B, resolve_gpus("1xrtx3090"), load_space("full"))
    )
    # a full fine-tune of 7B fits 24 GB only with its model states on the host
    assert fitting and all(c.config.offload == "params" for c in fitting)
    assert counts[PruneReason.OVER_CAPACITY] > 0
    assert len(fitting) + len(rejected) + counts["quant needs LoRA"] <= considered


def test_global_batch_is_honoured_by_the_winner():
    plan = plan_estimates(
        PlanRequest.of(LLAMA_7B, resolve_gpus("2xrtx3090"), load_space("qlora"), global_batch=32)
    )
    cfg = plan.best.config
    assert cfg.micro_batch * cfg.grad_accum * 2 == 32


def test_bigger_margin_never_admits_more_candidates():
    hw, space = resolve_gpus("2xrtx3090"), load_space("qlora")
    small = plan_estimates(PlanRequest.of(LLAMA_7B, hw, space, margin=0.0))
    big = plan_estimates(PlanRequest.of(LLAMA_7B, hw, space, margin=0.3))
    assert len(big.ranked) <= len(small.ranked)


def test_nothing_fits_gives_advice_instead_of_a_winner():
    plan = plan_estimates(
        PlanRequest.of(PRESETS["llama-70b"], resolve_gpus("1xrtx3090"), load_space("full"))
    )
    assert plan.best is None and not plan.ranked
    assert "Nothing in space 'full' fits" in plan.advice
    assert "What would make it fit" in plan.advice
    # NF4 holds Llama-2-70B's 69e9 weights in 0.5 B each plus scales: over 32 GiB, more than the
    # 24 GiB card, so a QLoRA space would not fit either and is not proposed
    assert "--space qlora" not in plan.advice


def test_advice_on_the_datas_lengths_names_what_fits_on_them():
    # Llama-3.1-8B fully fine-tuned on one 22.5 GiB A10G at micro-batch 4 of seq_len 4096: the
    # nearest config offloads its 8e9 parameters' master weights, gradients and AdamW state
    # (about 60 GiB) to the 64 GiB host, more than the host can give. NF4 with LoRA leaves
    # little to offload, but at 4 x 4096 tokens its activations still overflow the card. The
    # data's longest example is 1024 tokens, so its longest micro-batch is 4 x 1024: a quarter
    # of the activations, and NF4 alone fits.
    data = LengthHistogram((256, 1024), (9, 1))
    full = load_space("full")
    space = dataclasses.replace(full, knobs={**full.knobs, "micro_batch": (4,)})
    hw = resolve_gpus("1xa10g")
    request = PlanRequest.of(PRESETS["llama-3.1-8b"], hw, space, seq_len=4096, lengths=data)
    plan = plan_estimates(request)
    assert plan.best is None
    nearest = Config(seq_len=4096, micro_batch=4, lora_rank=0, wrap="layer",
                     checkpointing="full", offload="params", precision="bf16")  # fmt: skip
    assert f"Nearest: '{nearest.short()}'" in plan.advice
    assert "a space with quant nf4 (--space qlora)" in plan.advice
    nf4 = nearest.replace(quant="nf4", lora_rank=16).to_dict()
    on_data = autofit.estimate("llama-3.1-8b", "1xa10g", lengths=data, **nf4)
    assert prune_reason(on_data, request.margin, hw) is None
    as_if_seq_len = autofit.estimate("llama-3.1-8b", "1xa10g", **nf4)
    assert prune_reason(as_if_seq_len, request.margin, hw) is not None


def test_gpus_without_bf16_are_pruned_with_that_reason():
    t4 = GPU(0, "Tesla T4", 15 * 1024**3, 65.0, 320.0, (7, 5))
    hw = Hardware((t4,), host_ram_bytes=64 * 1024**3, cpu_cores=8)
    plan = plan_estimates(PlanRequest.of(PRESETS["llama-debug"], hw, load_space("qlora")))
    assert plan.best is None
    assert plan.pruned[PruneReason.NO_BF16] > 0
    assert "no bf16 support" in plan.advice


def test_plain_config_wins_ties():
    plan = plan_estimates(PlanRequest.of(LLAMA_7B, resolve_gpus("8xh100-80gb"), load_space("lora")))
    best = plan.best.config
    tied = [c for c in plan.ranked if rank_key(c)[0] == rank_key(plan.best)[0]]
    from autofit.plan import complexity

    assert complexity(best) == min(complexity(c.config) for c in tied)


def test_plan_to_dict_has_best_and_pruned(qlora_plan):
    d = qlora_plan.to_dict()
    assert d["best"]["config"] == qlora_plan.best.config.to_dict()
    assert d["pruned"] == dict(qlora_plan.pruned)
    assert d["fitting"] == len(qlora_plan.ranked)
    assert d["n_params"] == 6_738_415_616


def test_candidate_falls_back_to_estimates_without_a_trial(qlora_plan):
    c = qlora_plan.best
    assert not c.measured
    assert c.tokens_per_s == c.estimate.tokens_per_s
    assert c.peak_bytes == c.estimate.peak_bytes
    assert isinstance(c.config, Config)


def test_gpu_memory_cap_never_raises_a_presets_capacity():
    with pytest.raises(HardwareError, match=r"more than the 24\.0 GiB .* RTX 3090"):
        resolve_gpus("1xrtx3090", gpu_memory=100 * 1024**3)
    assert resolve_gpus("1xrtx3090", gpu_memory=16 * 1024**3).capacity_bytes == 16 * 1024**3


def test_winner_reason_explains_faster_configs_that_failed_verification():
    from dataclasses import dataclass

    from autofit.estimate import estimate

    @dataclass
    class Measured:
        tokens_per_s: float
        peak_bytes: int = 10 * 1024**3
        step_time_s: float = 1.0
        status: str = "ok"
        measured: bool = True

    hw = resolve_gpus("1xrtx3090")
    model = PRESETS["llama-7b"]

    def cand(speed: float, **knobs) -> Candidate:
        cfg = Config(quant="nf4", lora_rank=16, **knobs)
        return Candidate(cfg, estimate(model, hw, cfg), trial=Measured(speed))

    best, faster, slower = cand(1000.0), cand(1500.0, micro_batch=4), cand(500.0, micro_batch=2)
    text = winner_reason(best, [faster, slower], hw, measured=True)
    assert "2.00x the measured tokens/s" in text
    assert "1 faster config(s)" in text and "failed verification" in text
    assert "ties" not in text
