"""The whole napkin estimate: breakdown sums, sharding rules, the sanity bars users know."""

from __future__ import annotations

import itertools
import random

import pytest

from autofit.arch import structure_of
from autofit.config import Config
from autofit.errors import ConfigError
from autofit.estimate import BREAKDOWN_KEYS, estimate, estimate_many
from autofit.estimate import memory as mem
from autofit.hardware import resolve_gpus, resolve_hardware
from autofit.models import PRESETS, resolve_model
from autofit.space_file import parse_space
from tests.conftest import LLAMA_7B, GiB

N_7B = 6_738_415_616

QLORA = dict(quant="nf4", lora_rank=64, micro_batch=1, seq_len=2048, checkpointing="full")


def est(model: str, gpus: str, **knobs):  # type: ignore[no-untyped-def]
    return estimate(PRESETS[model], resolve_gpus(gpus), Config(**knobs))


# ----- sanity bars ------------------------------------------------------------------------------
def test_full_fine_tune_of_llama_7b_does_not_fit_one_h100():
    e = est("llama-7b", "1xh100-80gb", checkpointing="full")
    assert not e.within_capacity
    assert e.peak_bytes > 16 * N_7B  # model states alone are 16 B/param, ~108 GB


def test_full_fine_tune_of_llama_7b_fits_eight_h100s():
    e = est("llama-7b", "8xh100-80gb", micro_batch=1, seq_len=2048)
    assert e.within_capacity
    assert e.peak_bytes < e.usable_bytes


def test_qlora_llama_7b_fits_one_rtx3090():
    e = est("llama-7b", "1xrtx3090", **QLORA)
    assert e.within_capacity
    assert e.capacity_bytes == 24 * GiB
    assert e.peak_bytes < 16 * GiB  # QLoRA 7B at 2k tokens is comfortably under 24 GB


def test_the_readme_example_estimate_fits_two_rtx3090s():
    e = est("llama-7b", "2xrtx3090", **{**QLORA, "micro_batch": 8})
    assert e.within_capacity and e.n_gpus == 2


# ----- breakdown --------------------------------------------------------------------------------
CONFIGS = [
    {},
    {"checkpointing": "full", "grad_accum": 4},
    {"quant": "nf4", "lora_rank": 64, "micro_batch": 4, "checkpointing": "selective"},
    {"quant": "int8", "lora_rank": 16, "wrap": "every-2", "reshard": False},
    {"lora_rank": 16, "offload": "optimizer", "optimizer": "adamw8bit", "precision": "bf16"},
    {"offload": "params", "wrap": "model", "optimizer": "adamw4bit"},
    {"wrap": "none", "grad_accum": 2, "checkpointing": "every-2"},
]


@pytest.mark.parametrize("gpus", ["1xrtx3090", "2xa100-40gb", "8xh100-80gb"])
@pytest.mark.parametrize("knobs", CONFIGS, ids=lambda k: Config(**k).short())
def test_breakdown_sums_to_the_allocated_peak(gpus, knobs):
    e = est("llama-7b", gpus, **knobs)
    assert tuple(e.breakdown) == BREAKDOWN_KEYS
    assert all(v >= 0 for v in e.breakdown.values())
    assert sum(e.breakdown.values()) == e.peak_allocated_bytes
    assert e.peak_bytes == e.peak_allocated_bytes + e.overhead["allocator"]
    assert e.usable_bytes == e.capacity_bytes - e.overhead["cuda_context"] - e.overhead["nccl"]
    assert e.device_bytes == e.peak_bytes + e.overhead["cuda_context"] + e.overhead["nccl"]
    assert e.within_capacity == (
        e.peak_bytes <= e.usable_bytes and e.host_bytes <= 0.8 * e.host_capacity_bytes
    )


def test_cpu_device_counts_tensor_bytes_only():
    e = estimate(LLAMA_7B, resolve_gpus("1xrtx3090"), Config(**QLORA), device="cpu")
    assert e.overhead == {"allocator": 0, "cuda_context": 0, "nccl": 0}
    assert e.breakdown["workspace"] == 0
    assert e.device_bytes == e.peak_bytes
    assert e.peak_bytes == e.peak_allocated_bytes
    assert e.usable_bytes == e.capacity_bytes


