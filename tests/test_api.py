"""The public Python API as the README shows it."""

from __future__ import annotations

import pytest

import autofit


def test_estimate_as_in_the_readme():
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
        quant="nf4", lora_rank=64, micro_batch=8, checkpointing="full", wrap="layer"
    )  # wrap: auto is FSDP2 per decoder layer on several GPUs
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


def test_plan_refuses_an_unknown_keyword_as_python_does():
    # `plan` takes the data keywords as `**data`: a keyword that is none of them is refused with
    # the TypeError Python itself raises for a function without `**` (before anything runs)
    def plan(model: str, *, dataset: str | None = None) -> None: ...

    with pytest.raises(TypeError) as python:
        plan("llama-7b", datset="train.jsonl")  # type: ignore[call-arg]
    with pytest.raises(TypeError) as ours:
        autofit.plan("llama-7b", gpus="2xrtx3090", trials=0, datset="train.jsonl")
    assert str(ours.value) == str(python.value).split(".")[-1]
    assert str(ours.value) == "plan() got an unexpected keyword argument 'datset'"


def test_estimate_takes_the_data_keywords_beside_the_knobs(tmp_path):
    # `lengths` is a data keyword, not a knob: the data's longest sequence (64 tokens) sets the
    # peak, which is then the peak of 64-token sequences without data, below that of 128
    (tmp_path / "lengths.txt").write_text("64\n" * 50 + "40\n" * 50)
    given = autofit.estimate(
        "llama-debug", "1xrtx3090", seq_len=128, lengths=tmp_path / "lengths.txt"
    )
    short = autofit.estimate("llama-debug", "1xrtx3090", seq_len=64)
    full = autofit.estimate("llama-debug", "1xrtx3090", seq_len=128)
    assert given.peak_allocated_bytes == short.peak_allocated_bytes < full.peak_allocated_bytes


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


# ----- the LoRA settings ------------------------------------------------------------------------
def test_estimate_takes_the_lora_settings():
    est = autofit.estimate(
        "llama-debug", gpus="1xrtx3090", lora_rank=8, lora_targets=["q_proj", "v_proj"],
        lora_dropout=0.05,
    )  # fmt: skip
    assert est.config.lora_targets == ("q_proj", "v_proj") and est.config.lora_dropout == 0.05
    assert est.to_dict()["config"]["lora_targets"] == ["q_proj", "v_proj"]


def test_trial_takes_the_lora_settings(monkeypatch):
    import autofit.trials

    seen = []
    monkeypatch.setattr(autofit.trials, "run_trial", lambda spec, cfg, **kw: seen.append(cfg))
    autofit.trial("llama-debug", gpus="1", device="cpu", lora_rank=8, lora_targets="q_proj",
                  lora_dropout=0.1)  # fmt: skip
    assert [(c.lora_targets, c.lora_dropout) for c in seen] == [(("q_proj",), 0.1)]


def test_plan_takes_the_lora_settings_for_every_candidate():
    plan = autofit.plan("llama-debug", gpus="1xrtx3090", space="lora", trials=0, seq_len=256,
                        lora_targets="q_proj,v_proj", lora_dropout=0.05)  # fmt: skip
    assert plan.space.settings == {"lora_targets": ("q_proj", "v_proj"), "lora_dropout": 0.05}
    assert plan.ranked and {
        (c.config.lora_targets, c.config.lora_dropout) for c in plan.ranked
    } == {(("q_proj", "v_proj"), 0.05)}
    assert plan.to_dict()["best"]["config"]["lora_targets"] == ["q_proj", "v_proj"]


def test_plan_settings_replace_the_space_files(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("knobs: {lora_rank: [8]}\nlora_targets: [v_proj]\nlora_dropout: 0.1\n")
    kept = autofit.plan("llama-debug", gpus="1xrtx3090", space=space, trials=0, seq_len=256)
    assert (kept.best.config.lora_targets, kept.best.config.lora_dropout) == (("v_proj",), 0.1)
    replaced = autofit.plan("llama-debug", gpus="1xrtx3090", space=space, trials=0, seq_len=256,
                            lora_targets="all-linear", lora_dropout=0.0)  # fmt: skip
    assert (replaced.best.config.lora_targets, replaced.best.config.lora_dropout) == (None, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"lora_dropout": 1.0}, "'lora_dropout' must be a number >= 0 and < 1"),
        ({"lora_targets": "q proj"}, "'lora_targets' cannot be 'q proj'"),
    ],
)
def test_bad_lora_settings_are_config_errors(kwargs, fragment):
    with pytest.raises(autofit.ConfigError, match=fragment):
        autofit.plan("llama-debug", gpus="1xrtx3090", trials=0, **kwargs)
    with pytest.raises(autofit.ConfigError, match=fragment):
        autofit.estimate("llama-debug", gpus="1xrtx3090", lora_rank=8, **kwargs)


def test_plan_request_with_settings_round_trips_through_its_dict():
    import json

    from autofit.request import PlanRequest

    plan = autofit.plan("llama-debug", gpus="1xrtx3090", space="lora", trials=0, seq_len=256,
                        lora_targets=["q_proj", "v_proj"], lora_dropout=0.05)  # fmt: skip
    data = json.loads(json.dumps(plan.request.to_dict()))  # as a study stores it
    again = PlanRequest.from_dict(data)
    assert again == plan.request
    assert again.space.candidates(1, seq_len=256) == plan.space.candidates(1, seq_len=256)


def test_trial_takes_its_limit_as_trial_timeout_and_the_old_name_warns(monkeypatch):
    # `plan(timeout=)` is the whole search's limit; a trial's is `trial_timeout` in both. The old
    # `trial(timeout=)` still reaches the launcher, with a DeprecationWarning.
    import warnings

    import autofit.trials

    seen = {}

    def fake_run_trial(*args, timeout_s, **kwargs):
        seen["timeout_s"] = timeout_s
        return "measured"

    monkeypatch.setattr(autofit.trials, "run_trial", fake_run_trial)
    assert autofit.trial("llama-debug", "1", device="cpu", trial_timeout=12) == "measured"
    assert seen["timeout_s"] == 12
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autofit.trial("llama-debug", "1", device="cpu", timeout=34)
    assert seen["timeout_s"] == 34
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)


def test_plan_carries_the_optimizer_impl_setting_to_every_candidate():
    # a setting, like the LoRA ones: every candidate steps with foreach AdamW, and the space's
    # torchao low-bit AdamW candidates (which have their own step) are skipped
    plan = autofit.plan(
        "llama-7b", gpus="1xh200", trials=0, space="full", seq_len=1024, optimizer_impl="Foreach"
    )
    configs = [c.config for c in plan.ranked]
    assert configs and {(c.optimizer, c.optimizer_impl) for c in configs} == {("adamw", "foreach")}
    assert plan.best.config.short().endswith("adamw=foreach")
