"""One prepared GPU check: autofit's own trials, offload, int8, the main job and the GPU tests.

    python bench/gpu_check.py [--out DIR] [--only replay,int8,plan,tests] [--budget-s 420]
    python bench/gpu_check.py --device cpu --quick      # the same code on CPU (the suite runs it)
    python bench/gpu_check.py --only probe,replay --budget-s 400   # issue 33's next GPU run

Made for a lent GPU (one H100/H200, minutes of device time): every section has a budget, printed
before anything starts, and is stopped at it (trials by their limit and an abort, the rest as
processes killed at their deadline), so the whole run ends within `--budget-s` by construction.
Each row is written to `DIR/gpu_check.json` as soon as it is measured (the file is replaced
whole, never half-written), and a short table is printed last.

Sections:
- `replay`: the trials of `bench/data/gpu-measurements/autofit-h200-*.json` (autofit's first GPU
  run, capped at 24 GiB per GPU as it was), the answer.ai one-GPU QLoRA path (`nf4 r64 mb2
  offload=params`) among them, each beside the estimate of this commit for the same cap; a launch
  per model and per process group (the plain module's trials hold no NCCL communicator, one-GPU
  FSDP2's do), each row with the CUDA context it measured beside the estimate's.
- `int8`: the int8 weight-only base against bf16, eager and compiled, standard and chunked loss,
  on llama-7b's layer shape with fewer layers, in one process: step times, the CUDA kernels that
  take the time (torch.profiler), dynamo's recompiles and perf hints (`int8.log`).
- `plan`: the README's main job, `autofit plan --gpus auto --model llama-7b`, bounded by
  `--search-timeout`: its winner, what it measured, what it left untried.
- `tests`: `pytest -m gpu` (skipped with `--quick`).
- `probe` (issue 33, not run unless named: `--only probe,...`): what the rows above leave open, in
  one process. Host-bound steps (llama-7b NF4 and bf16 LoRA r64 at micro-batch 1) timed step by
  step, forward, backward and the optimizer apart, beside the aten ops each phase dispatches
  (counted on the GPU at real width, and as the estimate counts them): the host's cost per op,
  and how it spreads within a run. And the caching allocator's own record of a step
  (`torch.cuda.memory._record_memory_history`, `probe-<case>.pickle.gz`) of the QLoRA
  `offload: params` row the estimate is 2.5-3.4% under (e5) and of its plain-module twin (a0):
  every block's birth and death and the segments at the end, for torch's memory viewer
  (pytorch.org/memory_viz) and for a replay through autofit's allocator model
  (`autofit.estimate.allocator`) beside the estimate's own replay (`autofit.estimate.slack`).

With `--device cpu --quick` every section runs on `llama-debug` at seq 128 on CPU processes (one
replayed config per path: plain LoRA, NF4, full, each way of param offload; int8 eager and
compiled; a plan of one trial over the README's tiny CPU space), so the script cannot rot unseen;
the numbers are then only a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autofit.units import GiB  # noqa: E402

REPLAY_FILE = sorted((ROOT / "bench/data/gpu-measurements").glob("autofit-h200-*.json"))[-1]
SECTIONS = ("replay", "int8", "plan", "tests", "probe")
DEFAULT_SECTIONS = ("replay", "int8", "plan", "tests")
# Seconds per section on a GPU (the sum is the promise: 7 minutes): replay's 11 trials in a launch
# per model and process group (182 s on the H200, 2026-11-28; 95 s stopped it at the sixth) and
# the two of other launches,
# int8's six short runs, a bounded plan, and the GPU tests (75 s). --budget-s scales them down
# when it is smaller; a section that ends early leaves its time to the next.
GPU_BUDGET_S = {"replay": 210.0, "int8": 45.0, "plan": 100.0, "tests": 65.0, "probe": 150.0}
CPU_BUDGET_S = {"replay": 90.0, "int8": 60.0, "plan": 90.0, "tests": 0.0, "probe": 60.0}
# Of the plan's section, what its search time limit leaves for the rest: a cold trace of the
# model's layer (29 s for llama-7b on the H200), the trial running at the limit and the
# verification after it (a 7B trial on one H200 takes 40-60 s).
PLAN_TAIL_S = {"cuda": 140.0, "cpu": 80.0}
CAP = 24 * GiB  # the first run's cap per GPU (a 24 GiB card on the H200)


class Rows:
    """The rows measured so far, in `path` (replaced whole after each)."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path, self.header, self.rows = path, header, []  # type: list[dict[str, Any]]

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.save()
        print(f"  row {row.get('section')}: {_short(row)}", flush=True)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.header, "rows": self.rows}, indent=1, default=str))
        os.replace(tmp, self.path)