def test_full_fine_tune_model_states_are_16_bytes_per_param_sharded():
    for n in (1, 8):
        e = est("llama-7b", f"{n}xh100-80gb", checkpointing="full")
        b = e.breakdown
        assert b["trainable_weights"] == pytest.approx(4 * N_7B / n, abs=1)
        assert b["optimizer_state"] == pytest.approx(8 * N_7B / n, abs=1)


def test_lora_trains_only_the_adapters():
    e = est("llama-7b", "1xrtx3090", **QLORA)
    lora = 159_907_840
    assert e.breakdown["trainable_weights"] == 4 * lora
    assert e.breakdown["optimizer_state"] == 8 * lora


def test_nf4_base_is_sharded_across_gpus():
    one = est("llama-7b", "1xa100-80gb", **QLORA).breakdown["base_weights"]
    four = est("llama-7b", "4xa100-80gb", **QLORA).breakdown["base_weights"]
    assert four == pytest.approx(one / 4, abs=1)


def test_int8_base_is_replicated_not_divided_by_gpus():
    knobs = {**QLORA, "quant": "int8"}
    one = est("llama-7b", "1xa100-80gb", **knobs).breakdown["base_weights"]
    four = est("llama-7b", "4xa100-80gb", **knobs).breakdown["base_weights"]
    int8 = mem.base_weight_bytes(structure_of(LLAMA_7B), "int8")
    others = mem.frozen_other_bytes(structure_of(LLAMA_7B))
    assert one == pytest.approx(int8 + others, abs=1)
    assert four == pytest.approx(int8 + others / 4, abs=1)  # only the bf16 rest is sharded
    assert four > one / 2


LLAMA_7B_LAYER = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096  # one decoder layer, by hand


def test_offload_params_moves_model_states_to_the_host():
    on_gpu = est("llama-7b", "8xh100-80gb", checkpointing="full")
    off = est("llama-7b", "8xh100-80gb", checkpointing="full", offload="params")
    for part in ("base_weights", "trainable_weights", "optimizer_state"):
        assert off.breakdown[part] == 0
    # gradients are made on the GPU, one unit at a time, before they go to the host: at most one
    # layer's bf16 + fp32 copies (6 B per parameter of 4h^2 + 3hi + 2h)
    assert off.breakdown["gradients"] <= 6 * LLAMA_7B_LAYER
    # all ranks together hold fp32 params 4 + grads 4 + AdamW 8 = 16 B per parameter
    assert off.host_bytes == pytest.approx(16 * N_7B, rel=1e-9)
    assert on_gpu.host_bytes == 0
    assert off.peak_bytes < on_gpu.peak_bytes


def test_offload_optimizer_moves_optimizer_state_to_the_host():
    e = est("llama-7b", "8xh100-80gb", checkpointing="full", offload="optimizer")
    assert e.breakdown["optimizer_state"] == 0
    assert e.breakdown["trainable_weights"] > 0
    assert e.host_bytes >= 8 * N_7B  # at least the AdamW states


def test_grad_accum_under_fsdp_keeps_unsharded_fp32_gradients():
    one = est("llama-7b", "8xh100-80gb", micro_batch=1)
    accum = est("llama-7b", "8xh100-80gb", micro_batch=1, grad_accum=2)
    # without accumulation only the unit in its backward holds unsharded gradients
    assert one.breakdown["gradients"] <= 6 * LLAMA_7B_LAYER or one.peak_phase == "optimizer"
    extra = accum.peak_allocated_bytes - one.peak_allocated_bytes
    # unsharded (not / 8) fp32 gradients of every trainable parameter
    assert extra >= 4 * N_7B * 0.99
    assert accum.breakdown["gradients"] >= 4 * N_7B


