"""Search vs exhaustive grid over several settings (CPU, gloo processes), from measured grids.

    python bench/search_vs_grid.py [--settings llama-offload,qwen2-lora,gemma2-full]
        [--remeasure] [--steps 3] [--fraction 0.25] [--seeds 0,1,2] [--live] [--json PATH]

Phase 1, the grid: a real trial (`autofit.trials.run_trial`) of every candidate of each setting's
space (no estimate, no pruning), saved with the napkin's estimate of it to
`bench/grids/<setting>.json`: the measured truth the searches replay. An existing file is reused
(only candidates it lacks are measured) unless `--remeasure`. Grid trials run without the cap,
so every candidate has a measured peak and speed (the napkin's error is known over the whole
grid); a candidate whose measured peak is over the cap is replayed as the OOM that the capped
trial is (on CPU the cap is the tensor tracker's count passing it, the count measured here).

Phase 2, the searches: `autofit.search.search` with a budget of `--fraction` of the grid's
trials, whose `run_trial` replays the grid's result for the config asked for (no process: noise
free, and the same truth for every search); `--live` runs real trials instead. For each variant
of the search (`calibration` = off, study; a variant `search` does not accept yet is "not
available") and each seed of its sampler it prints the winner's tokens/s as a fraction of the
grid's best (both as the grid measured them), the trials spent (and the verification re-runs
apart), and whether the grid's best was ruled out without a trial. Then the napkin's memory and
speed error over the grid, overall and per value of each knob, and for the `study` variant the
error of the calibration fitted to the study's first 3 trials (`autofit.calibration`) over the
other candidates.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from autofit.config import Config
from autofit.estimate import Estimate
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.plan import Candidate
from autofit.request import PlanRequest
from autofit.search import search
from autofit.search import study as st
from autofit.search.candidates import Setting, enumerate_candidates
from autofit.space_file import parse_space
from autofit.trials import run_trial
from autofit.trials.result import TrialResult
from autofit.units import fmt_size, parse_size

GRIDS = Path(__file__).resolve().parent / "grids"
NPROCS = 2
MARGIN = 0.05
VARIANTS = ("off", "study")
CALIBRATION_TRIALS = 3  # the study's first trials that the calibration is fitted to

# Each setting: a model, a space, the fixed settings and the cap each process is held to.
SETTINGS: dict[str, dict[str, Any]] = {
    # Full fine-tune with offload. At 30MiB only 2 of 40 fit (the measured peaks are the same
    # with or without the cap: try `--cap llama-offload=30MiB`); at 48MiB 12 do, the fastest of
    # them (mb8 ckpt=full offload=params) 2% under the headroom line.
    "llama-offload": {
        "model": "llama-debug",
        "seq_len": 256,
        "global_batch": 16,
        "cap": "48MiB",
        "knobs": {
            "micro_batch": [1, 2, 4, 8],
            "wrap": ["layer", "none"],
            "checkpointing": ["none", "full"],
            "offload": ["none", "params", "optimizer"],
        },
    },
    # LoRA and QLoRA (tied embeddings, q/k/v biases).
    "qwen2-lora": {
        "model": "qwen2-debug",
        "seq_len": 256,
        "global_batch": 16,
        "cap": "24MiB",
        "knobs": {
            "lora_rank": [0, 8, 32],
            "quant": ["none", "nf4"],
            "checkpointing": ["none", "full"],
            "micro_batch": [1, 2, 4, 8],
        },
    },
    # Full fine-tune: sharding, resharding and precision (soft-capping, sliding window).
    "gemma2-full": {
        "model": "gemma2-debug",
        "seq_len": 256,
        "global_batch": 16,
        "cap": "52MiB",
        "knobs": {
            "wrap": ["layer", "model", "none"],
            "reshard": [True, False],
            "precision": ["bf16-mixed", "bf16"],
            "micro_batch": [2, 4, 8],
        },
    },
}


@dataclass
class Bench:
    """One setting: its request pieces, its candidates (with the current napkin) and its grid."""

    name: str
    spec: dict[str, Any]
    steps: int
    cap: int = 0
    model: Any = None
    hardware: Any = None
    space: Any = None
    setting: Setting | None = None
    cands: dict[Config, Candidate] = field(default_factory=dict)
    grid: dict[str, dict[str, Any]] = field(default_factory=dict)  # config key -> stored entry
    grid_s: float = 0.0

    def __post_init__(self) -> None:
        s = self.spec
        self.cap = parse_size(s["cap"])
        self.model = resolve_model(s["model"])
        self.hardware = resolve_hardware(str(NPROCS), device="cpu", gpu_memory=self.cap)
        data = {"seq_len": s["seq_len"], "knobs": s["knobs"]}
        self.space = parse_space(data, f"bench:{self.name}", name=self.name)
        self.setting = Setting(self.model, self.hardware, self.space, s["seq_len"],
                               s["global_batch"], MARGIN, "cpu", prune=False)  # fmt: skip
        self.cands = enumerate_candidates(self.setting).all

    @property
    def path(self) -> Path:
        return GRIDS / f"{self.name}.json"

    @property
    def line(self) -> float:
        return self.setting.allowed_bytes

    def identity(self) -> dict[str, Any]:
        """What a stored grid must match to be reused (not the cap: its trials ran uncapped)."""
        s = self.spec
        return {"model": s["model"], "nprocs": NPROCS, "seq_len": s["seq_len"],
                "global_batch": s["global_batch"], "steps": self.steps}  # fmt: skip

    def measured(self, cfg: Config) -> TrialResult:
        """The grid's uncapped trial of `cfg`."""
        return TrialResult.from_dict(self.grid[st.config_key(cfg)]["result"])

    def replay(self, cfg: Config) -> TrialResult:
        """What a trial held to the cap returns: the uncapped one, or an OOM past the cap."""
        r = self.measured(cfg)
        r.capacity_bytes = self.cap
        peak = max(r.peak_bytes or 0, r.build_peak_bytes or 0)
        if r.ok and peak > self.cap:
            r.message = (f"replayed OOM: the uncapped trial peaked at {fmt_size(peak)}, over the "
                         f"{fmt_size(self.cap)} cap")  # fmt: skip
            r.status, r.oom_of = "oom", "gpu"
            r.peak_bytes = r.tokens_per_s = r.step_time_s = None
            r.losses = []
        return r

    def fits(self, cfg: Config) -> bool:
        r = self.replay(cfg)
        return r.ok and r.peak_bytes is not None and r.peak_bytes <= self.line


