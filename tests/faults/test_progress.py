"""A running trial shows what it does (issue 8, point 10): rank 0 reports each phase and step."""

from __future__ import annotations

from typing import Any

import pytest

from autofit.config import Config
from autofit.trials import run_trial

pytestmark = pytest.mark.slow


def test_the_caller_sees_build_warmup_and_every_step() -> None:
    seen: list[dict[str, Any]] = []
    config = Config(seq_len=32, micro_batch=1, lora_rank=8)
    result = run_trial("llama-debug", config, nprocs=1, device="cpu", steps=3, timeout_s=240,
                       on_progress=seen.append)  # fmt: skip
    assert result.status == "ok", result.message
    phases = [(p["phase"], p["step"]) for p in seen]
    assert phases[0] == ("build", 0)
    assert phases[-1] == ("step", 3) and seen[-1]["steps"] == 3
    assert phases == sorted(set(phases), key=phases.index)  # in order, each once
    assert set(phases) <= {("build", 0), ("warmup", 1), ("step", 1), ("step", 2), ("step", 3)}
