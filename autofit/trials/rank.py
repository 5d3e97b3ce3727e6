"""One rank of a trial, run by `worker.py` (the torchrun entry) once the rank is guarded.

A launch runs one or more configs of one model in order (`run_trials`), in one process group.
For each config each rank builds the model, runs warm-up then measured steps, and frees all of it
before the next config starts (peaks are reset, so each config measures what it would alone);
local rank 0 writes `OUT.json.<i>` (`result.config_result`), config i's whole result with peaks
reduced over ranks, and `progress.json` after each step. A rank that fails writes
`OUT.json.rank<R>.json` (status, message, the failing config's index and, for an OOM, whether the
GPU or the host ran out) and exits at once: the launch ends, and the launcher decides about the
configs that did not run. A rank that ran them all writes an `ok` report there.
On a trial that spans nodes each node's local rank 0 writes them (into its own planner's scratch
folder), with the same group-wide figures: c10d numbers the ranks in the order their nodes joined,
so global rank 0 may be on any node, and every node's planner reads a whole result of its own.

A compiled run (`compile: true`) compiles its layers in the first warm-up step (there is always
one): dynamo's own compile time, graph and graph-break counts are reported apart from the step
time, and a graph compiled during a measured step is a recompile, counted and explained.

Every rank offers itself first to the kernel's OOM killer, so a host that runs out of RAM kills a
trial, not the planner that records it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autofit.builder.apply import Applied, Batch, build_for_trial
from autofit.builder.batching import drawn_micro_batches
from autofit.builder.compile import CompileStats, recompile_reasons
from autofit.builder.optim import is_compiled_step
from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.errors import oom_kind
from autofit.files import atomic_write
from autofit.layout import layout_of
from autofit.models import ModelSpec
from autofit.settings import HF_LAUNCHES
from autofit.trials.budget import SLOW_FACTOR, SLOW_MIN_S, warmup_steps
from autofit.trials.memory import (
    TensorTracker,
    all_reduce,
    cap_cuda,
    device_used_bytes,
    host_peak_bytes,
    untracked,
)
from autofit.trials.result import config_result
from autofit.values import Launch, Offload

# Joining the process group and every collective after it fail in this time rather than at the
# trial's own limit: a peer that never comes costs seconds. Ranks build the same model at the same
# pace, so no healthy collective waits this long for a peer.
COLLECTIVE_TIMEOUT_ENV = "AUTOFIT_COLLECTIVE_TIMEOUT_S"
COLLECTIVE_TIMEOUT_S = 60.0
PROGRESS_FILE = "progress.json"
OOM_SCORE_ADJ = 800  # of -1000..1000: the OOM killer picks a trial worker before anything else


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(
        seconds=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV) or COLLECTIVE_TIMEOUT_S)
    )


def _offer_to_oom_killer() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text(str(OOM_SCORE_ADJ))


class Progress:
    """Local rank 0 tells the launcher what it is doing (`progress.json`: phase, step, steps, and
    which of the launch's configs, `config`)."""

    def __init__(self, path: Path | None, steps: int) -> None:
        self.path, self.steps, self.config = path, steps, 0

    def __call__(self, phase: str, step: int = 0) -> None:
        if self.path is not None:
            info = {"phase": phase, "step": step, "steps": self.steps, "config": self.config}
            _write(self.path, info)


def synthetic_batch(spec: ModelSpec, config: Config, rank: int, device: torch.device):
    """A fixed batch of random tokens per rank: the model memorises it, so the loss falls."""
    gen = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, spec.vocab, (config.micro_batch, config.seq_len), generator=gen)
    return tokens.to(device)