# ---- phase 1: the grid ---------------------------------------------------------------------


def estimate_record(e: Estimate) -> dict[str, Any]:
    return {
        "peak_bytes": e.peak_bytes,
        "tokens_per_s": round(e.tokens_per_s, 1),
        "step_time_s": round(e.step_time_s, 6),
        "breakdown": e.breakdown,
        "time_breakdown": {k: round(v, 6) for k, v in e.time_breakdown.items()},
    }


def result_record(r: TrialResult) -> dict[str, Any]:
    """`TrialResult.to_dict()` without the empty fields, the message cut short."""
    data = {k: v for k, v in r.to_dict().items() if v not in (None, [], "")}
    if "message" in data:
        data["message"] = data["message"][-600:]
    for k in ("tokens_per_s", "step_time_s", "wall_s"):
        if k in data:
            data[k] = round(data[k], 6)
    if "losses" in data:
        data["losses"] = [round(x, 5) for x in data["losses"]]
    return data


def load_or_measure(b: Bench, remeasure: bool) -> None:
    stored: dict[str, Any] = {}
    if b.path.exists() and not remeasure:
        stored = json.loads(b.path.read_text())
        if stored.get("identity") != b.identity():
            sys.exit(f"{b.path} was measured for {stored.get('identity')}, not {b.identity()}: "
                     "run with --remeasure")  # fmt: skip
    entries = {st.config_key(Config.from_dict(e["config"])): e
               for e in stored.get("candidates", [])}  # fmt: skip
    b.grid_s = stored.get("grid_s", 0.0)
    todo = [c for c in b.cands.values() if st.config_key(c.config) not in entries]
    if todo:
        print(f"[{b.name}] measuring {len(todo)} of {len(b.cands)} candidates "
              f"({b.steps} steps, {NPROCS} gloo processes, uncapped)", flush=True)  # fmt: skip
    for i, cand in enumerate(todo, 1):
        start = time.monotonic()
        r = run_trial(b.model, cand.config, nprocs=NPROCS, device="cpu", gpu_memory=None,
                      steps=b.steps, timeout_s=600)  # fmt: skip
        b.grid_s += time.monotonic() - start
        entries[st.config_key(cand.config)] = {
            "config": cand.config.to_dict(),
            "estimate": estimate_record(cand.estimate),
            "result": result_record(r),
        }
        peak = fmt_size(r.peak_bytes) if r.peak_bytes else "-"
        print(f"  {i:>3}/{len(todo)} {cand.config.short():<48} {r.status:<7} {peak:>10} "
              f"{(r.tokens_per_s or 0):>9,.0f} tokens/s {r.wall_s:5.1f} s", flush=True)  # fmt: skip
        _save(b, entries, stored)
    b.grid = entries
    if todo:
        _save(b, entries, stored)


