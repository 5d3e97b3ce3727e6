"""How long each command takes cold, and whether its stderr is autofit's own.

Each command runs in a fresh interpreter with an empty cache (`AUTOFIT_CACHE_DIR` a new folder,
so no structure, trace or calibration of an earlier run helps), one after the other in one run;
its wall time is shown beside `python -c "import autofit"` measured the same way, as a ratio, so
a loaded machine slows the yardstick too. A command passes when its ratio is within its goal
(issue 25's goal in seconds over `REFERENCE_IMPORT_S`, the import's time on the idle 2-core
machine the goals were set on) and every stderr line is one autofit writes (`OWN_LINES`).

The export reads a study made first, untimed: the README's CPU example (llama-debug on 2 CPU
processes, `examples/tiny_space.yaml`), its trials "measured" as the estimate says (no process
runs). (Exporting a study of a whole default space re-estimates its 68,160 candidates as the
plan did: a warm plan's time, cold or not.) `--local-config` adds a plan of a local
`config.json` of a known family that no preset has: it traces (the goal allows that 15 s, with a
progress line).

`--fake torch=2.11.0+cu130,transformers=5.23.0` runs every command as if those releases were
installed (`importlib.metadata.version` answers them, `faked`; nothing else changes): a preset's
plan reads the shipped traces only where they trace alike with these
(`autofit.arch.shipped.TRACED_ALIKE`), else it traces.

Run: `python bench/cold_start.py [--repeat N] [--local-config] [--fake DIST=VERSION,...]`; exit 1
when a command misses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REFERENCE_IMPORT_S = 0.20
"""`python -c "import autofit"` on the idle 2-core machine issue 25's goals were measured on."""

OWN_LINES = re.compile(r"^(Tracing |warning: |note: |error: )")
"""The lines autofit writes on stderr in these commands: a model traced for the first time
(`autofit.arch.trace_notices`), its warnings, notes and errors."""

LOCAL_CONFIG = {  # a Llama of a width no preset has: traced, not shipped
    "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 5632,
    "vocab_size": 32000, "max_position_embeddings": 4096,
}  # fmt: skip


@dataclass
class Case:
    name: str
    args: list[str]
    goal_s: float | None  # issue 25's goal on the idle machine; None: the yardstick


def cases(folder: Path, study: tuple[str, str], local: bool) -> list[Case]:
    storage, name = study

    def autofit(name: str, line: str, goal_s: float, *paths: str) -> Case:
        return Case(name, ["-m", "autofit", *line.split(), *paths], goal_s)

    found = [
        Case("python -c 'import autofit'", ["-c", "import autofit"], None),
        autofit("autofit --help", "--help", 1.5),
        autofit("autofit hardware", "hardware", 1.5),
        autofit("autofit models", "models", 1.5),
        autofit(
            "autofit export",
            f"export --storage {storage} --study {name} --output",
            1.5,
            str(folder / "exported.yaml"),
        ),
        autofit(
            "README main job (llama-7b 2xrtx3090)",
            "plan --model llama-7b --gpus 2xrtx3090 --no-trials --run-dir",
            3.0,
            str(folder / "main"),
        ),
        autofit(
            "plan llama-70b 8xh100-80gb",
            "plan --model llama-70b --gpus 8xh100-80gb --no-trials --run-dir",
            5.0,
            str(folder / "70b"),
        ),
        autofit(
            "estimate (README line)",
            "estimate --model llama-7b --gpus 1xrtx3090 --quant nf4 "
            "--lora-rank 64 --checkpointing full",
            5.0,
        ),
    ]
    if local:
        config = folder / "local" / "config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(LOCAL_CONFIG))
        found.append(
            autofit("plan of a local config.json (traced)", "plan --gpus 2xrtx3090 --no-trials "
                    "--model", 15.0, str(config), "--run-dir", str(folder / "local-run"))
        )  # fmt: skip
    return found