def step_batches(
    spec: ModelSpec, config: Config, rank: int, device: torch.device,
    lengths: dict[str, Any] | None, steps: int, longest_step: int = 0,
) -> list[tuple[list[Batch], int]]:  # fmt: skip
    """Each step's `grad_accum` micro-batches and their useful tokens. Without the data's
    lengths: the one fixed `synthetic_batch` of `seq_len` tokens, every micro-step. With them:
    micro-batches of random tokens at lengths drawn from the data as the config's `batching`
    lays them out (`autofit.builder.batching.drawn_micro_batches`), the first of step
    `longest_step` the longest micro-batch the data can produce (the peak the run will
    reach)."""
    if not lengths:
        batch = synthetic_batch(spec, config, rank, device)
        tokens = config.micro_batch * config.grad_accum * config.seq_len
        return [([batch] * config.grad_accum, tokens)] * steps
    hist = LengthHistogram.from_dict(lengths)
    drawn = drawn_micro_batches(
        hist, config.batching, config.micro_batch, config.seq_len, spec.vocab,
        steps * config.grad_accum, seed=1234 + rank, longest_at=longest_step * config.grad_accum,
    )  # fmt: skip
    out: list[tuple[list[Batch], int]] = []
    for i in range(0, len(drawn), config.grad_accum):
        part = drawn[i : i + config.grad_accum]
        out.append(([b for b, _ in part], sum(n for _, n in part)))
    return out


def _on(batch: Batch, device: torch.device) -> Batch:
    """A micro-batch drawn on the host, on the trial's device."""
    assert not torch.is_tensor(batch)
    return {k: v.to(device) for k, v in batch.items()}


def train_step(
    run: Applied, batches: list[Batch], tracker: TensorTracker | None
) -> tuple[torch.Tensor, CompileStats]:
    """One optimizer step of `grad_accum` micro-steps, as a user's run does it (`Applied.backward`,
    then the optimizer step). The optimizer step is `Applied.train_step`'s, except that on CPU the
    tracker must not count state that lives in host memory or in a compiled step's buffers.
    Returns the loss and what dynamo compiled in forward and backward (the model's layers; a
    low-bit optimizer's own compiled step is not the `compile` knob's)."""
    config = run.config
    before = CompileStats.now()
    loss = run.backward(batches)
    compiled = CompileStats.now() - before
    optimizer = run.optimizer
    cpu_offload = tracker is not None and config.offload != Offload.NONE
    if tracker is not None and (cpu_offload or is_compiled_step(config.optimizer)):
        with untracked():
            optimizer.step()
        if not cpu_offload:  # compiled low-bit step: its state lives on the device, count it
            tracker.track([list(s.values()) for s in optimizer.state.values()])
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, compiled


def _keep_on_the_host(tracker: TensorTracker, model: torch.nn.Module) -> None:
    """Under `offload: params` FSDP2 keeps its sharded parameters, and the sharded gradients it
    makes in backward, on the host. A CPU trial's "device" is the host, so `tracker` stops
    counting both: the parameters now, each gradient when FSDP2 hands it over. FSDP2's
    `foreach_reduce` copies a gradient to the host (on CPU the copy is the reduce-scatter's own
    output, which a GPU frees once copied), then runs the parameter's post-accumulate-grad hooks
    (`Tensor.register_post_accumulate_grad_hook`, torch's public hook), as it does after adding
    a later micro-step's gradient to it."""
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    tracker.untrack(sharded)

    def on_the_host(param: torch.Tensor) -> None:
        tracker.untrack(param.grad)

    for p in sharded:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(on_the_host)