def test_grad_accum_raises_tokens_per_step_not_memory_per_micro_step():
    one = est("llama-7b", "1xrtx3090", **QLORA)
    four = est("llama-7b", "1xrtx3090", **{**QLORA, "grad_accum": 4})
    assert four.step_time_s > one.step_time_s
    assert four.breakdown["activations"] == one.breakdown["activations"]


def test_tokens_per_s_is_tokens_per_step_over_step_time():
    e = est("llama-7b", "2xrtx3090", **{**QLORA, "micro_batch": 4, "grad_accum": 2})
    assert e.tokens_per_s == pytest.approx(4 * 2 * 2 * 2048 / e.step_time_s)
    assert e.step_time_s == pytest.approx(sum(e.time_breakdown.values()))
    assert all(v >= 0 for v in e.time_breakdown.values())


def test_checkpointing_lowers_the_estimated_peak_and_costs_time():
    peaks = {
        c: est("llama-7b", "8xh100-80gb", micro_batch=4, checkpointing=c)
        for c in ("none", "every-2", "full", "selective")
    }
    assert peaks["full"].peak_bytes < peaks["every-2"].peak_bytes < peaks["none"].peak_bytes
    assert peaks["selective"].peak_bytes < peaks["none"].peak_bytes
    assert peaks["full"].step_time_s > peaks["none"].step_time_s


def test_to_dict_has_the_json_contract_fields():
    d = est("llama-7b", "1xrtx3090", **QLORA).to_dict()
    for key in (
        "peak_bytes",
        "peak_allocated_bytes",
        "capacity_bytes",
        "fits",
        "breakdown",
        "step_time_s",
        "tokens_per_s",
    ):
        assert key in d
    assert d["config"]["quant"] == "nf4"


# ----- monotonicity over a grid -----------------------------------------------------------------
GRID = list(
    itertools.product(
        [("none", 0), ("none", 16), ("int8", 16), ("nf4", 64)],
        ["layer", "every-2", "model", "none"],
        [True, False],
        ["none", "optimizer", "params"],
        ["adamw", "adamw8bit"],
        ["bf16-mixed", "bf16"],
        [1, 4],
    )
)
HARDWARE = ["1xrtx3090", "2xa100-40gb", "8xh100-80gb"]
MODELS = ["tinyllama-1.1b", "llama-7b", "llama-3-8b"]


def _grid_configs(**fixed):  # type: ignore[no-untyped-def]
    for (quant, rank), wrap, reshard, offload, opt, prec, ga in GRID:
        base = dict(
            quant=quant,
            lora_rank=rank,
            wrap=wrap,
            reshard=reshard,
            offload=offload,
            optimizer=opt,
            precision=prec,
            grad_accum=ga,
            seq_len=2048,  # the shipped spaces': the presets' traces ship in the package
        )
        base.update(fixed)
        try:
            yield Config(**base)
        except ConfigError:
            continue  # combinations the rules forbid


@pytest.fixture
def no_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of single-config estimates: each would replay its step through the allocator
    model (tens of ms); these properties are of the napkin's terms, so no replay runs."""
    import importlib

    monkeypatch.setattr(importlib.import_module("autofit.estimate"), "REPLAY_BUDGET_EVENTS", 0)
    monkeypatch.setattr(importlib.import_module("autofit.estimate.peak"), "_REPLAYS", {})


@pytest.mark.usefixtures("no_replays")
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("gpus", HARDWARE)
def test_larger_micro_batch_never_lowers_the_estimate(model, gpus):
    spec, hw = PRESETS[model], resolve_gpus(gpus)
    checked = grew = 0
    for ckpt in ("none", "full", "every-2", "selective"):
        for cfg in _grid_configs(checkpointing=ckpt):
            ests = [estimate(spec, hw, cfg.replace(micro_batch=mb)) for mb in (1, 2, 4, 8)]
            allocated = [e.peak_allocated_bytes for e in ests]
            assert allocated == sorted(allocated), cfg.short()
            peaks = [e.peak_bytes for e in ests]
            assert peaks == sorted(peaks), cfg.short()
            checked += 1
            grew += peaks[0] < peaks[-1]  # equal only when the optimizer-step peak dominates
    assert checked > 500 and grew > checked // 2


