"""The napkin step time against figures from outside it: torchtitan's published Llama 3.1 8B
throughput on H100s, and the order of CPU trials measured on this project's machine."""

from __future__ import annotations

import dataclasses

import pytest

from autofit.config import Config
from autofit.estimate import TIME_KEYS, estimate
from autofit.estimate.speed import TIME_KEYS as SPEED_TIME_KEYS
from autofit.hardware import Hardware, resolve_gpus, resolve_hardware
from autofit.models import resolve_model

# ----- published: torchtitan, Llama 3.1 8B, FSDP, on H100s ----------------------------------------
# pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf), Tables 1 and 3:
# Llama 3.1 8B, 1D FSDP, local batch 2, seq 8192 (torchtitan's default for these runs), selective
# activation checkpointing, tokens/s per GPU. (GPUs, torch.compile, TPS/GPU):
TORCHTITAN_LLAMA3_8B = (
    (8, False, 5_762),
    (8, True, 6_667),
    (128, False, 5_605),
    (128, True, 6_514),
)
# Its hardware: Grand Teton hosts of 8 H100s on NVLink, each GPU 96 GB HBM2e at 2.4 TB/s, 500 W
# power limit, "actual peak TFLOPs between SXM and NVL" (footnote 2): the midpoint of the dense
# bf16 datasheet figures, SXM 989 and NVL 835, is taken. Hosts talk over 400 Gb/s RDMA per GPU
# (50 GB/s), the slowest link of a 128-GPU ring.
TITAN_TFLOPS = (989 + 835) / 2
TITAN_HBM_GBS = 2400.0
TITAN_INTER_HOST_GBS = 50.0


def titan_hardware(n: int) -> Hardware:
    hw = resolve_gpus(f"{n}xh100-80gb")
    gpus = tuple(
        dataclasses.replace(g, bf16_tflops=TITAN_TFLOPS, mem_bw_gbs=TITAN_HBM_GBS,
                            memory_bytes=96 * 1024**3)
        for g in hw.gpus
    )  # fmt: skip
    link = hw.link_bw_gbs if n <= 8 else TITAN_INTER_HOST_GBS
    return dataclasses.replace(hw, gpus=gpus, link_bw_gbs=link)


@pytest.mark.parametrize(("n", "compiled", "published"), TORCHTITAN_LLAMA3_8B)
def test_torchtitans_llama3_8b_throughput_lies_between_the_two_recompute_bounds(
    n: int, compiled: bool, published: float
) -> None:
    # torchtitan's selective checkpointing (`selective_ac_option = "op"`) saves every other matmul
    # output and recomputes the rest; autofit's `selective` recomputes no matmul and `full` every
    # layer's forward. So the published figure must lie between the napkin's two estimates: at
    # most the `selective` one, and at least the `full` one less 15% (the tolerance for the
    # uncalibrated efficiencies: GEMM 70%, attention 50%, HBM 70%).
    model, hw = resolve_model("llama-3-8b"), titan_hardware(n)

    def per_gpu(checkpointing: str) -> float:
        cfg = Config(micro_batch=2, seq_len=8192, checkpointing=checkpointing, compile=compiled)
        return estimate(model, hw, cfg).tokens_per_s / n

    assert 0.85 * per_gpu("full") <= published <= per_gpu("selective")


# ----- measured: CPU trials on this project's 2-core machine --------------------------------------
# llama-debug, 2 CPU processes (gloo), FSDP2 unless `wrap none` (DDP), seq 256, 5 measured steps:
#   PYTHONPATH=. python -m autofit trial --model llama-debug --device cpu --gpus 2 --seq-len 256 \
#       --steps 5 --json --micro-batch 4 [--checkpointing full | --lora-rank 16 | --wrap none]
# tokens/s of two runs each (2026-11-24; other sessions' trials shared the machine at times, so
# the runs differ by up to 15%; only orderings both runs agree on are asserted). `--offload params`
# measured 6,773 and 5,627 against 6,273 and 5,758 without: no stable order, not asserted.
CPU_TRIALS: dict[str, tuple[dict, tuple[float, float]]] = {
    "full-mb1": ({"micro_batch": 1}, (3_211, 2_632)),
    "full-mb4": ({"micro_batch": 4}, (6_273, 5_758)),
    "full-mb4-ckpt": ({"micro_batch": 4, "checkpointing": "full"}, (5_248, 4_484)),
    "lora16-mb4": ({"micro_batch": 4, "lora_rank": 16}, (6_760, 5_968)),
    "full-mb4-ddp": ({"micro_batch": 4, "wrap": "none"}, (7_696, 6_902)),
}
SLOWER_FASTER = (
    ("full-mb1", "full-mb4"),  # fixed per-step costs over 4x fewer tokens
    ("full-mb4-ckpt", "full-mb4"),  # recomputation
    ("full-mb4", "full-mb4-ddp"),  # FSDP2's gathers, one gloo call per unit, vs one all-reduce
    ("full-mb4", "lora16-mb4"),  # no weight gradients of the base, a tiny optimizer step
)