def _short(row: dict[str, Any]) -> str:
    keep = ("name", "status", "step_time_s", "est_step_time_s", "peak_gib", "est_peak_gib", "note")
    return ", ".join(f"{k}={_fmt(row[k])}" for k in keep if row.get(k) is not None)


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


# ----- replay: the first GPU run's trials, again ------------------------------------------------
LAUNCH_TWINS = (
    # HF Trainer's own loop (`launch: trainer`) on a QLoRA script's model (BitsAndBytesConfig NF4
    # with double quantization, prepare_model_for_kbit_training, peft LoRA: issue 36's most
    # common path) on the first run's NF4 r64 mb1 row; bitsandbytes travels as below
    ("llama-7b", {"quant": "nf4", "lora_rank": 64, "micro_batch": 1, "wrap": "none",
                  "checkpointing": "full", "seq_len": 2048},
     {"launch": "trainer", "quant_backend": "bitsandbytes", "bnb_4bit_use_double_quant": True}),
    # TRL's SFTTrainer (`launch: trl`) on a TRL QLoRA script's model (4 bits, no kbit
    # preparation, its adapters turned to bf16: precision bf16) of the same row; TRL travels as
    # a wheel too (`EXTRA="bitsandbytes==0.50.2 trl==1.16.0"`)
    ("llama-7b", {"quant": "nf4", "lora_rank": 64, "micro_batch": 1, "wrap": "none",
                  "checkpointing": "full", "seq_len": 2048},
     {"launch": "trl", "quant_backend": "bitsandbytes", "bnb_4bit_use_double_quant": True,
      "precision": "bf16"}),
    # bitsandbytes NF4 with double quantization (BitsAndBytesConfig's QLoRA) on its NF4 r64 mb1
    # row: bitsandbytes travels as a wheel (`EXTRA="bitsandbytes==0.50.2" bash
    # ../shared/gpu/prepare.sh`); without it the row is an error that says so
    ("llama-7b", {"quant": "nf4", "lora_rank": 64, "micro_batch": 1, "wrap": "none",
                  "checkpointing": "full", "seq_len": 2048},
     {"quant_backend": "bitsandbytes", "bnb_4bit_use_double_quant": True}),
)  # fmt: skip
"""(model, a first-run row's config, what changes) of the replay's rows of other launches."""


def replay_cases(quick: bool) -> list[tuple[str, dict[str, Any], str]]:
    """(model, config, expected status) of the first run's rows, grouped by model with the
    expected OOMs last in each group (an OOM ends its launch; what follows would start again)."""
    rows = json.loads(REPLAY_FILE.read_text())
    cases = []
    for row in rows:
        config = dict(row["config"])
        expect = "oom" if row["status"] == "oom" else "ok"  # the two offload errors: fixed
        if quick:
            config.update(seq_len=128, micro_batch=min(config["micro_batch"], 2))
        cases.append(("llama-debug" if quick else row["model"], config, expect))
    if quick:  # one config per path the first run took: quant x full/LoRA x offload
        kinds = {(c["quant"], c["lora_rank"] > 0, c["offload"]): (m, c, e) for m, c, e in cases}
        cases = [(m, c, "ok") for m, c, _ in kinds.values()]
    else:  # the launches users run beside autofit's (issue 36), each the twin of a first-run row
        cases += [(model, {**base, **change}, "ok") for model, base, change in LAUNCH_TWINS]
    order = list(dict.fromkeys(m for m, _, _ in cases))
    return sorted(cases, key=lambda c: (order.index(c[0]), c[2] == "oom"))