def _save(b: Bench, entries: dict[str, Any], stored: dict[str, Any]) -> None:
    GRIDS.mkdir(parents=True, exist_ok=True)
    order = [st.config_key(c) for c in b.cands]
    data = {
        "setting": b.name,
        "identity": b.identity(),
        "space": b.spec["knobs"],
        "trials": "uncapped (a replay turns a peak over the cap into an oom)",
        "machine": stored.get("machine") or f"{platform.node()} {platform.processor()}".strip(),
        "measured": stored.get("measured") or time.strftime("%Y-%m-%d"),
        "grid_s": round(b.grid_s, 1),
        "candidates": [entries[k] for k in order if k in entries]
        + [e for k, e in entries.items() if k not in order],
    }
    b.path.write_text(dump_grid(data))


def dump_grid(data: dict[str, Any]) -> str:
    """JSON with one line per candidate: small, and a re-measured grid diffs line by line."""
    head = {k: v for k, v in data.items() if k != "candidates"}
    lines = ",\n".join(json.dumps(e, separators=(",", ":")) for e in data["candidates"])
    return json.dumps(head, indent=1)[:-2] + ',\n "candidates": [\n' + lines + "\n ]\n}\n"


# ---- the napkin's error over the grid ------------------------------------------------------


def errors(b: Bench) -> list[dict[str, Any]]:
    """Per measured candidate: napkin / measured - 1 for the peak and for tokens/s."""
    out = []
    for cfg, cand in b.cands.items():
        r = b.measured(cfg)
        if not r.ok or not r.peak_bytes or not r.tokens_per_s:
            continue
        out.append({
            "config": cfg,
            "memory": cand.estimate.peak_bytes / r.peak_bytes - 1,
            "speed": cand.estimate.tokens_per_s / r.tokens_per_s - 1,
        })  # fmt: skip
    return out


def summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "median": None, "median_abs": None, "worst_abs": None}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "median_abs": statistics.median(abs(v) for v in values),
        "worst_abs": max(abs(v) for v in values),
    }


def napkin_report(b: Bench) -> dict[str, Any]:
    errs = errors(b)
    report: dict[str, Any] = {
        "memory": summary([e["memory"] for e in errs]),
        "speed": summary([e["speed"] for e in errs]),
        "by_knob": {},
    }
    for knob, values in b.space.knobs.items():
        if len(values) < 2:
            continue
        for v in values:
            sel = [e for e in errs if getattr(e["config"], knob) == v]
            report["by_knob"][f"{knob}={v}"] = {
                "memory": summary([e["memory"] for e in sel]),
                "speed": summary([e["speed"] for e in sel]),
            }
    return report


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.0%}" if signed else f"{x:.0%}"


