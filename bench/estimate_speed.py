"""How fast the napkin estimator scores a whole space.

Estimates every candidate of the default search space for llama-70b on 8xh100-80gb and prints the
candidate count and the wall time. The design budget is well under a second, so the search can
prune before any trial. Run: `python bench/estimate_speed.py [--repeat N]`.
"""

from __future__ import annotations

import argparse
import sys
import time

from autofit.hardware import resolve_gpus
from autofit.models import resolve_model
from autofit.plan import estimate_space
from autofit.request import PlanRequest
from autofit.space_file import load_space

BUDGET_S = 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-70b")
    parser.add_argument("--gpus", default="8xh100-80gb")
    parser.add_argument("--space", default="default")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the best one is reported")
    args = parser.parse_args(argv)

    model, hardware, space = (
        resolve_model(args.model),
        resolve_gpus(args.gpus),
        load_space(args.space),
    )
    best = float("inf")
    for _ in range(max(args.repeat, 1)):
        start = time.perf_counter()
        fitting, rejected, pruned, considered = estimate_space(
            PlanRequest.of(model, hardware, space)
        )
        best = min(best, time.perf_counter() - start)
    estimated = len(fitting) + len(rejected)
    print(f"{args.model} on {args.gpus}, space '{args.space}':")
    print(
        f"  {considered:,} combinations, {estimated:,} valid candidates estimated "
        f"({len(fitting):,} fit, {estimated - len(fitting):,} pruned by the estimate)"
    )
    print(
        f"  wall time {best:.3f} s (best of {args.repeat}), "
        f"{estimated / best:,.0f} estimates/s; budget {BUDGET_S:.1f} s"
    )
    if best >= BUDGET_S:
        print("  OVER BUDGET", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