def run_replay(args: argparse.Namespace, rows: Rows, deadline: float) -> None:
    from autofit.config import Config
    from autofit.estimate import estimate
    from autofit.hardware import cpu_hardware, resolve_hardware
    from autofit.layout import layout_of
    from autofit.models import resolve_model
    from autofit.trials import run_trials

    cpu = args.device == "cpu"
    cases = replay_cases(args.quick)
    # on a GPU a launch per model and per whether its configs' job has a process group (one-GPU
    # FSDP2), so that each trial holds what its own job would: the plain module no NCCL
    # communicator (on CPU, where no device level is read, one launch per model saves a start)
    # (and per launch: Trainer's trials run its own loop)
    by_model: dict[tuple[str, bool, str], list[tuple[dict[str, Any], str]]] = {}
    for model, config, expect in cases:
        grouped = not cpu and layout_of(Config.from_dict(config), 1).communicators > 0
        launch = config.get("launch", "autofit")
        by_model.setdefault((model, grouped, launch), []).append((config, expect))
    hardware = cpu_hardware(1, CAP) if cpu else resolve_hardware("1", gpu_memory="24GiB")
    for (model, _, _), group in by_model.items():
        if time.monotonic() > deadline - 10:
            rows.add({"section": "replay", "name": model, "status": "skipped",
                      "note": "the section's budget ran out"})  # fmt: skip
            continue
        spec = resolve_model(model)
        configs = [Config.from_dict(c) for c, _ in group]

        def on_result(i: int, res: Any, group=group, configs=configs, spec=spec) -> None:
            est = estimate(spec, hardware, configs[i], device=args.device)
            rows.add(trial_row("replay", spec.name, configs[i], res, est, group[i][1]))

        def abort() -> str | None:
            return "the section's budget ran out" if time.monotonic() > deadline else None

        cap = CAP if not cpu else None
        run_trials(spec, configs, device=args.device, nprocs=1, gpu_memory=cap, steps=3,
                   warmup=1, timeout_s=args.trial_timeout, on_result=on_result,
                   abort=abort)  # fmt: skip


def trial_row(section: str, model: str, config: Any, res: Any, est: Any, expect: str) -> dict:
    from autofit.calibration.model import context_of

    peak = res.peak_bytes / GiB if res.peak_bytes else None
    est_peak = est.peak_bytes / GiB
    return {
        "section": section,
        "name": f"{model} {config.short()}",
        "model": model,
        "config": config.to_dict(),
        "expect": expect,
        "status": res.status,
        "peak_gib": peak,
        "est_peak_gib": est_peak,
        "peak_error": (est_peak - peak) / peak if peak else None,
        "allocated_gib": res.peak_allocated_bytes / GiB if res.peak_allocated_bytes else None,
        "device_gib": res.device_peak_bytes / GiB if res.device_peak_bytes else None,
        "est_device_gib": est.device_bytes / GiB,
        # the trial's process group (NCCL's communicator on a GPU) and the CUDA context it
        # measured (device - reserved - NCCL's buffers), beside the estimate's
        "process_group": res.process_group,
        "context_mib": (context_of(est, res) or 0) / 2**20 or None,
        "est_context_mib": est.overhead.get("cuda_context", 0) / 2**20,
        "step_time_s": res.step_time_s,
        "est_step_time_s": est.step_time_s,
        "tokens_per_s": res.tokens_per_s,
        "est_tokens_per_s": est.tokens_per_s,
        "compile_s": res.compile_s,
        "recompiles": res.recompiles,
        "wall_s": res.wall_s,
        "sharding": res.sharding,
        "note": (res.message or "").splitlines()[0][:200] if res.status != "ok" else None,
    }


# ----- int8: where the time goes ----------------------------------------------------------------
INT8_CASES = (  # name, quant, compile, loss
    ("bf16 eager", None, False, "standard"),
    ("int8 eager", "int8", False, "standard"),
    ("int8 eager chunked", "int8", False, "chunked"),
    ("bf16 compiled chunked", None, True, "chunked"),
    ("int8 compiled chunked", "int8", True, "chunked"),
    ("int8 compiled", "int8", True, "standard"),
)