def print_napkin(rep: dict[str, Any]) -> None:
    m, s = rep["memory"], rep["speed"]
    print(f"  napkin error over the {m['n']} measured candidates (napkin / measured - 1): "
          f"memory median {_pct(m['median'], True)}, |median| {_pct(m['median_abs'])}, worst "
          f"{_pct(m['worst_abs'])}; tokens/s median {_pct(s['median'], True)}, |median| "
          f"{_pct(s['median_abs'])}, worst {_pct(s['worst_abs'])}")  # fmt: skip
    print(f"    {'knob=value':<26} {'n':>3}  {'mem median':>10} {'|mem| worst':>11}  "
          f"{'speed median':>12} {'|speed| worst':>13}")  # fmt: skip
    for key, r in rep["by_knob"].items():
        m, s = r["memory"], r["speed"]
        flag = "  <- >20%" if (m["median_abs"] or 0) > 0.2 or (s["median_abs"] or 0) > 0.2 else ""
        print(f"    {key:<26} {m['n']:>3}  {_pct(m['median'], True):>10} "
              f"{_pct(m['worst_abs']):>11}  {_pct(s['median'], True):>12} "
              f"{_pct(s['worst_abs']):>13}{flag}")  # fmt: skip


# ---- phase 2: the searches -----------------------------------------------------------------


def grid_best(b: Bench) -> tuple[Config, float] | None:
    fit = [(cfg, b.replay(cfg).tokens_per_s or 0.0) for cfg in b.cands if b.fits(cfg)]
    return max(fit, key=lambda cf: cf[1]) if fit else None


def run_search(b: Bench, variant: str, seed: int, trials: int, live: bool) -> dict[str, Any]:
    calls: list[tuple[Config, int]] = []

    def replay(model: Any, config: Config, **kw: Any) -> TrialResult:
        calls.append((config, kw.get("steps", 0)))
        return b.replay(config)

    def live_trial(model: Any, config: Config, **kw: Any) -> TrialResult:
        calls.append((config, kw.get("steps", 0)))
        return run_trial(model, config, **kw)

    s = b.spec
    kwargs: dict[str, Any] = dict(
        model=b.model, hardware=b.hardware, space=b.space, seq_len=s["seq_len"],
        global_batch=s["global_batch"], trials=trials, steps=b.steps, margin=MARGIN,
        device="cpu", gpu_memory=b.cap, seed=seed, run_trial=live_trial if live else replay,
    )  # fmt: skip
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            plan = search(run_dir=Path(tmp), calibration=variant, **kwargs)
        except TypeError as exc:
            if "calibration" not in str(exc):
                raise
            if variant != "off":
                return {"variant": variant, "seed": seed, "available": False}
            calls.clear()  # "off" is today's search, which has no such field
            plan = search(run_dir=Path(tmp), **kwargs)
        study = optuna.load_study(study_name=plan.study_name, storage=plan.storage)
        pruned_keys = {
            st.config_key(t.user_attrs.get("config"))
            for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("outcome") == st.PRUNED
        }
    wall = time.monotonic() - start
    tried = [c.config for c in plan.trials]
    best = grid_best(b)
    out: dict[str, Any] = {
        "variant": variant, "seed": seed, "available": True, "trials": len(plan.trials),
        "verifications": len(calls) - len(plan.trials), "wall_s": wall,
    }  # fmt: skip
    out["tried"] = [f"{c.config.short()}: {c.trial.status}" for c in plan.trials]
    win = plan.best.config if plan.best is not None else None
    out["winner"] = win.short() if win else None
    win_tps = b.replay(win).tokens_per_s if win is not None and b.fits(win) else 0.0
    out["winner_grid_tokens_per_s"] = win_tps
    if best is not None:
        cfg, tps = best
        out["ratio"] = (win_tps or 0.0) / tps
        napkin_pruned = cfg in enumerate_candidates(_setting(b, trials)).pruned
        if cfg in tried:
            out["grid_best"] = "tried"
        elif st.config_key(cfg) in pruned_keys or napkin_pruned:
            out["grid_best"] = "pruned untried"
        else:
            out["grid_best"] = "untried"
    if variant == "study":
        out["calibration"] = calibration_report(b, plan.trials[:CALIBRATION_TRIALS])
    return out


