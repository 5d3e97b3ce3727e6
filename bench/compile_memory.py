"""What does `compile: true` change in memory? Eager vs compiled CPU trials, against the estimate.

    python bench/compile_memory.py [--models llama-debug,llama-mini] [--paths 2,1]
                                   [--kinds full,lora,nf4] [--policies none,full,selective]
                                   [--repeat N] [--json out.json]

Issue 23 section 3. For each model (default `llama-debug` and `llama-mini`, seq 128, micro-batch
2), path (FSDP2 with `wrap: layer` on 2 gloo ranks, the plain module `wrap: none` on 1 rank),
kind (a full fine-tune, LoRA r16, NF4 r16) and checkpointing policy (`none`, `full`,
`selective`), runs the CPU trial eager and compiled (`compile: true`, each decoder layer
`torch.compile`d after checkpointing, `autofit/builder/compile.py`) as `bench/accuracy.py`'s
`run_grid` does (`run_trial(..., device="cpu", steps=2, warmup=1)`), and prints the measured peak
of each (`TrialResult.peak_bytes`: live tensor bytes from the trials' dispatch-level tracker, max
over ranks; inductor's own buffers are counted), compiled / eager, and the estimate
(`autofit.estimate(model, cpu_hardware(ranks), config, device="cpu").peak_allocated_bytes`, for
the eager and for the compiled config) with its error against each measurement. `--repeat N`
runs each eager trial N times (FSDP2 full fine-tunes move by a few percent from run to run with
the timing of gloo's all-gathers) and reports the spread. Ends with compiled / eager per kind and
policy. `--json` is rewritten after every pair, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autofit.config import Config  # noqa: E402
from autofit.models import resolve_model  # noqa: E402
from autofit.trials import TrialResult, run_trial  # noqa: E402
from bench.accuracy import estimator  # noqa: E402

BASE = {"seq_len": 128, "micro_batch": 2}
KINDS: dict[str, dict[str, Any]] = {
    "full": {},
    "lora": {"lora_rank": 16},
    "nf4": {"lora_rank": 16, "quant": "nf4"},
}
POLICIES = ("none", "full", "selective")
PATHS = {2: "layer", 1: "none"}  # ranks -> wrap
MIB = 2**20


def trial(spec: Any, cfg: Config, ranks: int) -> TrialResult:
    return run_trial(spec, cfg, nprocs=ranks, device="cpu", steps=2, warmup=1, timeout_s=1800)


def grid(models: list[str], paths: list[int], kinds: list[str], policies: list[str]) -> list[Any]:
    return [
        (m, ranks, kind, policy)
        for m in models
        for ranks in paths
        for kind in kinds
        for policy in policies
    ]


def _err(estimate: int | None, measured: int | None) -> float | None:
    return estimate / measured - 1 if estimate and measured else None


def run(cells: list[Any], repeat: int, out: Path | None) -> list[dict[str, Any]]:
    est = estimator()
    rows: list[dict[str, Any]] = []
    head = ("model", "ranks", "config", "eager", "compiled", "c/e", "estimate", "err(e)",
            "err(c)", "est(c)", "compile_s", "wall")  # fmt: skip
    print("{:12} {:>5} {:38} {:>8} {:>8} {:>6} {:>8} {:>7} {:>7} {:>8} {:>9} {:>6}".format(*head))
    for model, ranks, kind, policy in cells:
        spec = resolve_model(model)
        knobs = {**BASE, **KINDS[kind], "checkpointing": policy, "wrap": PATHS[ranks]}
        cfg = Config(**knobs)
        compiled_cfg = cfg.replace(compile=True)
        start = time.monotonic()
        eagers = [trial(spec, cfg, ranks) for _ in range(repeat)]
        comp = trial(spec, compiled_cfg, ranks)
        guess = est(spec, cfg, ranks) if est else None
        guess_c = est(spec, compiled_cfg, ranks) if est else None
        ok = [r.peak_bytes for r in eagers if r.status == "ok" and r.peak_bytes]
        eager = int(statistics.median(ok)) if ok else None
        compiled = comp.peak_bytes if comp.status == "ok" else None
        estimate = guess.peak_allocated_bytes if guess else None
        estimate_c = guess_c.peak_allocated_bytes if guess_c else None
        row = {
            "model": spec.name, "ranks": ranks, "kind": kind, "checkpointing": policy,
            "config": cfg.to_dict(), "sharding": comp.sharding or eagers[0].sharding,
            "eager": eager, "eager_runs": ok, "compiled": compiled,
            "ratio": compiled / eager if compiled and eager else None,
            "estimate": estimate, "estimate_compiled": estimate_c,
            "error_eager": _err(estimate, eager), "error_compiled": _err(estimate_c, compiled),
            "phase": guess.peak_phase if guess else None,
            "breakdown": guess.breakdown if guess else None,
            "eager_status": [r.status for r in eagers], "compiled_status": comp.status,
            "compile_s": comp.compile_s, "graphs": comp.graphs,
            "graph_breaks": comp.graph_breaks, "recompiles": comp.recompiles,
            "eager_losses": eagers[0].losses, "compiled_losses": comp.losses,
            "wall_s": time.monotonic() - start,
            "message": "\n".join(r.message[:400] for r in [*eagers, comp] if r.status != "ok"),
        }  # fmt: skip
        rows.append(row)
        mib = lambda b: f"{b / MIB:8.2f}" if b else "       -"  # noqa: E731
        pct = lambda e: f"{e:+7.1%}" if e is not None else "      -"  # noqa: E731
        ratio = f"{row['ratio']:6.3f}" if row["ratio"] else "     -"
        spread = ""
        if len(ok) > 1:
            spread = f"  eager {min(ok) / MIB:.2f}-{max(ok) / MIB:.2f}"
        label = Config(**{**knobs, "compile": False}).short()
        compile_s = f"{comp.compile_s:9.1f}" if comp.compile_s is not None else "        -"
        print(f"{spec.name:12} {ranks:5} {label:38} {mib(eager)} {mib(compiled)} {ratio} "
              f"{mib(estimate)} {pct(row['error_eager'])} {pct(row['error_compiled'])} "
              f"{mib(estimate_c)} {compile_s} {row['wall_s']:6.0f}{spread}",
              flush=True)  # fmt: skip
        if row["message"]:
            print("   ", row["message"].splitlines()[0], flush=True)
        if out:
            out.write_text(json.dumps(rows, indent=1))
    return rows


def summary(rows: list[dict[str, Any]]) -> None:
    """Compiled / eager per kind and policy (both paths, both models), and the worst error."""
    print(f"\n{'kind':5} {'policy':9} {'pairs':>5} {'min c/e':>8} {'median':>8} {'max c/e':>8}")
    for kind in KINDS:
        for policy in POLICIES:
            ratios = [
                r["ratio"]
                for r in rows
                if r["kind"] == kind and r["checkpointing"] == policy and r["ratio"]
            ]
            if ratios:
                print(f"{kind:5} {policy:9} {len(ratios):5} {min(ratios):8.3f} "
                      f"{statistics.median(ratios):8.3f} {max(ratios):8.3f}")  # fmt: skip
    for which in ("eager", "compiled"):
        errs = [r for r in rows if r[f"error_{which}"] is not None]
        if errs:
            under = min(errs, key=lambda r: r[f"error_{which}"])
            print(f"estimate vs {which:8}: {len(errs)} trials, median |error| "
                  f"{statistics.median(abs(r[f'error_{which}']) for r in errs):.1%}, worst under "
                  f"{under[f'error_{which}']:+.1%} ({under['model']} x{under['ranks']} "
                  f"{under['kind']} ckpt={under['checkpointing']})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-debug,llama-mini")
    parser.add_argument("--paths", default="2,1", help="ranks: 2 (FSDP2 wrap=layer), 1 (plain)")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--repeat", type=int, default=1, help="eager runs per config")
    parser.add_argument("--json", type=Path, help="write every row here (after each pair)")
    args = parser.parse_args()
    start = time.monotonic()
    cells = grid(
        args.models.split(","),
        [int(p) for p in args.paths.split(",")],
        args.kinds.split(","),
        args.policies.split(","),
    )
    rows = run(cells, max(args.repeat, 1), args.json)
    summary(rows)
    print(f"\nwall time {time.monotonic() - start:.0f} s for {len(rows)} pairs")


if __name__ == "__main__":
    main()