@pytest.mark.usefixtures("no_replays")
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("gpus", HARDWARE)
def test_less_checkpointing_never_lowers_the_estimate(model, gpus):
    spec, hw = PRESETS[model], resolve_gpus(gpus)
    checked = 0
    for cfg in _grid_configs(micro_batch=2):
        peak = {
            c: estimate(spec, hw, cfg.replace(checkpointing=c)).peak_bytes
            for c in ("full", "every-2", "none")
        }
        assert peak["full"] <= peak["every-2"] <= peak["none"], cfg.short()
        if not cfg.is_lora:
            sel = estimate(spec, hw, cfg.replace(checkpointing="selective")).peak_bytes
            assert sel <= peak["none"], cfg.short()
        checked += 1
    assert checked > 100


@pytest.mark.usefixtures("no_replays")
@pytest.mark.parametrize("gpus", HARDWARE)
def test_longer_sequences_never_lower_the_estimate(gpus):
    hw = resolve_gpus(gpus)
    for cfg in _grid_configs(micro_batch=1, checkpointing="full"):
        peaks = [estimate(LLAMA_7B, hw, cfg.replace(seq_len=s)).peak_bytes for s in (512, 2048)]
        assert peaks[0] <= peaks[1], cfg.short()


def test_more_gpus_never_raise_a_sharded_full_fine_tune_estimate():
    cfg = Config(checkpointing="full", micro_batch=2)
    peaks = [
        estimate(LLAMA_7B, resolve_gpus(f"{n}xa100-80gb"), cfg).peak_bytes for n in (1, 2, 4, 8)
    ]
    assert peaks == sorted(peaks, reverse=True)


# ----- a batch ----------------------------------------------------------------------------------
# Every knob at two values or more (LoRA at one rank, so the layer traces are few).
BATCH_SPACE = {
    "seq_len": 256,
    "knobs": {
        "quant": ["none", "nf4"], "lora_rank": [16], "micro_batch": [1, 2], "grad_accum": [1, 2],
        "wrap": ["layer", "model", "none"], "reshard": [True, False],
        "checkpointing": ["none", "full"], "offload": ["none", "optimizer", "params"],
        "optimizer": ["adamw", "adamw8bit"], "precision": ["bf16-mixed", "bf16"],
        "loss": ["standard", "chunked"], "compile": [False, True],
    },
}  # fmt: skip


@pytest.mark.usefixtures("no_replays")
@pytest.mark.parametrize("gpus, device", [("1xrtx3090", "cuda"), ("2", "cpu")])
def test_a_batch_estimates_each_config_as_it_would_alone(gpus, device):
    """`estimate_many` computes each group of terms once per value of the knobs it reads (the
    peak once per value of every knob but `compile`, the step time of every knob but `loss`): a
    term that came to read a knob its group is not keyed by would hand one config another's
    numbers. (Without replays: a batch derives the slack of the configs it does not replay from
    those it does, `test_a_batch_replays_the_configs_nearest_the_capacity_line`.)"""
    hw = resolve_hardware(gpus, device=device, gpu_memory="30MiB" if device == "cpu" else None)
    configs, _ = parse_space(BATCH_SPACE, "test").candidates(hw.n_gpus, device=device)
    # in the space's order (neighbours share entries, past a memo's size), then in any order
    configs += random.Random(0).sample(configs, len(configs))
    spec = PRESETS["llama-debug"]
    batch = estimate_many(spec, hw, configs, device=device)
    alone = [estimate(spec, hw, c, device=device) for c in configs]
    assert [e.to_dict() for e in batch] == [e.to_dict() for e in alone]


