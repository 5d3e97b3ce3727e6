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
