"""`compile: true` in the napkin: the decoder layers' time falls by torchtitan's published share,
taken from their memory-bound kernels first (Inductor fuses element-wise ops; matmuls stay cuBLAS
calls); memory less by what the partitioner recomputes in layers that keep their activations
(`memory.compiled_recomputed_bytes`, held to torch's partitioner in `test_compiled_memory.py`)."""

from __future__ import annotations

import pytest

from autofit.config import Config
from autofit.estimate import estimate
from autofit.estimate import speed as spd
from autofit.hardware import resolve_gpus
from autofit.models import PRESETS


def test_published_share_is_torchtitans_llama_3_1_8b_speedup() -> None:
    # 5,762 -> 6,667 tokens/s per GPU: the step takes 86.4% of the eager time
    assert abs(spd.COMPILE_TIME_SAVED - 0.136) < 1e-3
    assert spd.compiled_compute_time(2.0) == pytest.approx(2.0 * 5762 / 6667)


@pytest.mark.parametrize(
    "knobs",
    [
        {"micro_batch": 2, "checkpointing": "full"},
        {"quant": "nf4", "lora_rank": 64, "micro_batch": 4, "offload": "params"},
    ],
    ids=["full-finetune", "qlora-offload"],
)
def test_compile_takes_its_share_from_memory_bound_work_first(knobs: dict) -> None:
    eager = estimate(PRESETS["llama-7b"], resolve_gpus("2xh100-80gb"), Config(**knobs))
    compiled = estimate(
        PRESETS["llama-7b"], resolve_gpus("2xh100-80gb"), Config(**knobs, compile=True)
    )
    before, after = eager.time_breakdown, compiled.time_breakdown
    work_before = before["compute"] + before["memory_bound"] + before["overhead"]
    saved = work_before - after["compute"] - after["memory_bound"] - after["overhead"]
    # the share applies to the decoder layers only (not the head, the loss, FSDP2's overhead)
    assert 0 < saved < spd.COMPILE_TIME_SAVED * work_before
    assert after["overhead"] + after["memory_bound"] < before["overhead"] + before["memory_bound"]
    # the layers' ops cost the host a kernel launch each (`speed.host_time`), not an eager op
    assert after["overhead"] <= before["overhead"] and after["host"] <= before["host"]
    assert after["compute"] <= before["compute"]
    assert after["optimizer"] == before["optimizer"] and after["dequant"] == before["dequant"]
    # less work to hide the prefetched copies behind: exposed offload can only grow
    assert after["offload"] >= before["offload"]
    assert compiled.tokens_per_s > eager.tokens_per_s
    # llama-7b's MLP activation output, bf16, in every layer that keeps its activations (all
    # 32 without recomputation, none with `full`): 32 x 4 x 2,048 tokens x 11,008 x 2 B
    kept_mlp_output = 32 * 4 * 2048 * 11008 * 2 if knobs.get("checkpointing") != "full" else 0
    assert eager.peak_allocated_bytes - compiled.peak_allocated_bytes == kept_mlp_output
    assert {k: v - compiled.breakdown[k] for k, v in eager.breakdown.items()
            if v != compiled.breakdown[k]} == ({"activations": kept_mlp_output}
                                               if kept_mlp_output else {})  # fmt: skip


def test_the_saving_moves_to_matmuls_only_once_memory_bound_work_is_gone() -> None:
    assert spd.compiled_layer_time(10.0, 3.0) == pytest.approx((10.0, 3.0 - 13.0 * 0.1357), 1e-3)
    mm, mb = spd.compiled_layer_time(10.0, 0.5)
    assert mb == 0.0 and mm == pytest.approx(10.5 * (1 - spd.COMPILE_TIME_SAVED))
