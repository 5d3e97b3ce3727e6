"""The last unclean inputs (issue 25, section 5): each was accepted (or answered with a raw
exception) and is now one paragraph naming what was wrong and what is allowed, exit 2, one JSON
object under --json, nothing written and no trial run (`no_trial_may_run`). Where two flags
contradict each other, both are named and neither silently wins."""

from __future__ import annotations

import json

import pytest

import autofit
from autofit.errors import AutofitError, ConfigError
from autofit.space_file import load_space
from tests.test_bad_input import (  # noqa: F401 - the fixture is autouse here too
    CPU_PLAN,
    TINY_SPACE,
    assert_clean_failure,
    assert_json_failure,
    no_trial_may_run,
    run,
)

PLAN = ["plan", "-m", "llama-debug", "-g", "2xrtx3090", "--no-trials"]
ESTIMATE = ["estimate", "-m", "llama-debug", "-g", "2xrtx3090"]
TRIAL = ["trial", "-m", "llama-debug", "-g", "1", "--device", "cpu", "--seq-len", "64"]
HUGE = "99999999999999999999"

CASES = {  # args, the fragments of its one paragraph
    "huge micro-batch": ([*ESTIMATE, "--micro-batch", HUGE],
                         ["Knob 'micro_batch' must be a whole number from 1 to 65,536", HUGE]),
    "huge grad-accum": ([*ESTIMATE, "--grad-accum", "65537"], ["'grad_accum'", "1 to 65,536"]),
    "huge LoRA rank": ([*TRIAL, "--lora-rank", "5000"], ["'lora_rank'", "from 0 to 4,096"]),
    "huge seq-len": ([*ESTIMATE, "--seq-len", HUGE], ["'seq_len'", "1 to 16,777,216"]),
    "huge plan seq-len": ([*PLAN, "--seq-len", "16777217"], ["--seq-len", "1 to 16,777,216"]),
    "huge global batch": ([*PLAN, "--global-batch", HUGE],
                          ["--global-batch", "from 1 to 4,294,967,296"]),
    "no-trials with trials": ([*PLAN, "--trials", "5"],
                              ["--no-trials plans from estimates alone", "--trials 5",
                               "--trials 0 is the same as --no-trials"]),
    "no-trials with negative trials": ([*PLAN, "--trials", "-1"],
                                       ["--trials must be 0 or more; got -1"]),
    "format without export": ([*PLAN, "--format", "trainer"],
                              ["--format trainer", "no --export PATH", "drop --format"]),
    "negative search timeout": ([*CPU_PLAN, "--search-timeout", "-1"],
                                ["--search-timeout must be a positive number", "got -1.0"]),
    "negative node rank": ([*CPU_PLAN, "--node-rank", "-1"],
                           ["--node-rank must be 0 or more", "got -1"]),
    "no-calibration and calibration": ([*PLAN, "--no-calibration", "--calibration", "study"],
                                       ["--no-calibration is --calibration off",
                                        "--calibration study"]),
    "dropout without LoRA": ([*ESTIMATE, "--lora-rank", "0", "--lora-dropout", "0.1"],
                             ["lora_dropout=0.1 configures LoRA adapters",
                              "lora_rank=0 is a full fine-tune", "lora_rank > 0"]),
    "LoRA targets in a trial without LoRA": ([*TRIAL, "--lora-targets", "q_proj"],
                                             ["lora_targets=q_proj configures LoRA adapters"]),
    "LoRA alpha for a space of full fine-tunes": ([*PLAN, "--space", "full", "--lora-alpha", "8"],
                                                  ["Space 'full' has only full fine-tunes",
                                                   "lora_alpha=8"]),
    "HSDP on one node": ([*ESTIMATE, "--shard", "node"],
                         ["shard=node", "needs several nodes", "same mesh as shard=all",
                          "--gpus NxKxNAME"]),
    "HSDP trial on one node": ([*TRIAL, "--shard", "node"], ["needs several nodes"]),
    "JSON named for YAML": ([*PLAN, "--export", "x.json", "--format", "autofit"],
                            ["--export x.json names a JSON file", "--format autofit writes YAML",
                             "x.yaml"]),
    "YAML named for JSON": ([*PLAN, "--export", "x.yml", "--format", "trainer"],
                            ["--export x.yml names a YAML file", "writes TrainingArguments JSON",
                             "x.json"]),
    "accelerate to JSON": (["export", "--storage", "sqlite:///s.db", "--study", "s", "--format",
                            "accelerate", "--output", "a.json"], ["--output a.json", "YAML"]),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_each_unclean_input_is_one_paragraph_and_writes_nothing(case, tmp_path):
    args, fragments = CASES[case]
    assert_clean_failure(run(*args), *fragments)
    assert list(tmp_path.iterdir()) == []  # no run folder, no export, no study


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0][0] != "export"])
def test_each_unclean_input_under_json_is_one_object(case, tmp_path):
    args, fragments = CASES[case]
    data = assert_json_failure(run(*args, "--json"), *fragments)
    assert f"autofit {args[0]} --help" in data["hint"]
    assert list(tmp_path.iterdir()) == []


