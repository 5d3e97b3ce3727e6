"""`compile: true` in the napkin: faster layer compute by torchtitan's published share, memory
unchanged (eager memory is the bound the estimate keeps)."""

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
def test_compile_takes_its_share_off_compute_only(knobs: dict) -> None:
    eager = estimate(PRESETS["llama-7b"], resolve_gpus("2xh100-80gb"), Config(**knobs))
    compiled = estimate(
        PRESETS["llama-7b"], resolve_gpus("2xh100-80gb"), Config(**knobs, compile=True)
    )
    before, after = eager.time_breakdown, compiled.time_breakdown
    assert after["compute"] == pytest.approx(spd.compiled_compute_time(before["compute"]))
    assert after["optimizer"] == before["optimizer"] and after["offload"] == before["offload"]
    assert compiled.tokens_per_s > eager.tokens_per_s
    assert compiled.peak_bytes == eager.peak_bytes
    assert compiled.breakdown == eager.breakdown
