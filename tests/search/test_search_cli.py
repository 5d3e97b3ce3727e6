"""`autofit plan` / `autofit export` errors that must come before any trial runs."""

from __future__ import annotations

from typer.testing import CliRunner

from autofit.cli import app

runner = CliRunner()


def test_unknown_export_format_fails_before_any_trial(tmp_path):
    result = runner.invoke(app, [
        "plan", "-m", "llama-debug", "-g", "2", "--device", "cpu", "--trials", "3",
        "--run-dir", str(tmp_path / "run"), "--export", str(tmp_path / "x.json"),
        "--format", "deepspeed",
    ])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "autofit, accelerate, trainer" in result.output
    assert not (tmp_path / "run").exists()


def test_export_of_a_missing_study_names_the_studies_there(tmp_path):
    (tmp_path / "empty.db").touch()  # an existing (empty) database; a missing one is refused
    storage = f"sqlite:///{tmp_path / 'empty.db'}"
    output = str(tmp_path / "p.yaml")
    args = ["export", "--storage", storage, "--study", "nope", "--format", "autofit"]
    result = runner.invoke(app, [*args, "--output", output])
    assert result.exit_code == 2, result.output
    assert "No study named 'nope'" in result.output
    assert not (tmp_path / "p.yaml").exists()


def test_export_json_prints_one_object_and_the_plan_says_cpu_processes(fake, search_kwargs,
                                                                       tmp_path):  # fmt: skip
    """`autofit export --json`: one JSON object on stdout (the README: every command takes
    --json), naming the file written and the launch; a CPU study's plan calls its ranks what they
    were, CPU processes over gloo, not GPUs."""
    import json

    from autofit.search import search

    plan = search(run_trial=fake, **search_kwargs)
    out = tmp_path / "plan.yaml"
    args = ["export", "--storage", plan.storage, "--study", plan.study_name, "-o", str(out)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # the whole of stdout is the one object
    assert data["written"] == [str(out)] and data["format"] == "autofit"
    assert data["best"]["label"] == plan.best.config.short()
    assert data["launch"] and "torchrun" in data["launch"][0]["command"]
    text = out.read_text()
    assert "on 2 CPU processes (gloo)" in text and "2 GPUs" not in text
    assert "tokens_per_s is the whole run's, all 2 CPU processes together" in text

    bad = runner.invoke(app, [*args[:-1], str(tmp_path / "x.yaml"), "--format", "deepspeed",
                              "--json"])  # fmt: skip
    assert bad.exit_code == 2
    assert "Unknown export format" in json.loads(bad.stdout)["error"]


def test_a_searched_plans_report_fits_80_columns(fake, search_kwargs):
    """What `autofit plan` prints after trials (the trials table, the tally, the winner) fits
    an 80-column terminal, and its tokens/s say they are both CPU processes' together."""
    from rich.console import Console

    from autofit.report import plan_report
    from autofit.search import search

    plan = search(run_trial=fake, **search_kwargs)
    console = Console(record=True, width=80)
    plan_report(console, plan)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    text = " ".join(" ".join(lines).split())
    assert "tokens/s: all 2 CPU processes together" in text
    assert "measured" in text and "tokens/s for all 2 CPU processes together" in text
    assert "…" not in text  # nothing cut short
