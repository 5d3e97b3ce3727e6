"""`autofit calibrate` for real on CPU (gloo): its trials run, its fit is stored for this machine,
and the next plan here starts from it and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TINY_SPACE = str(Path(__file__).parents[1] / "search" / "tiny_space.yaml")


def autofit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autofit", *args],
        capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )  # fmt: skip


def test_calibrate_on_cpu_is_stored_and_the_next_plan_starts_from_it():
    run = autofit("calibrate", "--device", "cpu", "--gpus", "1", "--quick", "--steps", "2",
                  "--json")  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(run.stdout)
    assert len(data["trials"]) == 6
    assert all(t["status"] == "ok" and t["peak_bytes"] > 0 for t in data["trials"]), data
    assert Path(data["path"]).is_file()
    assert Path(data["path"]).parent == Path(os.environ["AUTOFIT_CALIBRATION_DIR"])
    cal = data["calibration"]
    assert cal["source"] == "stored" and cal["n_trials"] == 6
    assert data["machine"]["device"] == "cpu" and data["machine"]["gpus"].startswith("1x")

    plan = autofit("plan", "--model", "llama-debug", "--device", "cpu", "--gpus", "1",
                   "--space", TINY_SPACE, "--seq-len", "64", "--no-trials")  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "Calibration: this machine's stored calibration" in plan.stdout
    ignored = autofit("plan", "--model", "llama-debug", "--device", "cpu", "--gpus", "1",
                      "--space", TINY_SPACE, "--seq-len", "64", "--no-trials",
                      "--no-calibration", "--json")  # fmt: skip
    assert json.loads(ignored.stdout)["calibration"] is None