def _setting(b: Bench, trials: int) -> Setting:
    s = b.spec
    return Setting.from_request(PlanRequest.of(
        b.model, b.hardware, b.space, seq_len=s["seq_len"], global_batch=s["global_batch"],
        margin=MARGIN, device="cpu", trials=trials, steps=b.steps, gpu_memory=b.cap,
    ))  # fmt: skip


def calibration_report(b: Bench, first: list[Candidate]) -> dict[str, Any]:
    """The calibration fitted to the study's first trials, over every other grid candidate."""
    try:
        from autofit.calibration import Observation, fit_calibration
    except ImportError:
        return {"available": False}
    cal = fit_calibration([Observation.of(c.estimate, c.trial) for c in first])
    seen = {c.config for c in first}
    mem, speed, mem0, speed0 = [], [], [], []
    for cfg, cand in b.cands.items():
        r = b.measured(cfg)
        if cfg in seen or not r.ok or not r.peak_bytes or not r.step_time_s:
            continue
        e = cand.estimate
        mem.append(cal.peak_bytes(e) / r.peak_bytes - 1)
        speed.append(cal.step_time_s(e) / r.step_time_s - 1)
        mem0.append(e.peak_bytes / r.peak_bytes - 1)
        speed0.append(e.step_time_s / r.step_time_s - 1)
    return {
        "available": True, "fitted_to": [c.config.short() for c in first],
        "memory": summary(mem), "step_time": summary(speed),
        "napkin_memory": summary(mem0), "napkin_step_time": summary(speed0),
    }  # fmt: skip


def print_search(b: Bench, res: dict[str, Any], n_grid: int) -> None:
    head = f"  {res['variant']:<6} seed {res['seed']}:"
    if not res["available"]:
        print(f"{head} not available (search() has no calibration={res['variant']!r} yet)")
        return
    ratio = res.get("ratio")
    print(f"{head} winner {res['winner'] or '(none)'}: {_pct(ratio)} of the grid's best; "
          f"{res['trials']} trials ({res['trials'] / n_grid:.0%} of {n_grid}) + "
          f"{res['verifications']} verification; grid's best {res.get('grid_best', '-')}; "
          f"{res['wall_s']:.1f} s")  # fmt: skip
    cal = res.get("calibration")
    if cal is None:
        return
    if not cal["available"]:
        print("    calibration after 3 trials: not available (no autofit.calibration)")
        return
    m, s, m0, s0 = cal["memory"], cal["step_time"], cal["napkin_memory"], cal["napkin_step_time"]
    print(f"    after {len(cal['fitted_to'])} trials: calibrated memory median |error| "
          f"{_pct(m['median_abs'])} (napkin {_pct(m0['median_abs'])}), calibrated step time "
          f"median |error| {_pct(s['median_abs'])} (napkin {_pct(s0['median_abs'])}) over the "
          f"{m['n']} other measured candidates")  # fmt: skip