def make_study(folder: Path) -> tuple[str, str]:
    """The README's CPU example as a finished study (`plan --model llama-debug --gpus 2 --device
    cpu --gpu-memory 40MiB --seq-len 64 --space examples/tiny_space.yaml --trials 4 --steps 2`),
    its trials measuring what the estimate says (made in this process, untimed; nothing is
    launched)."""
    os.environ["AUTOFIT_CACHE_DIR"] = str(folder / "setup-cache")
    from autofit.estimate import estimate
    from autofit.hardware import resolve_hardware
    from autofit.models import resolve_model
    from autofit.search import search
    from autofit.space_file import load_space
    from autofit.trials import TrialResult
    from autofit.units import MiB

    cap = 40 * MiB
    hardware = resolve_hardware("2", device="cpu", gpu_memory=cap)

    def measured(model: Any, config: Any, *, nprocs: int, steps: int, **_: Any) -> TrialResult:
        est = estimate(model, hardware, config, device="cpu")
        result = TrialResult(status="ok", config=config.to_dict(), model=model.name,
                             device="cpu", nprocs=nprocs, capacity_bytes=cap)  # fmt: skip
        if est.peak_bytes > cap:
            result.status, result.message = "oom", "CPU trial out of memory"
            return result
        result.peak_bytes = result.peak_allocated_bytes = int(est.peak_bytes)
        result.tokens_per_s, result.step_time_s = est.tokens_per_s, est.step_time_s
        result.losses = [2.0] * (steps + 1)
        return result

    storage = f"sqlite:///{folder / 'study.db'}"
    space = Path(__file__).resolve().parent.parent / "examples" / "tiny_space.yaml"
    search(
        model=resolve_model("llama-debug"), hardware=hardware, space=load_space(space),
        seq_len=64, trials=4, steps=2, device="cpu", gpu_memory=cap, storage=storage,
        study="bench", run_dir=folder / "study-run", run_trial=measured, seed=0,
    )  # fmt: skip
    return storage, "bench"


_FAKED = """
import importlib.metadata as m, json, runpy, sys
fake, real = json.loads(sys.argv[1]), m.version
m.version = lambda dist: fake.get(dist) or real(dist)
sys.argv = ["autofit", *sys.argv[2:]]
try:
    runpy.run_module("autofit", run_name="__main__", alter_sys=True)
finally:
    print("torch imported" if "torch" in sys.modules else "torch not imported", file=sys.stderr)
"""
FAKED_LAST_LINE = re.compile(r"^torch (not )?imported$")
"""The line `faked` adds at the end of stderr: whether the command imported torch."""


def faked(args: list[str], fake: dict[str, str]) -> list[str]:
    """The interpreter arguments of `python -m autofit ...` (`args`) run as if the releases of
    `fake` were installed: `importlib.metadata.version` answers them (the versions autofit
    reads, `autofit.arch.shipped.installed_versions`); stderr's last line says whether torch
    was imported."""
    assert args[:2] == ["-m", "autofit"], args
    return ["-c", _FAKED, json.dumps(fake), *args[2:]]


def run_cold(
    case: Case, folder: Path, fake: dict[str, str] | None = None
) -> tuple[float, list[str], int]:
    """Wall seconds, the stderr lines not autofit's own, and the exit code of one cold run."""
    env = {**os.environ, "AUTOFIT_CACHE_DIR": tempfile.mkdtemp(dir=folder, prefix="cache-")}
    env.pop("AUTOFIT_VERBOSE", None)
    args = faked(case.args, fake) if fake and case.args[:2] == ["-m", "autofit"] else case.args
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          cwd=folder)  # fmt: skip
    took = time.perf_counter() - started
    foreign = [
        line
        for line in done.stderr.splitlines()
        if line and not OWN_LINES.match(line) and not FAKED_LAST_LINE.match(line)
    ]
    return took, foreign, done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="cold runs each; the median shown")
    parser.add_argument("--local-config", action="store_true", help="also plan a traced model")
    parser.add_argument("--fake", default="", help="DIST=VERSION,...: releases to fake")
    args = parser.parse_args(argv)
    fake = dict(pair.split("=", 1) for pair in args.fake.split(",") if pair)
    with tempfile.TemporaryDirectory(prefix="autofit-cold-") as tmp:
        folder = Path(tmp)
        study = make_study(folder)
        base = None
        missed = 0
        print(f"{'command':40} {'s':>7} {'x import':>9} {'goal':>7}  stderr")
        for case in cases(folder, study, args.local_config):
            runs = [run_cold(case, folder, fake) for _ in range(max(args.repeat, 1))]
            took = statistics.median(r[0] for r in runs)
            foreign = [line for r in runs for line in r[1]]
            failed = [r[2] for r in runs if r[2] not in (0,)]
            if base is None:
                base = took
            ratio = took / base
            goal = "" if case.goal_s is None else f"{case.goal_s / REFERENCE_IMPORT_S:.3g}x"
            ok = case.goal_s is None or ratio <= case.goal_s / REFERENCE_IMPORT_S
            quiet = "own" if not foreign else f"{len(foreign)} foreign line(s)"
            mark = "" if ok and not foreign and not failed else "  <-- MISSED"
            missed += bool(mark)
            print(f"{case.name:40} {took:7.2f} {ratio:8.1f}x {goal:>7}  {quiet}"
                  f"{f' exit {failed[0]}' if failed else ''}{mark}")  # fmt: skip
            for line in dict.fromkeys(foreign):
                print(f"    {line[:150]}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