def test_device_level_parts_are_counted_from_their_sources():
    """What sits beside the tensors, by hand from each part's documented size: cuBLAS keeps an
    8 MiB + 128 KiB workspace per handle before Hopper (32 MiB on 9.0) and cuBLASLt 1 MiB, for
    the forward's and the autograd engine's handles (torch CublasHandlePool.cpp), inside the
    allocator; NCCL keeps 4 MiB + 4,915,200 B + 524,288 B per channel (src/init.cc), 32 channels
    over NVLink, outside it, and the communicator's own 48 MiB (its kernels and device state: what
    a one-rank group held on the H200 beyond its 512 MiB buffer, 2026-11-28), and none on one
    GPU."""
    one = est("llama-7b", "1xa100-80gb", lora_rank=16)
    assert one.breakdown["workspace"] == 2 * (8 * 2**20 + 128 * 2**10 + 2**20)
    assert one.overhead["nccl"] == 0
    eight = est("llama-7b", "8xh100-80gb", lora_rank=16)
    assert eight.breakdown["workspace"] == 2 * (32 * 2**20 + 2**20)
    assert eight.overhead["nccl"] == 32 * (4 * 2**20 + 4_915_200 + 524_288) + 48 * 2**20
    assert (
        eight.device_bytes
        == eight.peak_bytes + eight.overhead["cuda_context"] + (eight.overhead["nccl"])
    )


def test_foreach_adamw_holds_a_parameter_sized_temporary_at_the_step():
    """torch's foreach AdamW (HF Trainer's adamw_torch) takes `_foreach_sqrt` of every moment at
    once: llama-7b full fine-tune in pure bf16 on one GPU holds 2 B per parameter more at the
    optimizer step than fused AdamW (6,738,415,616 x 2 B)."""
    knobs = dict(precision="bf16", checkpointing="full", wrap="none")
    fused = est("llama-7b", "1xh200", **knobs)
    spec, hw = resolve_model("llama-7b"), resolve_gpus("1xh200")
    foreach = estimate(spec, hw, Config(**knobs, optimizer_impl="foreach"))
    assert fused.peak_phase == foreach.peak_phase == "optimizer"
    assert foreach.peak_allocated_bytes - fused.peak_allocated_bytes == pytest.approx(
        N_7B * 2, abs=4
    )
    # torch 2.0's step kept `exp_avg_sq_sqrt` and `denom` alive together (pytorch#97712): 4 B
    torch20 = estimate(spec, hw, Config(**knobs, optimizer_impl="foreach"), foreach_intermediates=2)
    assert torch20.peak_allocated_bytes - fused.peak_allocated_bytes == pytest.approx(
        N_7B * 4, abs=4
    )
    # the for-loop holds two intermediates the size of the largest tensor (the 32,000 x 4,096
    # embedding or head), in turn: 2 x 131,072,000 x 2 B
    loop = estimate(spec, hw, Config(**knobs, optimizer_impl="for-loop"))
    assert loop.peak_allocated_bytes - fused.peak_allocated_bytes == pytest.approx(
        2 * 32000 * 4096 * 2, abs=4
    )


def test_the_adamw_implementation_moves_a_cpu_trials_step_by_the_hand_count():
    """The estimate of the CPU trials `test_against_trials` measures (wide-vocab, full fine-tune,
    fp32 masters, plain module) at torch 2.13's step, read by hand from torch/optim/adam.py:
    fused none; foreach one fp32 tensor the size of all 9,176,320 parameters (2 layers of
    393,728, the embedding and head 16,384 x 256 each, the final norm 256): 36,705,280 B; the
    for-loop, torch's choice on CPU (`auto`), two the size of the 16,384 x 256 embedding:
    33,554,432 B."""
    from autofit.hardware import cpu_hardware
    from tests.estimate.measured import WIDE_VOCAB

    def peak(impl: str) -> int:
        cfg = Config(wrap="none", seq_len=64, micro_batch=1, optimizer_impl=impl)
        e = estimate(WIDE_VOCAB, cpu_hardware(1), cfg, device="cpu")
        assert e.peak_phase == "optimizer"
        return e.peak_allocated_bytes

    fused = peak("fused")
    assert peak("foreach") - fused == 36_705_280
    assert peak("for-loop") - fused == peak("auto") - fused == 33_554_432


