"""The data's lengths in a plan: the flags, the API and a space file's `dataset:` put the
histogram in the request; the plan prints and reports its summary (by hand below), and the run
folder keeps it as lengths.json, which `--lengths` reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autofit
from autofit.checks import AutofitWarning
from autofit.cli import app
from autofit.data.read import read_length_file
from autofit.report.run_folder import write_run_folder
from autofit.request import PlanRequest
from autofit.space import Space
from tests.data.words import FIXTURE, word_tokenizer

runner = CliRunner()
TINY = str(Path(__file__).parents[1] / "search" / "tiny_space.yaml")
PLAN = ["plan", "-m", "llama-debug", "-g", "2xrtx3090", "--no-trials", "--seq-len", "128",
        "--space", TINY]  # fmt: skip
# tests/data/lengths.jsonl at seq_len 128, by hand (tests/data/test_read.py): 36 examples, the
# 18th of them sorted 16 tokens, the 33rd 52, the longest 300; 150 and 300 are cut
SUMMARY = {"examples": 36, "median": 16, "p90": 52, "p99": 300, "max": 300,
           "truncated_share": 2 / 36}  # fmt: skip
LINE = (
    "Data: 36 examples (lengths.jsonl): median 16 tokens, p90 52, p99 300, max 300; 5.6% "
    "longer than seq_len 128 are truncated."
)


@pytest.fixture
def tok(tmp_path: Path) -> str:
    return str(word_tokenizer(tmp_path / "tokenizer.json"))


def test_plan_shows_and_reports_the_data(tok):
    args = [*PLAN, "--dataset", str(FIXTURE), "--tokenizer", tok]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert LINE in result.output
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["lengths"] == {"source": str(FIXTURE), **SUMMARY}


def test_estimate_shows_the_data(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n300\n200\n")  # median 200; 300 is over 256
    args = ["estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--seq-len", "256"]
    result = runner.invoke(app, [*args, "--lengths", str(lengths)])
    assert result.exit_code == 0, result.output
    assert "Data: 3 examples (lengths.txt): median 200 tokens" in result.output
    assert "33.3% longer than seq_len 256 are truncated" in result.output
    data = json.loads(runner.invoke(app, [*args, "--lengths", str(lengths), "--json"]).stdout)
    assert data["lengths"]["max"] == 300 and data["lengths"]["truncated_share"] == 1 / 3


def test_a_space_file_names_the_data_and_the_flags_replace_it(tmp_path, tok):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(FIXTURE.read_text())
    space = tmp_path / "space.yaml"
    space.write_text(
        "knobs: {micro_batch: [1, 2]}\n"
        f"dataset: {{path: data/train.jsonl, tokenizer: {tok}}}\n"  # relative to the file
    )
    with pytest.warns(AutofitWarning, match="no chat template"):
        plan = autofit.plan("llama-debug", "2xrtx3090", trials=0, seq_len=128, space=space)
    assert plan.request.lengths is not None
    assert plan.request.lengths.summary(128) == SUMMARY
    assert plan.space.data is not None and plan.space.data.dataset == str(
        tmp_path / "data" / "train.jsonl"
    )
    assert Space.from_dict(json.loads(json.dumps(plan.space.to_dict()))) == plan.space  # a study's
    mine = tmp_path / "mine.txt"
    mine.write_text("7\n")
    replaced = autofit.plan("llama-debug", "2xrtx3090", trials=0, space=space, lengths=mine)
    assert replaced.request.lengths is not None and replaced.request.lengths.lengths == (7,)


def test_the_run_folder_keeps_the_histogram(tmp_path, tok):
    with pytest.warns(AutofitWarning):
        plan = autofit.plan(
            "llama-debug", "2xrtx3090", trials=0, seq_len=128, space=TINY,
            dataset=FIXTURE, tokenizer=tok,
        )  # fmt: skip
    written = write_run_folder(plan, tmp_path / "run")
    assert tmp_path / "run" / "lengths.json" in written
    back = read_length_file(tmp_path / "run" / "lengths.json")  # what --lengths reads
    assert back == plan.request.lengths
    # a study stores the request, lengths and all, and a resumed search reads it back
    request = plan.request
    assert PlanRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request