def cpu_estimate(name: str) -> float:
    knobs, _ = CPU_TRIALS[name]
    cfg = Config(seq_len=256, **knobs)
    hw = resolve_hardware("2", device="cpu")
    return estimate(resolve_model("llama-debug"), hw, cfg, device="cpu").tokens_per_s


@pytest.mark.parametrize(("slower", "faster"), SLOWER_FASTER)
def test_the_napkin_orders_measured_cpu_trials_as_they_ran(slower: str, faster: str) -> None:
    assert all(s < f for s, f in zip(CPU_TRIALS[slower][1], CPU_TRIALS[faster][1], strict=True))
    assert cpu_estimate(slower) < cpu_estimate(faster)


@pytest.mark.xfail(
    strict=True,
    reason="known miss: measured DDP full fine-tune 14-16% faster than FSDP2 LoRA r16 on CPU; the "
    "napkin counts FSDP2's CPU-side cost per unit (hooks, copy-in/out) below what gloo runs show",
)
def test_ddp_full_fine_tune_beats_fsdp2_lora_on_cpu() -> None:
    measured = CPU_TRIALS["lora16-mb4"][1], CPU_TRIALS["full-mb4-ddp"][1]
    assert all(lo < hi for lo, hi in zip(*measured, strict=True))
    assert cpu_estimate("lora16-mb4") < cpu_estimate("full-mb4-ddp")


# ----- the breakdown contract ---------------------------------------------------------------------
def test_time_breakdown_has_the_calibration_terms_and_sums_to_the_step() -> None:
    assert TIME_KEYS == SPEED_TIME_KEYS == (
        "compute", "memory_bound", "overhead", "host", "dequant", "communication", "offload",
        "optimizer",
    )  # fmt: skip
    cfg = Config(quant="nf4", lora_rank=16, micro_batch=2, grad_accum=2, offload="params")
    e = estimate(resolve_model("llama-7b"), resolve_gpus("2xrtx3090"), cfg)
    assert tuple(e.time_breakdown) == TIME_KEYS
    assert all(v >= 0 for v in e.time_breakdown.values())
    assert e.step_time_s == pytest.approx(sum(e.time_breakdown.values()))
    assert e.time_breakdown["dequant"] > 0 and e.time_breakdown["memory_bound"] > 0


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_the_host_adamw_ops_are_torchs_own(impl: str) -> None:
    """The ops torch's AdamW dispatches per parameter tensor on host tensors, counted with a
    dispatch mode over 3 and 6 tensors (what a step costs besides does not grow with them), are
    the ones the offloaded optimizer step is timed by (`comm.CPU_ADAMW_COST`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from autofit.estimate.comm import CPU_ADAMW_COST
    from autofit.recipe import ADAMW_IMPLS

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    def step_ops(n: int) -> int:
        params = [torch.nn.Parameter(torch.zeros(8, 8)) for _ in range(n)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, **ADAMW_IMPLS[impl].kwargs)
        opt.step()  # the states are made at the first step
        Count.ops = 0
        with Count():
            opt.step()
        return Count.ops

    assert (step_ops(6) - step_ops(3)) / 3 == CPU_ADAMW_COST[impl][0]


def test_an_offloaded_full_fine_tune_steps_its_adamw_at_the_h200_hosts_rate() -> None:
    """tinyllama-1.1b's full fine-tune under `offload: params` on one H200 (autofit's own trials:
    1.79 and 2.14 s a step, `bench/data/gpu-check/`), whose optimizer step the host runs: the
    estimate's step lies between the two, where it was 2.95 s at a flat 0.4 G params/s."""
    cfg = Config(quant="none", lora_rank=0, micro_batch=4, wrap="auto", checkpointing="full",
                 offload="params")  # fmt: skip
    hw = resolve_hardware("1xh200", gpu_memory=24 * 2**30)
    est = estimate(resolve_model("tinyllama-1.1b"), hw, cfg)
    assert 1.79 <= est.step_time_s <= 2.14
