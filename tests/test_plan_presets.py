"""`autofit plan --no-trials` for every preset on one consumer GPU and on an 8-GPU node: the plan
either picks a config or says why nothing fits.

A small space at the shipped spaces' sequence length (2048), LoRA r16 with and without
checkpointing, reads each preset's structure and layer traces from the package
(`autofit/arch/shipped`), as a user's first plan does; the models that fit nowhere on one card
trace the shorter sequences the advice tries (cached in the suite's AUTOFIT_CACHE_DIR). Tracing
itself is held to real tensors at the debug presets in tests/estimate, and the shipped files to a
fresh trace in tests/test_shipped_traces.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import autofit
from autofit.arch import structure_of
from autofit.models import PRESETS

SPACE = """\
description: a few configs of every preset (tests/test_plan_presets.py)
seq_len: 2048
knobs:
  quant: [nf4, none]
  lora_rank: [16]
  micro_batch: [1]
  grad_accum: [1]
  wrap: [layer, none]
  checkpointing: [none, full]
"""
# Models that do not fit on one 24 GB card in this space (QLoRA is the smallest).
TOO_BIG_FOR_ONE_4090 = {"llama-70b", "llama-3-70b", "mixtral-8x7b"}


@pytest.fixture(scope="module")
def space(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("space") / "presets.yaml"
    path.write_text(SPACE)
    return path


@pytest.mark.parametrize("gpus", ["1xrtx4090", "8xh100-80gb"])
@pytest.mark.parametrize("name", list(PRESETS))
def test_plan_without_trials_works_for_every_preset(name: str, gpus: str, space: Path) -> None:
    plan = autofit.plan(name, gpus=gpus, space=space, trials=0)
    assert plan.considered > 0
    if gpus == "1xrtx4090" and name in TOO_BIG_FOR_ONE_4090:
        assert plan.best is None and plan.advice, plan.reason
        return
    assert plan.best is not None, f"{name} on {gpus}: {plan.reason} {plan.advice}"
    best = plan.best.estimate
    assert 0 < best.breakdown["activations"] < best.peak_allocated_bytes
    assert structure_of(plan.model).n_params > 0