def test_a_batch_replays_the_configs_nearest_the_capacity_line():
    """In a batch, the configs whose allocated peak lies near the capacity line have their step
    replayed through the allocator model (their slack is the one `estimate` gives them alone);
    the others take the slack share of a replayed config of their group."""
    hw = resolve_gpus("1xrtx3090")
    configs = [Config(lora_rank=16, quant="nf4", wrap="none", checkpointing="full",
                      micro_batch=mb, seq_len=2048) for mb in (1, 2, 4, 8, 16)]  # fmt: skip
    batch = estimate_many(LLAMA_7B, hw, configs)
    alone = [estimate(LLAMA_7B, hw, c) for c in configs]
    usable = batch[0].usable_bytes
    share = [e.peak_allocated_bytes / usable for e in batch]
    near = [i for i, x in enumerate(share) if 0.5 <= x <= 1.3]
    assert near, share
    nearest = min(near, key=lambda i: abs(share[i] - 0.95))  # replayed first, whatever the budget
    assert batch[nearest].allocator_slack_bytes == alone[nearest].allocator_slack_bytes
    for e in batch:
        assert 0 < e.allocator_slack_bytes < 0.25 * e.peak_allocated_bytes


def test_twins_with_one_peak_keep_their_own_slack_in_a_batch_in_either_order():
    """A full fine-tune peaks at the optimizer step, where the loss holds nothing: its standard-
    and chunked-loss twins have the same allocated peak, but the standard loss's tensors left
    other holes in the allocator (tinyllama-1.1b bf16 `ckpt=full` on a 24 GiB card: two replays,
    two slacks). A batch of the two, in either order, gives each the slack `estimate` gives it
    alone, not the slack of whichever twin came first or last."""
    hw = resolve_gpus("1xrtx4090")
    spec = PRESETS["tinyllama-1.1b"]
    twins = [Config(wrap="none", checkpointing="full", precision="bf16", seq_len=2048, loss=loss)
             for loss in ("standard", "chunked")]  # fmt: skip
    alone = [estimate(spec, hw, c).allocator_slack_bytes for c in twins]
    assert alone[0] != alone[1]
    assert [e.peak_allocated_bytes for e in estimate_many(spec, hw, twins)] == [
        estimate(spec, hw, c).peak_allocated_bytes for c in twins
    ]
    for order in (twins, twins[::-1]):
        batch = estimate_many(spec, hw, order)
        assert [e.allocator_slack_bytes for e in batch] == [alone[twins.index(c)] for c in order]


def test_a_batch_replays_the_nearest_config_of_each_loss_and_keeps_their_shares_apart():
    """The standard loss's tensors over the whole batch's vocabulary leave holes the chunked
    loss never makes, so a batch replays the config nearest the capacity line of each loss (its
    slack the one `estimate` gives it alone, whatever the budget) and a config takes the slack
    share of replayed configs of its own loss: llama-3-8b's 128K vocabulary on a 24 GiB H200
    (the H200 rows of bench/gpu_rows.py), where a chunked config's slack is below its standard
    twin's at every micro-batch."""
    hw = resolve_gpus("1xh200", 24 * GiB)
    knobs = dict(lora_rank=16, quant="nf4", wrap="none", checkpointing="full", seq_len=2048)
    configs = [Config(micro_batch=mb, loss=loss, **knobs)
               for loss in ("standard", "chunked") for mb in (1, 2, 4, 8, 16)]  # fmt: skip
    spec = PRESETS["llama-3-8b"]
    batch = estimate_many(spec, hw, configs)
    alone = [estimate(spec, hw, c) for c in configs]
    share = [e.peak_allocated_bytes / e.usable_bytes for e in batch]
    for loss in ("standard", "chunked"):
        mine = [i for i, c in enumerate(configs) if c.loss == loss]
        nearest = min(mine, key=lambda i: abs(share[i] - 0.95))
        assert batch[nearest].allocator_slack_bytes == alone[nearest].allocator_slack_bytes
    for standard, chunked in zip(batch[:5], batch[5:], strict=True):
        assert chunked.allocator_slack_bytes < standard.allocator_slack_bytes


