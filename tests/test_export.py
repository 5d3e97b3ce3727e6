"""Exports: the winner as an autofit plan, an Accelerate FSDP2 config and TrainingArguments JSON;
written atomically, never over a user's own file, and read back by the tools that use them."""

from __future__ import annotations

import json
import os

import pytest
import yaml

import autofit
from autofit.errors import AutofitError
from autofit.export import export_plan, launch_command, load_plan
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.plan import plan_estimates
from autofit.space import load_space


@pytest.fixture(scope="module")
def qlora_plan():
    """llama-7b QLoRA on two RTX 3090s, from estimates (no trials needed to test exports)."""
    return plan_estimates(
        resolve_model("llama-7b"), resolve_hardware("2xrtx3090"), load_space("qlora"),
        seq_len=2048, global_batch=32,
    )  # fmt: skip


def test_autofit_plan_round_trips_through_load_plan(qlora_plan, tmp_path):
    (path,) = qlora_plan.export("autofit", tmp_path / "plan.yaml")
    loaded = autofit.load_plan(path)
    assert loaded.best.config == qlora_plan.best.config
    assert loaded.model == "llama-7b" and loaded.n_gpus == 2
    assert loaded.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    text = path.read_text()
    assert text.startswith("# autofit plan") and "nf4" in text and "LoRA rank" in text


def test_accelerate_export_is_an_fsdp2_config_accelerate_loads(qlora_plan, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    path, side = export_plan(qlora_plan, "accelerate", tmp_path / "fsdp2.yaml")
    cfg = load_config_from_file(str(path))
    best = qlora_plan.best.config
    assert cfg.distributed_type == "FSDP" and cfg.num_processes == 2
    fsdp = cfg.fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert fsdp["fsdp_reshard_after_forward"] == best.reshard
    assert fsdp["fsdp_activation_checkpointing"] == (best.checkpointing != "none")
    assert fsdp["fsdp_offload_params"] is False
    assert cfg.mixed_precision in ("bf16", "no")
    text = path.read_text()
    assert "expandable_segments:True" in text and "nf4" in text  # what Accelerate cannot say
    assert load_plan(side).best.config == best


def test_trainer_export_is_json_that_training_arguments_accepts(qlora_plan, tmp_path):
    import torch
    from transformers import TrainingArguments

    path, side = export_plan(qlora_plan, "trainer", tmp_path / "args.json")
    data = json.loads(path.read_text())
    args = TrainingArguments(**data, use_cpu=not torch.cuda.is_available())
    best = qlora_plan.best.config
    assert args.per_device_train_batch_size == best.micro_batch
    assert args.gradient_accumulation_steps == best.grad_accum
    assert args.bf16 and args.fsdp and args.fsdp_config["version"] == 2
    assert load_plan(side).best.config.quant == "nf4"


def test_replicated_winner_exports_without_fsdp(qlora_plan, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    cand = qlora_plan.best
    original = cand.config
    cand.config = original.replace(wrap="none")
    try:
        path, _ = export_plan(qlora_plan, "accelerate", tmp_path / "ddp.yaml")
        assert load_config_from_file(str(path)).distributed_type == "MULTI_GPU"
        tpath, _ = export_plan(qlora_plan, "trainer", tmp_path / "ddp.json")
        assert "fsdp" not in json.loads(tpath.read_text())
    finally:
        cand.config = original


def test_unknown_format_lists_the_allowed_ones(qlora_plan, tmp_path):
    with pytest.raises(AutofitError, match="autofit, accelerate, trainer"):
        qlora_plan.export("deepspeed", tmp_path / "x.json")
    assert not list(tmp_path.iterdir())


def test_an_existing_user_file_is_never_overwritten(qlora_plan, tmp_path):
    mine = tmp_path / "config.yaml"
    mine.write_text("my: own config\n")
    with pytest.raises(AutofitError, match="not written by autofit"):
        qlora_plan.export("accelerate", mine)
    assert mine.read_text() == "my: own config\n"


def test_re_export_replaces_autofits_own_file(qlora_plan, tmp_path):
    path = tmp_path / "plan.yaml"
    qlora_plan.export("autofit", path)
    qlora_plan.export("autofit", path)
    assert load_plan(path).best.config == qlora_plan.best.config
    tpath = tmp_path / "args.json"
    qlora_plan.export("trainer", tpath)
    qlora_plan.export("trainer", tpath)  # JSON has no comment: its side file marks it


def test_a_failed_write_leaves_the_old_file_and_no_temp(qlora_plan, tmp_path, monkeypatch):
    path = tmp_path / "plan.yaml"
    qlora_plan.export("autofit", path)
    before = path.read_text()

    def broken(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError):
        qlora_plan.export("autofit", path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


def test_load_plan_of_a_missing_or_foreign_file_says_what_to_pass(tmp_path):
    with pytest.raises(AutofitError, match="No plan file"):
        load_plan(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [unclosed\n")
    with pytest.raises(AutofitError, match="not a readable YAML"):
        load_plan(bad)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE"}))
    with pytest.raises(AutofitError, match="not an autofit plan"):
        load_plan(other)
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({"autofit_plan": 1, "config": {"quant": "fp3"}}))
    with pytest.raises(AutofitError, match="quant"):
        load_plan(broken)


def test_a_plan_without_winner_cannot_be_exported(tmp_path):
    plan = plan_estimates(resolve_model("llama-70b"), resolve_hardware("1xrtx3090"),
                          load_space("full"), seq_len=4096)  # fmt: skip
    assert plan.best is None
    with pytest.raises(AutofitError, match="no winner"):
        plan.export("autofit", tmp_path / "plan.yaml")


def test_launch_command_names_the_file_and_the_allocator_setting(qlora_plan):
    cmd = launch_command(qlora_plan, "accelerate", "fsdp2.yaml")
    assert cmd.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True accelerate launch")
    assert "--config_file fsdp2.yaml" in cmd
    assert "--nproc-per-node 2" in launch_command(qlora_plan, "autofit", "plan.yaml")