def int8_child(args: argparse.Namespace) -> None:
    """In its own process (the parent kills it at the section's deadline): each case built on
    llama-7b's layer shape with `--int8-layers` layers, 2 warm-up and 3 timed steps, one step
    profiled; a row per case appended to `int8.jsonl`."""
    import torch

    from autofit.builder.apply import build_for_trial
    from autofit.builder.compile import CompileStats
    from autofit.config import Config
    from autofit.estimate import estimate
    from autofit.hardware import cpu_hardware, resolve_hardware
    from autofit.models import resolve_model

    torch._logging.set_logs(recompiles=True, perf_hints=True, graph_breaks=True)
    cpu = args.device == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    base = resolve_model("llama-debug" if args.quick else "llama-7b")
    spec = dataclasses.replace(base, name=f"{base.name}-{args.int8_layers}l",
                               layers=args.int8_layers)  # fmt: skip
    seq, mb = (128, 2) if args.quick else (2048, 4)
    hardware = cpu_hardware(1) if cpu else resolve_hardware("1")
    out = Path(args.out) / "int8.jsonl"
    cases = (
        [c for c in INT8_CASES if c[1] == "int8" and c[3] == "standard"]
        if args.quick
        else INT8_CASES
    )
    for name, quant, compiled, loss in cases:
        config = Config(quant=quant or "none", lora_rank=16, micro_batch=mb, seq_len=seq,
                        checkpointing="selective", loss=loss, compile=compiled,
                        wrap="none")  # fmt: skip
        torch.manual_seed(0)
        run = build_for_trial(spec, config, device)
        batch = torch.randint(0, spec.vocab, (mb, seq), device=device)
        times, before = [], CompileStats.now()
        for step in range(5):
            if step == 2:
                compile_s = (CompileStats.now() - before).seconds
            t0 = time.perf_counter()
            run.train_step([batch])
            if not cpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        recompiled = (CompileStats.now() - before).graphs
        kernels = profile_step(run, batch, cpu)
        est = estimate(spec, hardware, config, device=args.device)
        row = {
            "section": "int8",
            "name": f"{spec.name} {name}",
            "config": config.to_dict(),
            "status": "ok",
            "step_time_s": sorted(times[2:])[1],
            "first_steps_s": times[:2],
            "est_step_time_s": est.step_time_s,
            "compile_s": compile_s if compiled else None,
            "graphs": recompiled if compiled else None,
            "top_kernels": kernels,
        }
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        del run
        torch.compiler.reset()
        if not cpu:
            torch.cuda.empty_cache()


PROBE_CASES: tuple[tuple[str, dict[str, Any], bool], ...] = (
    ("e5 memory", {"quant": "nf4", "lora_rank": 64, "micro_batch": 2, "wrap": "auto",
                   "checkpointing": "full", "offload": "params", "seq_len": 2048}, True),
    ("a0 host", {"quant": "nf4", "lora_rank": 64, "micro_batch": 1, "wrap": "none",
                 "checkpointing": "full", "seq_len": 2048}, True),
    ("a2 host", {"lora_rank": 64, "micro_batch": 1, "wrap": "none", "checkpointing": "full",
                 "seq_len": 2048}, False),
)  # fmt: skip
"""(name, llama-7b config, whether the allocator's record of a step is kept) of `probe`."""
PROBE_STEPS = (2, 6)  # warm-up steps, timed steps


