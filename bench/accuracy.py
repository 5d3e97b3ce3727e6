"""How close is the napkin estimate to what real trials measure? (CPU, 2 gloo processes)

    python bench/accuracy.py [--quick] [--nprocs 2] [--json out.json]

Runs a grid of >= 30 CPU trials of `llama-debug` and `llama-mini` across the knobs, estimates
each with `autofit.estimate.estimate(..., device="cpu")`, and prints per-trial estimate vs
measured peak (tensor bytes from the trial's dispatch-level tracker), then the median,
90th-percentile and worst relative error and how often the estimate was below the measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autofit.config import Config  # noqa: E402
from autofit.models import resolve_model  # noqa: E402
from autofit.trial import run_trial  # noqa: E402

# (model, knobs): every knob value appears at least once, on both models.
GRID: list[tuple[str, dict]] = [
    *(
        (m, k)
        for m in ("llama-debug", "llama-mini")
        for k in (
            {},
            {"lora_rank": 16},
            {"lora_rank": 16, "quant": "nf4"},
            {"lora_rank": 16, "quant": "int8"},
            {"checkpointing": "full"},
            {"lora_rank": 16, "checkpointing": "full"},
            {"lora_rank": 16, "quant": "nf4", "checkpointing": "selective"},
            {"checkpointing": "every-2", "micro_batch": 4},
            {"wrap": "none"},
            {"wrap": "every-2", "reshard": False},
            {"wrap": "model"},
            {"grad_accum": 2},
            {"precision": "bf16"},
            {"lora_rank": 16, "precision": "bf16", "micro_batch": 4},
            {"offload": "optimizer"},
            {"lora_rank": 16, "quant": "nf4", "offload": "params"},
        )
    ),
    ("llama-debug", {"optimizer": "adamw8bit"}),
    ("llama-mini", {"lora_rank": 64, "quant": "nf4", "optimizer": "adamw8bit"}),
]
QUICK = [GRID[i] for i in (0, 1, 2, 3, 4, 8)]
BASE = {"seq_len": 128, "micro_batch": 2}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def estimator():  # type: ignore[no-untyped-def]
    try:
        from autofit.estimate import estimate
        from autofit.hardware import cpu_hardware
    except ImportError as exc:  # the estimator is built alongside; measure anyway
        print(f"(no estimator: {exc}; printing measurements only)", file=sys.stderr)
        return None
    return lambda spec, cfg, n: estimate(spec, cpu_hardware(n), cfg, device="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 trials instead of the grid")
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args()
    est = estimator()
    rows = []
    print(f"{'model':12} {'config':48} {'status':7} {'measured':>9} {'estimate':>9} {'err':>7}")
    for model, knobs in QUICK if args.quick else GRID:
        cfg = Config(**{**BASE, **knobs})
        spec = resolve_model(model)
        start = time.monotonic()
        res = run_trial(spec, cfg, nprocs=args.nprocs, device="cpu", steps=2, warmup=1)
        guess = est(spec, cfg, args.nprocs).peak_allocated_bytes if est else None
        err = None
        if res.status == "ok" and guess is not None:
            err = (guess - res.peak_bytes) / res.peak_bytes
        rows.append({"model": model, "config": cfg.to_dict(), "status": res.status,
                     "measured": res.peak_bytes, "estimate": guess, "error": err,
                     "losses": res.losses, "wall_s": time.monotonic() - start,
                     "message": res.message[-300:]})  # fmt: skip
        mib = lambda b: f"{b / 2**20:8.1f}M" if b else "       -"  # noqa: E731
        shown = f"{err:+7.1%}" if err is not None else "      -"
        print(f"{model:12} {cfg.short():48} {res.status:7} {mib(res.peak_bytes)} {mib(guess)} "
              f"{shown}", flush=True)  # fmt: skip
        if res.status != "ok":
            print("   ", res.message.splitlines()[0] if res.message else "", flush=True)
    errors = [r["error"] for r in rows if r["error"] is not None]
    if errors:
        absolute = [abs(e) for e in errors]
        below = sum(e < 0 for e in errors)
        print(f"\n{len(errors)} trials compared")
        p90 = percentile(absolute, 0.9)
        print(f"median |error| {statistics.median(absolute):.1%}   "
              f"p90 |error| {p90:.1%}   worst {max(absolute):.1%}")  # fmt: skip
        print(f"estimate below measurement: {below}/{len(errors)} ({below / len(errors):.0%})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