def test_the_bounds_are_the_knobs_declarations_everywhere(tmp_path):
    from autofit.config import DECLARED
    from autofit.space_file import space_schema

    knobs = space_schema()["$defs"]["SpaceKnobs"]["properties"]
    assert knobs["micro_batch"]["anyOf"][1]["maximum"] == DECLARED["micro_batch"].maximum == 65536
    # (the flags' help says it too: tests/test_messages.py, --lora-rank's)
    space = tmp_path / "space.yaml"
    space.write_text("knobs: {micro_batch: [1, 100000]}\n")
    assert_clean_failure(run(*PLAN, "--space", str(space)), "'micro_batch'", "1 to 65,536")
    with pytest.raises(ConfigError, match="from 1 to 65,536; got 100000000000000000000"):
        autofit.estimate("llama-debug", "2xrtx3090", micro_batch=10**20)


def test_the_same_flags_without_the_conflict_still_run():
    tiny = ["--space", TINY_SPACE, "--seq-len", "64"]
    ok = [[*PLAN, *tiny, "--trials", "0"],
          [*PLAN, *tiny, "--no-calibration", "--calibration", "off"],
          [*ESTIMATE, "--micro-batch", "65536", "--seq-len", "64"],
          [*ESTIMATE, "--lora-rank", "8", "--lora-dropout", "0.1"]]  # fmt: skip
    for args in ok:
        result = run(*args, "--json")
        assert result.exit_code in (0, 1), result.output  # 1: a plan where nothing fits
        json.loads(result.stdout)
    hsdp = run("estimate", "-m", "llama-debug", "-g", "2x8xh100-80gb", "--shard", "node",
               "--json")  # fmt: skip
    assert hsdp.exit_code == 0 and json.loads(hsdp.stdout)["config"]["shard"] == "node"


def test_trial_only_flags_with_no_trials_are_named_not_used(tmp_path):
    result = run(*PLAN, "--space", TINY_SPACE, "--seq-len", "64", "--storage",
                 f"sqlite:///{tmp_path / 'x.db'}", "--study", "s", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)
    assert "warning: --storage, --study are not used: --no-trials plans from estimates alone" in (
        " ".join(result.stderr.split())
    )
    assert list(tmp_path.iterdir()) == []
    node0 = run(*PLAN, "--space", TINY_SPACE, "--seq-len", "64", "--node-rank", "0", "--json")
    assert node0.exit_code == 0, node0.output
    assert "warning: --node-rank is not used" in " ".join(node0.stderr.split())


def test_a_folder_as_the_space_says_it_is_a_folder(tmp_path):
    for name in ("spaces", "mine.yaml"):
        (tmp_path / name).mkdir()
        assert_clean_failure(run(*PLAN, "--space", str(tmp_path / name)),
                             f"--space '{tmp_path / name}' is a folder, not a space file",
                             "default, full, lora, qlora")  # fmt: skip
    (tmp_path / "lora").mkdir()  # a folder named like a shipped space does not hide it
    assert load_space("lora").name == "lora"


def test_apply_names_what_it_was_given():
    import torch

    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"config must be an autofit.Config or a dict of knobs.*"
                       r"got str 'not a config'"):  # fmt: skip
        autofit.apply(model, "not a config")
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module.*got NoneType None"):
        autofit.apply(None, autofit.Config())
    with pytest.raises(ValueError, match="has no parameters"):
        autofit.apply(torch.nn.Sequential(), autofit.Config())
    with pytest.raises(ConfigError, match="'micro_batch'"):
        autofit.apply(model, {"micro_batch": 0})


def test_the_api_refuses_what_the_flags_refuse():
    with pytest.raises(AutofitError, match="--search-timeout must be a positive"):
        autofit.plan("llama-debug", "2xrtx3090", trials=0, timeout=float("nan"))
    with pytest.raises(AutofitError, match="--node-rank must be 0 or more"):
        autofit.plan("llama-debug", "2xrtx3090", trials=0, node_rank=-2)
    with pytest.raises(ConfigError, match="needs several nodes"):
        autofit.estimate("llama-debug", "1xrtx3090", shard="node")
    plan = autofit.plan("llama-debug", "2xrtx3090", trials=0, space=TINY_SPACE, seq_len=64)
    with pytest.raises(AutofitError, match="writes YAML"):
        plan.export("accelerate", "accelerate.json")
