"""Re-estimate a saved run's measurements with the current estimator (no trial, no tracker).

    python bench/reestimate.py accuracy.json    # rows of `bench/accuracy.py [--families] --json`
    python bench/reestimate.py fake.json        # rows of `bench/fake_yardstick.py --json`

The measurements of both benches do not depend on the estimator (a trial's peak is the builder's,
the tracker's is the fake step's), so when only the estimate changes, the saved rows are
re-estimated exactly as the benches estimate them (same model, config and ranks; CPU trials on
`cpu_hardware(ranks)` with `device="cpu"`, tracker rows on `h100-80gb` presets with
`device="cuda"`) and the benches' summaries printed again, with each row's previous estimate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autofit.config import Config  # noqa: E402
from autofit.estimate import estimate  # noqa: E402
from autofit.hardware import cpu_hardware, preset_hardware  # noqa: E402
from autofit.models import resolve_model  # noqa: E402


def _summary(errors: list[float]) -> str:
    absolute = [abs(e) for e in errors]
    under = [e for e in errors if e < 0]
    worst_under = f", by at most {-min(under):.1%}" if under else ""
    return (f"median |error| {statistics.median(absolute):.1%}   "
            f"p90 |error| {_percentile(absolute, 0.9):.1%}   worst {max(absolute):.1%}   "
            f"below in {len(under)}/{len(errors)}{worst_under}")  # fmt: skip


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def trials(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`bench/accuracy.py` rows: each trial's estimate again, as `run_grid` makes it."""
    mib = lambda b: f"{b / 2**20:8.1f}"  # noqa: E731
    print(f"{'model':14} {'ranks':>5} {'config':48} {'path':5} {'measured':>8} {'was':>8} "
          f"{'now':>8} {'was err':>8} {'err':>8}  phase")  # fmt: skip
    out = []
    for row in rows:
        if row["status"] != "ok" or not row["measured"]:
            continue
        cfg = Config.from_dict(row["config"])
        guess = estimate(resolve_model(row["model"]), cpu_hardware(row["ranks"]), cfg,
                         device="cpu")  # fmt: skip
        new = {**row, "estimate": guess.peak_allocated_bytes, "phase": guess.peak_phase,
               "breakdown": guess.breakdown, "previous_estimate": row["estimate"],
               "previous_error": row["error"]}  # fmt: skip
        new["error"] = (guess.peak_allocated_bytes - row["measured"]) / row["measured"]
        out.append(new)
        print(f"{row['model']:14} {row['ranks']:5} {cfg.short():48} {row['sharding']:5} "
              f"{mib(row['measured'])} {mib(row['estimate'])} {mib(new['estimate'])} "
              f"{row['error']:+8.1%} {new['error']:+8.1%}  {guess.peak_phase}")  # fmt: skip
    print(f"\n{len(out)} trials re-estimated")
    print("now:", _summary([r["error"] for r in out]))
    print("was:", _summary([r["previous_error"] for r in out]))
    for path in ("none", "ddp", "fsdp2"):
        group = [r for r in out if r["sharding"] == path]
        if group:
            now = [abs(r["error"]) for r in group]
            was = [abs(r["previous_error"]) for r in group]
            print(f"  {path:5}: {len(group):2} trials, median |error| "
                  f"{statistics.median(now):.1%} (was {statistics.median(was):.1%}), worst "
                  f"{max(now):.1%} (was {max(was):.1%})")  # fmt: skip
    if len({r["model"] for r in out}) > 2:  # a --families run: its per-family summary too
        from accuracy import family_summary

        family_summary(out)
    return out


def tracker(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`bench/fake_yardstick.py` rows: their config is saved as `Config.short()`, so each is
    matched to the bench's grid entry with the same model, GPU count and config."""
    from fake_yardstick import GRID

    configs = {}
    for model, world, knobs in GRID:
        cfg = Config(**{"seq_len": 2048, **knobs})  # as tests/estimate/fake_tracker.py `trace`
        configs[model, world, cfg.short()] = cfg
    print(f"{'model':>11} {'gpus':>4} {'config':48} {'tracker':>8} {'was':>8} {'now':>8} "
          f"{'was err':>8} {'err':>8}  phase")  # fmt: skip
    out = []
    for row in rows:
        cfg = configs[row["model"], row["gpus"], row["config"]]
        est = estimate(resolve_model(row["model"]), preset_hardware(row["gpus"], "h100-80gb"),
                       cfg, device="cuda")  # fmt: skip
        total = row["tracker_bytes"]
        new = {**row, "estimate_bytes": est.peak_allocated_bytes,
               "estimate_phase": est.peak_phase, "estimate": est.breakdown,
               "previous_estimate_bytes": row["estimate_bytes"], "previous_error": row["error"],
               "error": (est.peak_allocated_bytes - total) / total}  # fmt: skip
        out.append(new)
        gib = lambda b: f"{b / 2**30:8.2f}"  # noqa: E731
        print(f"{row['model']:>11} {row['gpus']:4} {row['config']:48} {gib(total)} "
              f"{gib(row['estimate_bytes'])} {gib(new['estimate_bytes'])} "
              f"{row['error']:+8.1%} {new['error']:+8.1%}  {est.peak_phase}")  # fmt: skip
    print(f"\n{len(out)} configs re-estimated")
    print("now:", _summary([r["error"] for r in out]))
    print("was:", _summary([r["previous_error"] for r in out]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=Path, help="a saved run's --json output")
    parser.add_argument("--json", type=Path, help="write the re-estimated rows here")
    args = parser.parse_args()
    rows = json.loads(args.rows.read_text())
    out = tracker(rows) if rows and "tracker_bytes" in rows[0] else trials(rows)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
