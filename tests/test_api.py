"""The public Python API as design.md shows it."""

from __future__ import annotations

import pytest

import autofit


def test_estimate_as_in_design_md():
    est = autofit.estimate(
        "llama-7b",
        gpus="2xrtx3090",
        quant="nf4",
        lora_rank=64,
        micro_batch=8,
        seq_len=2048,
        checkpointing="full",
    )
    assert isinstance(est, autofit.Estimate)
    assert est.within_capacity and est.n_gpus == 2
    assert est.config == autofit.Config(
        quant="nf4", lora_rank=64, micro_batch=8, checkpointing="full"
    )
    assert sum(est.breakdown.values()) == est.peak_allocated_bytes


def test_estimate_only_plan_needs_no_gpu():
    plan = autofit.plan("llama-7b", gpus="2xrtx3090", seq_len=2048, global_batch=32, trials=0)
    assert isinstance(plan, autofit.Plan)
    best = plan.best
    assert best is not None
    assert best.config.micro_batch * best.config.grad_accum * 2 == 32
    assert best.tokens_per_s > 0 and best.peak_bytes > 0
    assert best.peak_bytes < plan.capacity_bytes


def test_plan_with_a_named_space():
    plan = autofit.plan("tinyllama-1.1b", gpus="1xrtx4090", space="qlora", trials=0)
    assert plan.space.name == "qlora" and plan.best.config.quant == "nf4"


def test_unknown_knob_is_a_config_error():
    with pytest.raises(autofit.ConfigError, match="Unknown knob 'micro_bach'"):
        autofit.estimate("llama-7b", gpus="1xrtx3090", micro_bach=4)


def test_errors_share_one_base_class():
    for exc in (autofit.ConfigError, autofit.ModelError, autofit.HardwareError, autofit.SpaceError):
        assert issubclass(exc, autofit.AutofitError)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"margin": 1.5}, "--margin"),
        ({"trials": -1}, "--trials"),
        ({"seq_len": 0}, "--seq-len"),
        ({"global_batch": 0}, "--global-batch"),
    ],
)
def test_plan_rejects_bad_settings(kwargs, pattern):
    with pytest.raises(autofit.AutofitError, match=pattern):
        autofit.plan("llama-7b", gpus="1xrtx3090", trials=kwargs.pop("trials", 0), **kwargs)


def test_version_is_a_string():
    assert isinstance(autofit.__version__, str) and autofit.__version__[0].isdigit()
