"""How close is the napkin estimate to what real trials measure? (CPU, gloo processes)

    python bench/accuracy.py [--quick] [--nprocs 2] [--json out.json]

Runs a grid of CPU trials of `llama-debug` and `llama-mini` across the knobs and every path a job
can take (the plain module on one rank, DDP replicas and FSDP2 on `--nprocs` ranks, FSDP2 with
param offload on one rank), estimates each with `autofit.estimate.estimate(..., device="cpu")`,
and prints per-trial estimate vs measured peak (tensor bytes from the trial's dispatch-level
tracker) and the build's own peak, then the median, 90th-percentile and worst relative error
(overall and per path) and how often the estimate was below the measurement.
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
from autofit.trials import run_trial  # noqa: E402

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
# One GPU: the plain module (wrap none) and FSDP2 with param offload on a one-rank mesh.
ONE_RANK: list[tuple[str, dict]] = [
    (m, k)
    for m in ("llama-debug", "llama-mini")
    for k in (
        {"wrap": "none"},
        {"wrap": "none", "lora_rank": 16},
        {"wrap": "none", "lora_rank": 16, "quant": "nf4", "checkpointing": "full"},
        {"wrap": "none", "lora_rank": 16, "quant": "int8"},
        {"wrap": "none", "precision": "bf16", "micro_batch": 4},
        {"wrap": "none", "grad_accum": 2, "checkpointing": "selective"},
        {"wrap": "none", "offload": "optimizer", "lora_rank": 16},
        {"wrap": "layer", "lora_rank": 16, "quant": "nf4", "offload": "params"},
    )
]
QUICK = [GRID[i] for i in (0, 1, 2, 3, 4, 8)]
QUICK_ONE_RANK = [ONE_RANK[i] for i in (0, 1, 2)]
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
    print(f"{'model':12} {'ranks':>5} {'config':48} {'path':5} {'status':7} {'measured':>9} "
          f"{'estimate':>9} {'err':>7} {'build':>9}")  # fmt: skip
    grid = [(m, k, args.nprocs) for m, k in (QUICK if args.quick else GRID)]
    grid += [(m, k, 1) for m, k in (QUICK_ONE_RANK if args.quick else ONE_RANK)]
    for model, knobs, ranks in grid:
        cfg = Config(**{**BASE, **knobs})
        spec = resolve_model(model)
        start = time.monotonic()
        res = run_trial(spec, cfg, nprocs=ranks, device="cpu", steps=2, warmup=1)
        guess = est(spec, cfg, ranks).peak_allocated_bytes if est else None
        err = None
        if res.status == "ok" and guess is not None:
            err = (guess - res.peak_bytes) / res.peak_bytes
        rows.append({"model": model, "ranks": ranks, "sharding": res.sharding,
                     "config": cfg.to_dict(), "status": res.status,
                     "measured": res.peak_bytes, "build_peak": res.build_peak_bytes,
                     "estimate": guess, "error": err,
                     "losses": res.losses, "wall_s": time.monotonic() - start,
                     "message": res.message[-300:]})  # fmt: skip
        mib = lambda b: f"{b / 2**20:8.1f}M" if b else "       -"  # noqa: E731
        shown = f"{err:+7.1%}" if err is not None else "      -"
        print(f"{model:12} {ranks:5} {cfg.short():48} {res.sharding or '-':5} {res.status:7} "
              f"{mib(res.peak_bytes)} {mib(guess)} {shown} {mib(res.build_peak_bytes)}",
              flush=True)  # fmt: skip
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
        for path in ("none", "ddp", "fsdp2"):
            errs = [
                abs(r["error"]) for r in rows if r["sharding"] == path and r["error"] is not None
            ]
            if errs:
                print(f"  {path:5}: {len(errs):2} trials, median |error| "
                      f"{statistics.median(errs):.1%}, worst {max(errs):.1%}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