def test_a_step_that_offloads_its_parameters_stands_not_for_one_that_keeps_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under `offload: params` each unit's gradients leave the GPU at its reduce and no sharded
    gradient stays, so its replay leaves few holes (llama-3-8b NF4 r64 on a 24 GiB card: 0.3% of
    its allocated peak), where a step that keeps its gradients leaves many (the H200 rows without
    offload: reserved 6-10% above allocated, `bench/gpu_rows.py`). With the budget spent by the
    first replay, a batch still replays the nearest config of each kind: a LoRA config below the
    line keeps the slack `estimate` gives it alone, not the offloading config's share."""
    import importlib

    hw, spec = resolve_gpus("1xrtx4090"), PRESETS["llama-3-8b"]
    offloads = Config(quant="nf4", lora_rank=64, wrap="model", reshard=False, offload="params",
                      seq_len=2048)  # fmt: skip
    keeps = Config(lora_rank=16, wrap="none", checkpointing="full", precision="bf16", seq_len=2048)
    alone = [estimate(spec, hw, c) for c in (offloads, keeps)]
    share = [e.peak_allocated_bytes / e.usable_bytes for e in alone]
    assert abs(share[0] - 0.95) < abs(share[1] - 0.95)  # the offloading config is replayed first
    ratio = [e.allocator_slack_bytes / e.peak_allocated_bytes for e in alone]
    assert ratio[0] < 0.01 < ratio[1]
    monkeypatch.setattr(importlib.import_module("autofit.estimate"), "REPLAY_BUDGET_EVENTS", 1)
    batch = estimate_many(spec, hw, [offloads, keeps])
    assert [e.allocator_slack_bytes for e in batch] == [e.allocator_slack_bytes for e in alone]


def test_train_embeddings_cost_their_trained_weights():
    """llama-7b LoRA with `train_embeddings: full` trains fp32 copies of its embedding and head,
    2 x 32,000 x 4,096 = 262,144,000 parameters (the model card's vocabulary and width) beside the
    frozen originals: every moment of a step holds at least their weights and AdamW's two moments
    more (12 B each), and a step is slower (the head's weight gradient, a larger optimizer step).
    `tokens:N` trains N rows of each (and peft merges them into a bf16 copy of the head's weight
    at each forward): far less."""
    from autofit.estimate import speed as spd

    copies = 2 * 32_000 * 4_096
    knobs = dict(lora_rank=16, wrap="none", seq_len=2048, checkpointing="full")
    lora = est("llama-7b", "1xh200", **knobs)
    full = est("llama-7b", "1xh200", **knobs, train_embeddings="full")
    rows = est("llama-7b", "1xh200", **knobs, train_embeddings="tokens:16")
    extra = full.peak_allocated_bytes - lora.peak_allocated_bytes
    assert extra >= 12 * copies
    assert 0 < rows.peak_allocated_bytes - lora.peak_allocated_bytes < extra / 4
    assert full.step_time_s > lora.step_time_s
    s = structure_of(resolve_model("llama-7b"))
    times = {
        value: spd.micro_step_times(s, 2048, 2048, 16, None, "full", 7e14, 3e12, value)["compute"]
        for value in ("none", "full")
    }
    full_ft = spd.micro_step_times(s, 2048, 2048, 0, None, "full", 7e14, 3e12)["compute"]
    assert times["none"] < times["full"] < full_ft  # the head's weight gradient, not the layers'


def test_an_unknown_optimizer_implementation_is_one_clear_error():
    from autofit.errors import ConfigError

    with pytest.raises(ConfigError, match="optimizer_impl' cannot be 'apex'.*; fused; foreach = "):
        Config(optimizer_impl="apex")
    with pytest.raises(ConfigError, match="foreach_intermediates must be a whole number"):
        estimate(LLAMA_7B, resolve_gpus("1xh200"), Config(), foreach_intermediates=-1)