def print_table(everything: list[dict[str, Any]], variants: list[str]) -> None:
    print(
        "\nsetting        variant  grid  fit  best tok/s  trials  winner/best (min)  "
        "best untried  napkin |mem| med/worst  |speed| med/worst"
    )
    for row in everything:
        mem, speed = row["napkin"]["memory"], row["napkin"]["speed"]
        best = row["grid_best"]["tokens_per_s"] if row["grid_best"] else 0
        for variant in variants:
            rs = [r for r in row["searches"] if r["variant"] == variant]
            if not rs or not rs[0]["available"]:
                print(f"{row['setting']:<14} {variant:<7}  not available")
                continue
            ratios = [r.get("ratio", 0.0) for r in rs]
            untried = sum(1 for r in rs if r.get("grid_best") != "tried")
            trials = statistics.mean(r["trials"] for r in rs)
            napkin = (
                f"{_pct(mem['median_abs']):>9}/{_pct(mem['worst_abs']):<13}"
                f"{_pct(speed['median_abs']):>7}/{_pct(speed['worst_abs'])}"
            )
            print(
                f"{row['setting']:<14} {variant:<7} {row['candidates']:>5} {row['fit']:>4} "
                f"{best:>11,.0f} {trials:>6.1f}  {statistics.median(ratios):>8.0%} "
                f"({min(ratios):.0%})   {untried}/{len(rs):<11} {napkin}"
            )


# ---- main ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="comma-separated names of: " + ", ".join(SETTINGS))  # fmt: skip
    parser.add_argument("--remeasure", action="store_true", help="measure the grids again")
    parser.add_argument("--grid-only", action="store_true", help="phase 1 only")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fraction", type=float, default=0.25,
                        help="the search's budget, as a fraction of the grid's trials")  # fmt: skip
    parser.add_argument("--trials", type=int, default=None, help="a fixed budget instead")
    parser.add_argument("--seeds", default="0,1,2", help="the sampler's seeds, one search each")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--cap", action="append", default=[], metavar="SETTING=SIZE",
                        help="replay a setting at another cap (grids run uncapped)")  # fmt: skip
    parser.add_argument("--live", action="store_true", help="real trials for the searches")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args()

    seeds = [int(x) for x in args.seeds.split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    caps = dict(c.split("=", 1) for c in args.cap)
    benches = [
        Bench(name, {**SETTINGS[name], "cap": caps.get(name, SETTINGS[name]["cap"])}, args.steps)
        for name in args.settings.split(",")
    ]
    for b in benches:
        load_or_measure(b, args.remeasure)
    if args.grid_only:
        return

    everything: list[dict[str, Any]] = []
    for b in benches:
        n = len(b.cands)
        fit = [cfg for cfg in b.cands if b.fits(cfg)]
        errs = sum(1 for cfg in b.cands if b.measured(cfg).status not in ("ok", "oom"))
        best = grid_best(b)
        trials = args.trials or max(1, round(args.fraction * n))
        print(f"\n== {b.name}: {b.spec['model']}, {NPROCS} gloo processes, seq_len "
              f"{b.spec['seq_len']}, global batch {b.spec['global_batch']}, cap {b.spec['cap']} "
              f"(headroom line {fmt_size(b.line)}), {args.steps} steps")  # fmt: skip
        print(f"  space: {json.dumps(b.spec['knobs'])}")
        print(f"  grid: {n} candidates, {len(fit)} fit under the line, "
              f"{sum(1 for c in b.cands if b.replay(c).status == 'oom')} over the cap, {errs} "
              f"failed otherwise; {n} trials, {b.grid_s:.0f} s")  # fmt: skip
        if best is not None:
            print(f"  grid's best: {best[0].short()}: {best[1]:,.0f} tokens/s, peak "
                  f"{fmt_size(b.replay(best[0]).peak_bytes)}")  # fmt: skip
        nap = napkin_report(b)
        print_napkin(nap)
        print(f"  searches: --trials {trials} ({'live' if args.live else 'replayed'})")
        results = []
        for variant in variants:
            for seed in seeds:
                res = run_search(b, variant, seed, trials, args.live)
                print_search(b, res, n)
                results.append(res)
                if not res["available"]:
                    break
        everything.append({
            "setting": b.name, "spec": b.spec, "steps": args.steps, "candidates": n,
            "fit": len(fit), "line_bytes": b.line, "grid_s": b.grid_s,
            "grid_best": {"config": best[0].to_dict(), "tokens_per_s": best[1]} if best else None,
            "napkin": nap, "budget": trials, "searches": results,
        })  # fmt: skip

    print_table(everything, variants)
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1, default=str) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
