"""Running an example training script as an export's note says, for the tests that hold it to
the trial its plan measured."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def peaks_as_its_trial(  # type: ignore[no-untyped-def]
    script: Path, paths: list[Path], trial, tmp_path: Path, runner: list[str] | None = None
) -> None:
    """`script` launched as the export's note says (`--arguments`, `--plan`; by `runner`, else
    `python`) for three steps trains and peaks within 1% of `trial`'s peak."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [*(runner or [sys.executable]), str(script), "--arguments", str(paths[0]),
         "--plan", str(paths[1]), "--steps", "3", "--peak"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 3, proc.stdout
    (peak,) = (int(x) for x in re.findall(r"peak bytes: (\d+)", proc.stdout))
    # the example's peak is from the build on, the trial's of its steps (the build's is below)
    assert abs(peak / trial.peak_bytes - 1) < 0.01, (peak, trial.peak_bytes, proc.stdout)