def probe_child(args: argparse.Namespace) -> None:
    """In its own process (the parent kills it at the section's deadline): each `PROBE_CASES`
    config as `probe_case` runs it, a row per case appended to `probe.jsonl` (an error row for a
    case that fails, and the next one runs). The process joins a one-rank group (the trials' own
    `join_group`) as e5's job has one; the plain-module cases call no collective in it."""
    import importlib

    from autofit.arch import structure_of
    from autofit.config import Config
    from autofit.estimate import estimate
    from autofit.hardware import cpu_hardware, resolve_hardware
    from autofit.layout import layout_of
    from autofit.models import resolve_model
    from autofit.trials.rank import join_group, release

    step_terms = importlib.import_module("autofit.estimate.step")  # (the name `estimate` is taken)
    cpu = args.device == "cpu"
    spec = resolve_model("llama-debug" if args.quick else "llama-7b")
    structure = structure_of(spec)
    configs = [Config.from_dict({**c, **({"seq_len": 128} if args.quick else {})})
               for _, c, _ in PROBE_CASES]  # fmt: skip
    group = any(layout_of(c, 1).communicators for c in configs)
    device, _ = join_group(args.device, 0, 1, None, group)
    hardware = cpu_hardware(1) if cpu else resolve_hardware("1")
    out = Path(args.out)
    for (name, _, keep), config in zip(PROBE_CASES, configs, strict=True):
        row: dict[str, Any] = {"section": "probe", "name": f"{spec.name} {name}",
                               "config": config.to_dict()}  # fmt: skip
        try:
            row.update(probe_case(spec, config, device, out / f"probe-{name.split()[0]}",
                                  keep and not cpu, 1 if args.quick else PROBE_STEPS[0],
                                  2 if args.quick else PROBE_STEPS[1]))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a case that fails must not cost the others
            row.update(status="error", note=f"{type(exc).__name__}: {exc}"[:300])
        else:
            est = estimate(spec, hardware, config, device=args.device)
            layer, root = step_terms._host_ops(config.resolved(1), structure, spec, 1)
            row.update(
                est_ops=structure.layers * layer + root,
                est_step_time_s=est.step_time_s,
                est_peak_gib=est.peak_bytes / GiB,
            )
        with (out / "probe.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        release(device)


def probe_case(
    spec: Any, config: Any, device: Any, stem: Path, keep: bool, warmup: int, timed: int
) -> dict[str, Any]:
    """One probe case: built as a trial builds it, `warmup` steps, `timed` steps timed by phase,
    one step's ops counted by phase, and with `keep` one step under the allocator's record."""
    import torch

    from autofit.builder.apply import build_for_trial

    torch.manual_seed(0)
    run = build_for_trial(spec, config, device)
    batch = torch.randint(0, spec.vocab, (config.micro_batch, config.seq_len), device=device)
    for _ in range(warmup):
        run.train_step([batch])
    phases = [probe_step(run, batch, device) for _ in range(timed)]
    ops = probe_ops(run, batch)
    steps = sorted(p["step"] for p in phases)
    out: dict[str, Any] = {
        "status": "ok",
        "phases_s": phases,
        "ops": ops,
        "step_time_s": steps[len(steps) // 2],
        "host_us_per_op": steps[len(steps) // 2] / sum(ops.values()) * 1e6,
    }
    if keep:
        out.update(probe_record(run, batch, device, stem))
    return out


def probe_phases(run: Any, batch: Any, within: Callable[[str], Any]) -> None:
    """One optimizer step as `Applied.train_step` runs it (one micro-batch), each phase
    (`forward`, `backward`, `optimizer`) inside the context `within(phase)` gives."""
    with run.gradient_sync(True):
        with within("forward"):
            loss = run.loss(batch)
        with within("backward"):
            loss.backward()
    with within("optimizer"):
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)


def probe_step(run: Any, batch: Any, device: Any) -> dict[str, float]:
    """One step (`probe_phases`), each phase's wall time as the host sees it (the GPU may still
    be working when a phase returns), and the whole step's after the device is done."""
    import contextlib

    import torch

    times: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        times[phase] = time.perf_counter() - t0

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    probe_phases(run, batch, timed)
    sync()
    return {**times, "step": time.perf_counter() - start}


def probe_ops(run: Any, batch: Any) -> dict[str, int]:
    """The aten ops one step (`probe_phases`) dispatches, by phase, counted as
    `autofit.arch.ops_of` counts them (`OpCounter`), on the device at the model's own width."""
    from autofit.builder.ops import OpCounter

    counters = {k: OpCounter() for k in ("forward", "backward", "optimizer")}
    probe_phases(run, batch, counters.__getitem__)
    return {k: c.ops for k, c in counters.items()}


def probe_record(run: Any, batch: Any, device: Any, stem: Path) -> dict[str, Any]:
    """One step under the caching allocator's record (`_record_memory_history`, no stacks), its
    snapshot gzipped to `stem.pickle.gz`; the step's peaks and the allocator's counters."""
    import gzip
    import pickle

    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=2_000_000)  # fmt: skip
    try:
        run.train_step([batch])
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    path = stem.with_suffix(".pickle.gz")
    with gzip.open(path, "wb") as f:
        pickle.dump(snapshot, f)
    stats = torch.cuda.memory_stats(device)
    keep = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "segment.all.peak",
            "inactive_split_bytes.all.peak", "num_alloc_retries", "num_device_alloc")  # fmt: skip
    return {"record": path.name, "peak_gib": torch.cuda.max_memory_reserved(device) / GiB,
            "allocated_gib": torch.cuda.max_memory_allocated(device) / GiB,
            "allocator": {k: stats.get(k) for k in keep}}  # fmt: skip


