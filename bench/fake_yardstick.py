"""Second yardstick for the napkin at real scale (7B-70B) without a GPU.

torch's `FSDPMemTracker` runs the real FSDP2 training step of autofit's own builder under
`FakeTensorMode` with the `fake` process group (no memory is allocated, no rank exists but 0) and
reports the peak tensor memory of one rank by category (`tests/estimate/fake_tracker.py`, which
the suite's `tests/estimate/test_against_tracker.py` runs too, on small models). This script
compares it with the napkin's `peak_allocated_bytes` for the same configs and prints the error of
each.

Only FSDP2 configs (`wrap` layer, every-2, model): the tracker follows `fully_shard` units, and
`wrap: none` is not FSDP2 (the plain module on one GPU, DDP replicas on several). The model is
laid out as the builder does it (torchtitan: embedding unit, layer units, `[norm, head]` unit kept
gathered after forward, root).

    python bench/fake_yardstick.py                 # the default grid (a few minutes)
    python bench/fake_yardstick.py --quick         # two configs
    python bench/fake_yardstick.py --detail        # with both breakdowns and the peak's place

What the tracker does not see: CUDA context and caching-allocator slack (compared: allocated
bytes only), and quantized tensor subclasses it cannot fake (NF4/int8 rows are skipped where
torchao's subclasses refuse fake tensors).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.estimate.fake_tracker import trace  # noqa: E402 - the machinery the suite shares

GRID = [
    # (model, gpus, knobs)
    ("llama-7b", 8, {}),
    ("llama-7b", 8, {"checkpointing": "full", "micro_batch": 4}),
    ("llama-7b", 8, {"checkpointing": "selective", "micro_batch": 2}),
    ("llama-7b", 8, {"reshard": False, "micro_batch": 2, "checkpointing": "full"}),
    ("llama-7b", 8, {"precision": "bf16", "micro_batch": 2, "checkpointing": "every-2"}),
    # grad_accum > 1 is not traceable: FSDPMemTracker refuses several forwards per step.
    ("llama-7b", 2, {"lora_rank": 64, "checkpointing": "full", "micro_batch": 4}),
    ("llama-7b", 1, {"lora_rank": 16, "micro_batch": 1}),
    ("llama-7b", 8, {"wrap": "every-2", "checkpointing": "full", "micro_batch": 2}),
    ("llama-13b", 8, {"checkpointing": "full", "micro_batch": 2}),
    ("llama-3-8b", 8, {"checkpointing": "full", "micro_batch": 2}),
    ("llama-70b", 8, {"lora_rank": 16, "checkpointing": "full", "micro_batch": 1}),
    ("llama-70b", 8, {"checkpointing": "full", "micro_batch": 1}),
    ("llama-7b", 8, {"wrap": "model", "checkpointing": "full", "micro_batch": 2}),
    ("llama-7b", 2, {"wrap": "model", "lora_rank": 16, "micro_batch": 2, "checkpointing": "full"}),
    ("mistral-7b", 4, {"lora_rank": 32, "micro_batch": 2, "checkpointing": "selective"}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two configs only")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--only", help="only rows whose 'model knobs' text contains this")
    parser.add_argument(
        "--detail", action="store_true", help="also print both breakdowns and where the peak was"
    )
    args = parser.parse_args()

    from autofit.estimate import estimate
    from autofit.hardware import preset_hardware

    grid = GRID[:2] if args.quick else GRID
    if args.only:
        grid = [row for row in grid if args.only in f"{row[0]} {row[2]}"]
    rows = []
    for model_name, world, knobs in grid:
        start = time.perf_counter()
        try:
            measured, where, cfg, spec = trace(model_name, world, knobs)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{model_name} x{world} {knobs}: tracer failed: {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=2)
            continue
        est = estimate(spec, preset_hardware(world, "h100-80gb"), cfg, device="cuda")
        total = measured["Total"]
        err = (est.peak_tensor_bytes - total) / total
        rows.append(
            {
                "model": model_name,
                "gpus": world,
                "config": cfg.short(),
                "tracker_bytes": total,
                "estimate_bytes": est.peak_tensor_bytes,
                "error": err,
                "tracker": measured,
                "tracker_peak_at": where,
                "estimate_phase": est.peak_phase,
                "estimate": est.breakdown,
                "seconds": time.perf_counter() - start,
            }
        )
        print(
            f"{model_name:>11} x{world} {cfg.short():<48} tracker {total / 2**30:7.2f} GiB  "
            f"napkin {est.peak_tensor_bytes / 2**30:7.2f} GiB  error {err:+7.1%}  "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        if args.detail:
            gib = {k: round(v / 2**30, 2) for k, v in measured.items() if v and k != "Total"}
            print(f"    tracker peak, {where}: {gib}")
            gib = {k: round(v / 2**30, 2) for k, v in est.breakdown.items() if v}
            print(f"    napkin peak at {est.peak_phase}: {gib}", flush=True)
    if rows:
        errs = [abs(r["error"]) for r in rows]
        below = sum(r["error"] < 0 for r in rows)
        print(
            f"\n{len(rows)} configs: median |error| {statistics.median(errs):.1%}, "
            f"worst {max(errs):.1%}, napkin below tracker in {below}/{len(rows)}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
