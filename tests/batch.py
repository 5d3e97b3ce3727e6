"""Tests' trials in as few launches as they allow: one `run_trials` per model and rank count.

A trial's processes take ~4 s to start and import torch; the steps of a test-sized model take
well under a second. Tests about what a trial measures (not about the launch) run their trials
through here.
"""

from __future__ import annotations

from typing import Any

from autofit.config import Config
from autofit.models import ModelSpec, resolve_model
from autofit.trials import TrialResult, run_trials


def run_grouped(
    trials: dict[str, tuple[str | ModelSpec, int, Config]], **kwargs: Any
) -> dict[str, TrialResult]:
    """Each named `(model, ranks, config)` trial's result, those of one model and rank count run
    in one launch; `kwargs` go to `run_trials` (device, steps, timeout_s...)."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name, (model, ranks, _config) in trials.items():
        groups.setdefault((resolve_model(model).name, ranks), []).append(name)
    results: dict[str, TrialResult] = {}
    for names in groups.values():
        model, ranks, _config = trials[names[0]]
        batch = run_trials(model, [trials[n][2] for n in names], nprocs=ranks, **kwargs)
        results.update(zip(names, batch, strict=True))
    return results
