"""One real CPU trial per decoder family (the tiny `<family>-debug` presets) on 2 gloo ranks:
QLoRA (LoRA r8 on an NF4 base) under FSDP2 builds, runs, and its loss falls. Llama is covered by
tests/trials/test_trial.py."""

from __future__ import annotations

import pytest

from autofit.config import Config
from autofit.models import PRESETS
from autofit.trials import run_trial

pytestmark = pytest.mark.slow

FAMILIES = ["qwen2-debug", "qwen3-debug", "gemma2-debug", "gemma3-debug", "phi3-debug",
            "mixtral-debug"]  # fmt: skip


@pytest.mark.parametrize("name", FAMILIES)
def test_family_trains_under_qlora_on_two_ranks(name: str) -> None:
    config = Config(seq_len=64, micro_batch=2, lora_rank=8, quant="nf4")
    result = run_trial(
        PRESETS[name], config, nprocs=2, device="cpu", steps=2, warmup=1, timeout_s=240
    )
    assert result.status == "ok", result.message
    assert result.sharding == "fsdp2"
    assert len(result.losses) == 3
    # a falling loss, by more than float noise (a model that does not learn moves it ~1e-6)
    assert result.losses[-1] < result.losses[0] - 1e-3, result.losses
    assert result.peak_bytes and result.peak_bytes > 0
