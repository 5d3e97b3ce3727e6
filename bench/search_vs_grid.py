"""Search vs exhaustive grid on the same small space and machine (CPU, llama-debug, 2 gloo procs).

    python bench/search_vs_grid.py [--trials 6] [--cap 56MiB]

The grid runs a trial of every candidate of the space (no estimate, no pruning) and takes the
fastest that stayed under the headroom line. The search is `autofit.plan` with its budget. Both
use the same trial code, steps and cap. Printed: the search winner's tokens/s as a fraction of
the grid's best (both as measured by the grid, so run-to-run noise does not favour either), and
the trials each spent. Numbers for docs/search.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.plan import rank_key
from autofit.search import search
from autofit.search.candidates import Setting, enumerate_candidates
from autofit.space import parse_space
from autofit.trials import run_trial
from autofit.units import parse_size

SPACE = {
    "seq_len": 64,
    "knobs": {
        "lora_rank": [0, 8],
        "micro_batch": [2, 4, 8],
        "wrap": ["layer", "none"],
        "checkpointing": ["none", "full"],
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--cap", default="56MiB")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--margin", type=float, default=0.05)
    args = parser.parse_args()

    cap = parse_size(args.cap)
    model = resolve_model("llama-debug")
    hw = resolve_hardware("2", device="cpu", gpu_memory=cap)
    space = parse_space(SPACE, "bench", name="bench")
    setting = Setting(model, hw, space, 64, None, args.margin, "cpu", prune=False)
    every = list(enumerate_candidates(setting).all.values())

    start = time.monotonic()
    grid = {}
    for cand in every:
        grid[cand.config] = run_trial(model, cand.config, nprocs=2, device="cpu",
                                      gpu_memory=cap, steps=args.steps, timeout_s=300)  # fmt: skip
        r = grid[cand.config]
        print(f"grid  {cand.config.short():<40} {r.status:<7} "
              f"{(r.tokens_per_s or 0):>8,.0f} tokens/s", flush=True)  # fmt: skip
    grid_s = time.monotonic() - start
    fits = [
        (c, r) for c, r in grid.items()
        if r.status == "ok" and r.peak_bytes <= setting.allowed_bytes
    ]  # fmt: skip
    grid_best, grid_best_r = max(fits, key=lambda cr: cr[1].tokens_per_s)

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        plan = search(
            model=model, hardware=hw, space=space, seq_len=64, trials=args.trials,
            steps=args.steps, margin=args.margin, device="cpu", gpu_memory=cap, run_dir=Path(tmp),
        )  # fmt: skip
    search_s = time.monotonic() - start
    if plan.best is None:
        print("search found no winner:", plan.advice)
        return
    win = plan.best.config
    ratio_grid = grid[win].tokens_per_s / grid_best_r.tokens_per_s if grid[win].ok else 0.0
    ratio_own = plan.best.tokens_per_s / grid_best_r.tokens_per_s
    ranked = sorted(
        (type(plan.best)(c, plan.best.estimate, r) for c, r in fits), key=rank_key
    )  # fmt: skip
    place = [c.config for c in ranked].index(win) + 1 if win in grid else "?"
    print()
    print(f"space: {len(every)} candidates, cap {args.cap}, steps {args.steps}")
    print(f"grid:   best {grid_best.short()}: {grid_best_r.tokens_per_s:,.0f} tokens/s; "
          f"{len(every)} trials, {grid_s:.0f} s")  # fmt: skip
    print(f"search: winner {win.short()}: {plan.best.tokens_per_s:,.0f} tokens/s (own trial); "
          f"{len(plan.trials)} trials + verification, {search_s:.0f} s; "
          f"{sum(plan.pruned.values())} skipped without a trial")  # fmt: skip
    print(f"winner / grid best (both grid-measured): {ratio_grid:.2f}; (search's own "
          f"measurement / grid best): {ratio_own:.2f}; winner is #{place} of {len(fits)} "
          "that fit in the grid")  # fmt: skip


if __name__ == "__main__":
    main()
