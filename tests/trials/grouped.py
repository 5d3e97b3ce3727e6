"""Trials of llama-debug run as one grouped launch (`run_trials`), each checked to have run."""

from __future__ import annotations

from typing import Any

from autofit.config import Config
from autofit.models import resolve_model
from autofit.trials import TrialResult, run_trials


def grouped_trials(
    base: dict[str, Any], trials: dict[str, dict[str, Any]], steps: int, warmup: int
) -> dict[str, TrialResult]:
    """Each of `trials` (name: its knobs on top of `base`) as a CPU trial of llama-debug, all in
    one launch, by name; every one must have run (`ok`)."""
    spec = resolve_model("llama-debug")
    configs = [Config(**base, **knobs) for knobs in trials.values()]
    results = run_trials(spec, configs, nprocs=1, device="cpu", steps=steps, warmup=warmup,
                         timeout_s=240)  # fmt: skip
    out = dict(zip(trials, results, strict=True))
    for name, result in out.items():
        assert result.status == "ok", f"{name}: {result.message[-800:]}"
    return out