def join_group(
    device_type: str,
    local_rank: int,
    world: int,
    gpu_memory: int | None,
    group: bool,
    outside: int = 0,
) -> tuple[torch.device, int | None]:
    """Set up this rank for the launch's configs, once for all of them; returns its device and
    the capacity its trials are held to (`gpu_memory`; on CUDA as `cap_cuda` sets it, counting
    `outside`: the bytes the estimate puts outside the allocator). A process group is joined
    only where `group` (`needs_group`: a one-rank launch of plain-module configs starts none, as
    the job it measures does not)."""
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if group:
        # a one-rank launch runs without torchrun (`launcher.ONE_RANK_ENV`): its group of one
        # meets in a store of its own, with no port to find
        alone = world == 1 and "MASTER_ADDR" not in os.environ
        where: dict[str, Any] = (
            {"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else {}
        )
        backend = "nccl" if device_type == "cuda" else "gloo"
        ids = {"device_id": device} if device_type == "cuda" else {}
        dist.init_process_group(backend, timeout=collective_timeout(), **ids, **where)
        if device_type == "cuda":
            dist.barrier()  # the NCCL communicator and its buffers exist from here on
    if device_type == "cuda":
        return device, cap_cuda(gpu_memory, device, outside)
    return device, gpu_memory


def needs_group(configs: list[dict[str, Any]], world: int) -> bool:
    """Whether a launch of `configs` on `world` ranks joins a process group: on several ranks,
    or where one of its configs' layouts has a communicator (FSDP2 on one GPU)."""
    return world > 1 or any(layout_of(Config.from_dict(c), world).communicators for c in configs)


def release(device: torch.device) -> None:
    """Free what the config before left, so the next config starts as a fresh process would:
    its tensors (reference cycles included), the allocator's cache and peaks, dynamo's compiled
    code (a second compiled config must compile its own graphs), and the host's peak RSS (Linux
    resets it, `VmHWM`, on writing 5 to `clear_refs`)."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def run(
    spec: dict[str, Any],
    config: Config,
    device: torch.device,
    capacity: int | None,
    rank: int,
    world: int,
    local_rank: int,
    progress: Progress | None = None,
    slow_after_s: float | None = None,
) -> dict[str, Any] | None:
    """Build `config`, run its steps and return its result (on local rank 0; None elsewhere).
    `slow_after_s`: a measured step longer than this (on the slowest rank) ends the steps there,
    and the result, of the steps measured so far, is `slow` (`autofit.trials.budget`)."""
    progress = progress or Progress(None, 0)
    if config.launch in HF_LAUNCHES:  # HF Trainer's (or TRL's SFTTrainer's) own loop
        from autofit.trials.trainer import run_trainer, trainer_setup

        make = trainer_setup
        if config.launch == Launch.TRL:
            from autofit.trials.trl import sft_setup as make

        made = run_trainer(spec, config, device, capacity, world, progress, slow_after_s, make)
        return made if local_rank == 0 else None
    progress("build")

    model_spec = ModelSpec(**spec["model"])
    torch.manual_seed(0)
    tracker = TensorTracker(capacity) if device.type == "cpu" else None
    lengths = spec.get("lengths")
    warmup = warmup_steps(config, spec["warmup"], data=bool(lengths))
    steps = warmup + spec["steps"]
    plan = None
    if lengths:  # drawn on the host, untracked: token ids are no term of the peak
        plan = step_batches(model_spec, config, rank, device, lengths, steps, warmup - 1)
    with tracker if tracker is not None else contextlib.nullcontext():
        applied, plan, build_peak = _build(model_spec, config, device, rank, steps, plan, tracker)
        ran = _steps(applied, plan, warmup, steps, device, tracker, progress, slow_after_s)
    peak_t = torch.tensor(
        _peaks(tracker, build_peak, ran.device_peak, device), dtype=torch.float64, device=device
    )
    all_reduce(peak_t, dist.ReduceOp.MAX)
    host_t = torch.tensor([float(host_peak_bytes())], dtype=torch.float64, device=device)
    all_reduce(host_t, dist.ReduceOp.SUM)
    loss_t = torch.stack(ran.losses).to(torch.float64)
    all_reduce(loss_t, dist.ReduceOp.AVG if device.type == "cuda" else dist.ReduceOp.SUM)
    if device.type != "cuda":  # gloo has no AVG
        loss_t /= world
    step_time, tokens_per_s = _speed(config, plan, ran.times, warmup, bool(lengths), world, device)
    compile_report = compile_result(config, ran.compiled, ran.recompiled, device)
    if local_rank != 0:
        return None
    result: dict[str, Any] = (
        {"status": "slow", "message": ran.slow} if ran.slow else {"status": "ok"}
    )
    return {
        **compile_report,
        **result,
        "sharding": str(applied.sharding),
        "process_group": dist.is_initialized(),
        "peak_bytes": int(peak_t[0].item()),
        "peak_allocated_bytes": int(peak_t[1].item()),
        "build_peak_bytes": int(peak_t[2].item()),
        "device_peak_bytes": int(peak_t[3].item()) or None,
        "host_peak_bytes": int(host_t[0].item()),
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "losses": [float(x) for x in loss_t.tolist()],
        "capacity_bytes": capacity,
    }


def _build(
    model_spec: ModelSpec, config: Config, device: torch.device, rank: int, steps: int,
    plan: list[tuple[list[Batch], int]] | None, tracker: TensorTracker | None,
) -> tuple[Applied, list[tuple[list[Batch], int]], int]:  # fmt: skip
    """Build `config` for training (and, without the data's lengths, its fixed batch), then set
    the peaks back to what the build left: the model, each step's batches, and the build's
    peak."""
    applied = build_for_trial(model_spec, config, device)
    applied.model.train()
    if plan is None:
        plan = step_batches(model_spec, config, rank, device, None, steps)
    # On CPU the "device" is the host: offloaded optimizer state (and, for offload=params, the
    # sharded fp32 params) are kept out of the device count, as they would be on a GPU.
    gc.collect()
    if tracker is not None:
        build_peak = tracker.peak
        if config.offload == Offload.PARAMS:  # what FSDP2 manages is on the host; not what it left
            _keep_on_the_host(tracker, applied.model)
        tracker.reset_peak()
    else:
        build_peak = torch.cuda.max_memory_reserved(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return applied, plan, build_peak


@dataclass
class _Ran:
    """What a config's steps measured on this rank: each step's loss and seconds (compile time
    taken out of the measured ones), what dynamo compiled in warm-up and again in measured
    steps, the device's peak level (CUDA), and why the steps stopped as slow ("": they did
    not)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    compiled: CompileStats = field(default_factory=CompileStats)
    recompiled: CompileStats = field(default_factory=CompileStats)
    device_peak: int = 0
    slow: str = ""


def _steps(
    applied: Applied, plan: list[tuple[list[Batch], int]], warmup: int, steps: int,
    device: torch.device, tracker: TensorTracker | None, progress: Progress,
    slow_after_s: float | None,
) -> _Ran:  # fmt: skip
    """Run the warm-up then the measured steps, `steps` in all, each reported to `progress`;
    a measured step past `slow_after_s` on the slowest rank ends them."""
    ran = _Ran()
    for step in range(steps):
        warm = step < warmup
        progress("warmup" if warm else "step", step + 1 - (0 if warm else warmup))
        start = time.perf_counter()
        batches = [b if torch.is_tensor(b) else _on(b, device) for b in plan[step][0]]
        loss, made = train_step(applied, batches, tracker)
        ran.losses.append(loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            ran.device_peak = max(ran.device_peak, device_used_bytes(device))
        # compile time is not training time: a recompile in a measured step is taken out
        ran.times.append(time.perf_counter() - start - (0.0 if warm else made.seconds))
        if warm:
            ran.compiled += made
        else:
            ran.recompiled += made
            ran.slow = _too_slow(ran.times[-1], slow_after_s, device, step + 1 - warmup)
            if ran.slow:
                break
    return ran


def _peaks(
    tracker: TensorTracker | None, build_peak: int, device_peak: int, device: torch.device
) -> list[int]:
    """This rank's peaks: reserved, allocated, the build's, and the device level (none on CPU,
    where the tracker counts both of the first)."""
    if tracker is not None:
        return [tracker.peak, tracker.peak, build_peak, 0]  # no device-level view on CPU
    return [
        torch.cuda.max_memory_reserved(device),
        torch.cuda.max_memory_allocated(device),
        build_peak,
        device_peak,
    ]


def _speed(
    config: Config, plan: list[tuple[list[Batch], int]], times: list[float], warmup: int,
    data: bool, world: int, device: torch.device,
) -> tuple[float, float]:  # fmt: skip
    """The median measured step's seconds and the tokens/s of all ranks: with the data's
    lengths (`data`), the useful tokens (padding excluded) of the measured steps, reduced over
    the ranks."""
    measured = times[warmup:] or times
    step_time = statistics.median(measured)
    tokens_per_s = config.micro_batch * config.grad_accum * config.seq_len * world / step_time
    if data:  # useful tokens (padding excluded) of the measured steps, all ranks
        ran = plan[warmup : len(times)] if times[warmup:] else plan[: len(times)]
        useful = [n for _, n in ran]
        useful_t = torch.tensor([float(sum(useful))], dtype=torch.float64, device=device)
        all_reduce(useful_t, dist.ReduceOp.SUM)
        tokens_per_s = float(useful_t.item()) / sum(measured)
    return step_time, tokens_per_s


def _too_slow(seconds: float, limit: float | None, device: torch.device, measured: int) -> str:
    """Why the steps stop here ("": they go on): the step just measured took longer than
    `limit` on the slowest rank (every rank calls this and decides alike)."""
    if limit is None:
        return ""
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    all_reduce(slowest, dist.ReduceOp.MAX)
    took = float(slowest.item())
    if took <= limit:
        return ""
    return (
        f"stopped as slow after {measured} measured step(s): a step took {took:.2f} s, past "
        f"{limit:.2f} s ({SLOW_FACTOR:g}x its estimated step, at least {SLOW_MIN_S:g} s); "
        "its tokens/s are of the steps it ran"
    )


def compile_result(
    config: Config, compiled: CompileStats, recompiled: CompileStats, device: torch.device
) -> dict[str, Any]:
    """The trial's compile fields (None when not compiled; every rank calls this, it reduces):
    `compile_s` (dynamo's compile time in warm-up and any recompile, the slowest rank's),
    `graphs` and `graph_breaks` (warm-up and measured steps), `recompiles` (graphs compiled again
    during measured steps: none in a sound run) and, when there were any, a message with dynamo's
    reasons. A compiled model that compiled no graph raises: that run would be eager."""
    if not config.compile:
        return {"compile_s": None, "graphs": None, "graph_breaks": None, "recompiles": None}
    if compiled.graphs + recompiled.graphs == 0:
        raise RuntimeError(
            "compile=true compiled no graph in the warm-up step: torch.compile did not run "
            "(is TORCHDYNAMO_DISABLE set, or torch._dynamo.config.disable?). The trial would "
            "measure eager code; use compile=false, or let torch.compile run."
        )
    seconds = torch.tensor([compiled.seconds + recompiled.seconds], dtype=torch.float64)
    seconds = seconds.to(device)
    all_reduce(seconds, dist.ReduceOp.MAX)
    total = compiled + recompiled
    report: dict[str, Any] = {
        "compile_s": float(seconds.item()),
        "graphs": total.graphs,
        "graph_breaks": total.graph_breaks,
        "recompiles": recompiled.graphs,
    }
    if recompiled.graphs:
        reasons = "; ".join(recompile_reasons(recompiled.graphs)) or "no reason recorded"
        report["message"] = (
            f"{recompiled.graphs} graph(s) compiled again during measured steps "
            f"({recompiled.seconds:.2f} s, taken out of the step times): {reasons}"
        )
    return report


def _write(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(data))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    # A rank killed by a native fault (SIGSEGV, SIGABRT on heap corruption) prints the Python
    # stack of each thread to its stderr, which the trial's error quotes: where it died, not only
    # "terminated with signal".
    faulthandler.enable()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    _offer_to_oom_killer()
    out = Path(args.out)
    (out.parent / f"pid.{rank}").write_text(str(os.getpid()))
    rank_file = out.parent / f"{out.name}.rank{rank}.json"
    spec = json.loads(Path(args.spec).read_text())
    progress = Progress(out.parent / PROGRESS_FILE if local_rank == 0 else None, spec["steps"])
    try:
        group = needs_group(spec["configs"], world)
        device, capacity = join_group(
            spec["device"], local_rank, world, spec.get("gpu_memory"), group,
            spec.get("outside_bytes", 0),
        )  # fmt: skip
        for index, config in enumerate(spec["configs"]):
            progress.config = index
            if index:
                release(device)
            slow = (spec.get("slow_after_s") or [None] * (index + 1))[index]
            result = run(spec, Config.from_dict(config), device, capacity, rank, world,
                         local_rank, progress, slow)  # fmt: skip
            if result is not None:
                _write(config_result(out, index), result)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a status
        lines = traceback.format_exception(exc)
        kind = oom_kind(exc, "".join(lines))
        message = f"rank {rank}: {type(exc).__name__}: {exc}"
        report = {"status": "oom" if kind else "error", "message": message, "oom_of": kind}
        report["config"] = progress.config
        _write(rank_file, {**report, "traceback": "".join(lines)})
        print("".join(lines[-20:]), file=sys.stderr, flush=True)
        os._exit(1)  # no process-group teardown: other ranks may be stuck in a collective
    _write(rank_file, {"status": "ok", "message": ""})
    if dist.is_initialized():
        dist.destroy_process_group()