def run_probe(args: argparse.Namespace, rows: Rows, deadline: float) -> None:
    from autofit.export.schema import ALLOC_ENV  # the allocator's settings, as trials run

    env = {**os.environ, **ALLOC_ENV}
    run_child(args, rows, deadline, "probe", [], "probe", env=env)


def profile_step(run: Any, batch: Any, cpu: bool) -> list[tuple[str, float]]:
    """The five ops (kernels on CUDA) that took the most device time in one step: (name, ms)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
    with profile(activities=acts) as prof:
        run.train_step([batch])
        if not cpu:
            torch.cuda.synchronize()
    key = "self_cpu_time_total" if cpu else "self_device_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)
    return [(e.key[:90], getattr(e, key, 0) / 1000) for e in events[:5]]


def run_int8(args: argparse.Namespace, rows: Rows, deadline: float) -> None:
    run_child(args, rows, deadline, "int8", ["--int8-layers", str(args.int8_layers)], "int8 probe")


def run_child(
    args: argparse.Namespace, rows: Rows, deadline: float, section: str, extra: list[str],
    name: str, **kwargs: Any,
) -> None:  # fmt: skip
    """A section's cases run by this script in a child process (`--<section>-child`) until the
    deadline: the rows it appended to `<section>.jsonl`, then a row saying why it stopped
    early, if it did (its output in `<section>.log`)."""
    out = Path(args.out)
    jsonl = out / f"{section}.jsonl"
    jsonl.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, f"--{section}-child", "--device", args.device,
           "--out", str(out), *extra, *(["--quick"] if args.quick else [])]  # fmt: skip
    with (out / f"{section}.log").open("w") as log:
        code = run_until(cmd, deadline, stdout=log, stderr=subprocess.STDOUT, **kwargs)
    done = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    for row in done:
        rows.add(row)
    if code != 0:
        status = "stopped" if code is None else "error"
        note = f"{len(done)} cases ran; see {section}.log"
        rows.add({"section": section, "name": name, "status": status, "note": note})


# ----- the main job and the GPU tests, as processes ---------------------------------------------
def run_until(cmd: list[str], deadline: float, **kwargs: Any) -> int | None:
    """Run `cmd` in its own process group until `deadline` (monotonic); killed with its group
    past it (returns None), else its exit code."""
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, **kwargs)
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_plan(args: argparse.Namespace, rows: Rows, deadline: float) -> None:
    """The README's main job, as a user runs it (80 columns), its search time limit set so that
    the trial running at the limit and the verification still end within the section."""
    out = Path(args.out)
    left = deadline - time.monotonic()
    # quick: one trial and its verification (the search starts one trial whatever its limit)
    search = 1.0 if args.quick else max(10.0, left - PLAN_TAIL_S[args.device])
    if args.quick:  # the tiny space of the README's CPU example: no compile, seconds a trial
        where = ["--model", "llama-debug", "--gpus", "1", "--device", "cpu", "--space",
                 str(ROOT / "examples" / "tiny_space.yaml")]  # fmt: skip
    elif args.device == "cpu":
        where = ["--model", "llama-debug", "--gpus", "1", "--device", "cpu", "--seq-len", "128"]
    else:
        where = ["--model", "llama-7b", "--gpus", "auto"]
    run_dir = out / "plan"
    cmd = [sys.executable, "-m", "autofit", "plan", *where, "--search-timeout", f"{search:.0f}",
           "--run-dir", str(run_dir)]  # fmt: skip
    start = time.monotonic()
    env = {**os.environ, "COLUMNS": "80"}
    with (out / "plan.log").open("w") as log:
        code = run_until(cmd, deadline, stdout=log, stderr=subprocess.STDOUT, env=env)
    wall = time.monotonic() - start
    try:
        result = json.loads((run_dir / "plan.json").read_text())
    except (OSError, ValueError):
        result = {}
    best = result.get("best") or {}
    trials = result.get("trials") or []
    rows.add({
        "section": "plan",
        "name": " ".join(where[:2]) + f" --search-timeout {search:.0f}",
        "status": "ok" if code == 0 else ("stopped" if code is None else f"exit {code}"),
        "wall_s": wall,
        "winner": best.get("label"),
        "verified": best.get("verified"),
        "tokens_per_s": best.get("tokens_per_s"),
        "est_tokens_per_s": (best.get("estimate") or {}).get("tokens_per_s"),
        "peak_gib": best["peak_bytes"] / GiB if best.get("peak_bytes") else None,
        "est_peak_gib": (best.get("estimate") or {}).get("peak_bytes", 0) / GiB or None,
        "trials": [(t["label"], (t.get("trial") or {}).get("status"),
                    (t.get("trial") or {}).get("wall_s")) for t in trials],
        "untried": (result.get("untried") or {}).get("count"),
        "note": None if code == 0 else (out / "plan.log").read_text()[-300:],
    })  # fmt: skip


def run_tests(args: argparse.Namespace, rows: Rows, deadline: float) -> None:
    out = Path(args.out)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-rA", "-n", "0", "-p", "no:cacheprovider",
           "-o", "addopts=", "--durations=10", "tests"]  # fmt: skip
    with (out / "tests.log").open("w") as log:
        code = run_until(cmd, deadline, stdout=log, stderr=subprocess.STDOUT)
    tail = (out / "tests.log").read_text().strip().splitlines()[-1:] or [""]
    rows.add({"section": "tests", "name": "pytest -m gpu", "status": "ok" if code == 0
              else ("stopped" if code is None else "failed"), "note": tail[0][:200]})  # fmt: skip


RUNNERS: dict[str, Callable[[argparse.Namespace, Rows, float], None]] = {
    "replay": run_replay, "int8": run_int8, "plan": run_plan, "tests": run_tests,
    "probe": run_probe,
}  # fmt: skip


def budgets(args: argparse.Namespace, sections: list[str]) -> dict[str, float]:
    table = CPU_BUDGET_S if args.device == "cpu" else GPU_BUDGET_S
    wanted = {s: table[s] for s in sections if table[s] > 0}
    total = sum(wanted.values())
    scale = min(1.0, args.budget_s / total) if total else 1.0
    return {s: b * scale for s, b in wanted.items()}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'section':7} {'status':8} {'step s':>7} {'est s':>7} {'GiB':>6} {'est':>6}  name"]

    def num(r: dict[str, Any], k: str, w: int = 7) -> str:
        v = r.get(k)
        return f"{v:{w}.2f}" if isinstance(v, float) else " " * (w - 1) + "-"

    for r in rows:
        lines.append(f"{r['section']:7} {r['status']:8} {num(r, 'step_time_s')} "
                     f"{num(r, 'est_step_time_s')} {num(r, 'peak_gib', 6)} "
                     f"{num(r, 'est_peak_gib', 6)}  "
                     f"{r.get('name', '')[:60]}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="llama-debug at seq 128 (CPU smoke)")
    parser.add_argument("--only", default=",".join(DEFAULT_SECTIONS),
                        help=f"sections, comma-separated, of {', '.join(SECTIONS)}")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=420.0, help="the whole run's limit")
    parser.add_argument("--trial-timeout", type=float, default=90.0)
    parser.add_argument("--int8-layers", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT") or "autofit-runs/gpu-check")
    parser.add_argument("--int8-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.int8_child:
        int8_child(args)
        return 0
    if args.probe_child:
        probe_child(args)
        return 0
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA GPU; use --device cpu --quick on CPU")
    plan = budgets(args, sections)
    print(f"gpu_check on {args.device}: " + ", ".join(f"{s} {b:.0f} s" for s, b in plan.items())
          + f"; at most {sum(plan.values()):.0f} s in all", flush=True)  # fmt: skip
    rows = Rows(Path(args.out) / "gpu_check.json", {"device": args.device, "quick": args.quick,
                                                     "budget_s": plan})  # fmt: skip
    start = time.monotonic()
    deadline = start
    for section, budget in plan.items():
        deadline += budget  # a section that ends early leaves its time to the next
        print(f"== {section} (until {deadline - start:.0f} s)", flush=True)
        t0 = time.monotonic()
        try:
            RUNNERS[section](args, rows, deadline)
        except Exception as exc:  # noqa: BLE001 - a broken section must not stop the others
            rows.add({"section": section, "name": section, "status": "error",
                      "note": f"{type(exc).__name__}: {exc}"[:300]})  # fmt: skip
        print(f"   {section}: {time.monotonic() - t0:.0f} s", flush=True)
    print(f"\n{table(rows.rows)}\n{time.monotonic() - start:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
