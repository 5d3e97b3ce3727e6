"""`bench/gpu_check.py`, the prepared GPU check, runs on CPU (`--device cpu --quick`) in the suite,
so that the script a lent GPU runs has not rotted: every section's rows, its budget said first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def test_the_gpu_check_runs_every_section_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out),
         "--only", "replay,int8,plan,probe"],
        capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    text = run.stdout
    # its budget is printed before anything runs, and it is the sum of its sections
    first = text.splitlines()[0]
    assert first.startswith("gpu_check on cpu: replay 90 s, int8 60 s, plan 90 s, probe 60 s")
    assert "at most 300 s in all" in first
    rows = json.loads((out / "gpu_check.json").read_text())["rows"]
    by_section = {
        s: [r for r in rows if r["section"] == s] for s in ("replay", "int8", "plan", "probe")
    }
    # one replayed config per path of the first GPU run, param offload among them
    assert len(by_section["replay"]) == 5
    assert all(r["status"] == "ok" for r in by_section["replay"]), by_section["replay"]
    assert any("offload=params" in r["name"] for r in by_section["replay"])
    assert [r["name"].split(" ", 1)[1] for r in by_section["int8"]] == [
        "int8 eager", "int8 compiled",
    ]  # fmt: skip
    [plan] = by_section["plan"]
    assert plan["status"] == "ok" and plan["winner"] and plan["verified"], plan
    # issue 33's probe: each case's steps timed by phase beside the ops each phase dispatched,
    # which for the plain module are the ops the estimate counts (at a reduced width) exactly
    probes = {r["name"].split(" ", 1)[1]: r for r in by_section["probe"]}
    assert list(probes) == ["e5 memory", "a0 host", "a2 host"], by_section["probe"]
    for name, r in probes.items():
        assert r["status"] == "ok", r
        assert len(r["phases_s"]) == 2 and all(p["step"] > 0 for p in r["phases_s"])
        assert set(r["ops"]) == {"forward", "backward", "optimizer"}
        if "host" in name:
            assert r["ops"]["forward"] + r["ops"]["backward"] == pytest.approx(
                r["est_ops"], abs=0.5
            )
        assert "record" not in r  # the allocator's record is CUDA's
    assert "section status" in text  # the table, last


@pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")
def test_the_gpu_check_without_a_gpu_says_what_to_run() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "--device cpu --quick" in run.stderr
