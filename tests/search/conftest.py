"""Search tests without real trials: a fake `run_trial` that "measures" from the estimate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from autofit.config import Config
from autofit.estimate import estimate
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.space_file import load_space, parse_space
from autofit.trials import TrialResult

TINY_SPACE = Path(__file__).with_name("tiny_space.yaml")


@dataclass
class FakeTrials:
    """Measures peak = estimate x `peak_factor(config)`, tokens/s = estimate x `speed_factor`;
    an OOM when the peak is above the cap. Records every config it was asked to run."""

    peak_factor: Callable[[Config], float] = lambda cfg: 1.0
    speed_factor: Callable[[Config], float] = lambda cfg: 1.0
    interrupt_at: int | None = None  # raise KeyboardInterrupt on this call (1-based)
    calls: list[tuple[Config, int]] = field(default_factory=list)

    def __call__(self, model: Any, config: Config, *, nprocs: int, device: str,
                 gpu_memory: int | None, steps: int, timeout_s: float,
                 **hooks: Any) -> TrialResult:  # fmt: skip
        self.calls.append((config, steps))
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        hw = resolve_hardware(str(nprocs), device="cpu", gpu_memory=gpu_memory)
        est = estimate(model, hw, config, device="cpu")
        peak = int(est.peak_bytes * self.peak_factor(config))
        result = TrialResult(status="ok", config=config.to_dict(), model=model.name,
                             device=device, nprocs=nprocs, capacity_bytes=gpu_memory)  # fmt: skip
        if gpu_memory is not None and peak > gpu_memory:
            result.status = "oom"
            result.message = "CPU trial out of memory (fake)"
            return result
        result.peak_bytes = result.peak_allocated_bytes = peak
        result.tokens_per_s = est.tokens_per_s * self.speed_factor(config)
        result.step_time_s = est.step_time_s / self.speed_factor(config)
        result.losses = [2.0] * (steps + 1)
        return result

    def batch(self, model: Any, configs: list[Config], *, on_progress: Any = None,
              on_result: Any = None, **kwargs: Any) -> list[TrialResult]:  # fmt: skip
        """`autofit.trials.run_trials`: each config as one call, each reported when it is done."""
        results = []
        for i, config in enumerate(configs):
            if on_progress is not None:
                on_progress({"phase": "build", "step": 0, "steps": kwargs["steps"], "config": i})
            results.append(self(model, config, **kwargs))
            if on_result is not None:
                on_result(i, results[-1])
        return results

    @property
    def search_configs(self) -> list[Config]:
        """Configs measured by search trials (not verification re-runs, which use more steps)."""
        return [cfg for cfg, steps in self.calls if steps == 2]


@pytest.fixture
def fake() -> FakeTrials:
    return FakeTrials()


def tiny_search_kwargs(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    """A 2-process CPU search of llama-debug over the tiny space under a 56 MiB cap."""
    from autofit.units import MiB

    kw = {
        "model": resolve_model("llama-debug"),
        "hardware": resolve_hardware("2", device="cpu", gpu_memory=56 * MiB),
        "space": load_space(TINY_SPACE),
        "seq_len": 64,
        "trials": 4,
        "steps": 2,
        "device": "cpu",
        "gpu_memory": 56 * MiB,
        "run_dir": tmp_path / "run",
        "seed": 0,
    }
    kw.update(changes)
    return kw


@pytest.fixture
def search_kwargs(tmp_path: Path) -> dict[str, Any]:
    return tiny_search_kwargs(tmp_path)


def wide_space() -> Any:
    """LoRA and full fine-tune, 48 candidates: enough for the sampler to have choices."""
    return parse_space(
        {
            "seq_len": 64,
            "knobs": {
                "lora_rank": [0, 8],
                "micro_batch": [1, 2, 4, 8],
                "wrap": ["layer", "none"],
                "checkpointing": ["none", "full"],
                "precision": ["bf16-mixed", "bf16"],
            },
        },
        "wide",
        name="wide",
    )
