"""The trial's torchrun entry: `python -m autofit.trial.worker --spec SPEC.json --out OUT.json`.

Each rank builds the model, runs warm-up then measured steps, and writes `OUT.json.rank<R>.json`
(status and message); rank 0 also writes `OUT.json`, the whole result with peaks reduced over
ranks. The test-only env var `AUTOFIT_TRIAL_TEST_HANG=1` makes every rank hang after joining the
process group, so the launcher's timeout path can be tested.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autofit.config import Config
from autofit.errors import is_oom
from autofit.models import ModelSpec
from autofit.trial.apply import Applied, build_for_trial
from autofit.trial.memory import (
    TensorTracker,
    cap_cuda,
    device_used_bytes,
    host_peak_bytes,
    untracked,
)
from autofit.trial.optim import is_compiled_step

HANG_ENV = "AUTOFIT_TRIAL_TEST_HANG"
# A collective that never completes (a dead peer) fails in this time rather than at the trial's
# own limit.
INIT_TIMEOUT = datetime.timedelta(seconds=120)


def synthetic_batch(spec: ModelSpec, config: Config, rank: int, device: torch.device):
    """A fixed batch of random tokens per rank: the model memorises it, so the loss falls."""
    gen = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, spec.vocab, (config.micro_batch, config.seq_len), generator=gen)
    return tokens.to(device)


def train_step(run: Applied, batch: torch.Tensor, tracker: TensorTracker | None) -> torch.Tensor:
    """One optimizer step of `grad_accum` micro-steps; gradients sync on the last only. The loop
    is `Applied`'s documented training loop: what a user's run does."""
    config = run.config
    total = torch.zeros((), device=batch.device)
    for micro in range(config.grad_accum):
        with run.gradient_sync(micro == config.grad_accum - 1):
            with run.autocast():
                loss = run.model(input_ids=batch, labels=batch, use_cache=False).loss
            (loss / config.grad_accum).backward()
        total += loss.detach().float()
    optimizer = run.optimizer
    cpu_offload = tracker is not None and config.offload != "none"
    if tracker is not None and (cpu_offload or is_compiled_step(config.optimizer)):
        with untracked():
            optimizer.step()
        if not cpu_offload:  # compiled low-bit step: its state lives on the device, count it
            tracker.track([list(s.values()) for s in optimizer.state.values()])
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / config.grad_accum


def run(spec: dict[str, Any], rank: int, world: int, local_rank: int) -> dict[str, Any] | None:
    device_type = spec["device"]
    gpu_memory = spec.get("gpu_memory")
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=INIT_TIMEOUT)
        dist.barrier()  # the NCCL communicator and its buffers exist from here on
        capacity = cap_cuda(gpu_memory, device)
    else:
        device = torch.device("cpu")
        capacity = gpu_memory
        dist.init_process_group("gloo", timeout=INIT_TIMEOUT)
    if os.environ.get(HANG_ENV) == "1":
        while True:
            time.sleep(1)

    config = Config.from_dict(spec["config"])
    model_spec = ModelSpec(**spec["model"])
    torch.manual_seed(0)
    tracker = TensorTracker(capacity) if device_type == "cpu" else None
    device_peak = 0
    with tracker if tracker is not None else contextlib.nullcontext():
        applied = build_for_trial(model_spec, config, device)
        applied.model.train()
        batch = synthetic_batch(model_spec, config, rank, device)
        # On CPU the "device" is the host: offloaded optimizer state (and, for offload=params, the
        # sharded fp32 params) are kept out of the device count, as they would be on a GPU.
        gc.collect()
        if tracker is not None:
            build_peak = tracker.peak
            if config.offload == "params":  # what FSDP2 manages is on the host; not what it left
                tracker.untrack([p for p in applied.model.parameters() if isinstance(p, DTensor)])
            tracker.reset_peak()
        else:
            build_peak = torch.cuda.max_memory_reserved(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        losses, times = [], []
        for _ in range(spec["warmup"] + spec["steps"]):
            start = time.perf_counter()
            loss = train_step(applied, batch, tracker)
            losses.append(loss)
            if device_type == "cuda":
                torch.cuda.synchronize(device)
                device_peak = max(device_peak, device_used_bytes(device))
            times.append(time.perf_counter() - start)
    if tracker is not None:
        peaks = [tracker.peak, tracker.peak, build_peak, 0]  # no device-level view on CPU
    else:
        peaks = [
            torch.cuda.max_memory_reserved(device),
            torch.cuda.max_memory_allocated(device),
            build_peak,
            device_peak,
        ]
    peak_t = torch.tensor(peaks, dtype=torch.float64, device=device)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    host_t = torch.tensor([float(host_peak_bytes())], dtype=torch.float64, device=device)
    dist.all_reduce(host_t, op=dist.ReduceOp.SUM)
    loss_t = torch.stack(losses).to(torch.float64)
    dist.all_reduce(loss_t, op=dist.ReduceOp.AVG if device_type == "cuda" else dist.ReduceOp.SUM)
    if device_type != "cuda":  # gloo has no AVG
        loss_t /= world
    measured = times[spec["warmup"] :] or times
    step_time = statistics.median(measured)
    tokens = config.micro_batch * config.grad_accum * config.seq_len * world
    if rank != 0:
        return None
    return {
        "status": "ok",
        "sharding": str(applied.sharding),
        "peak_bytes": int(peak_t[0].item()),
        "peak_allocated_bytes": int(peak_t[1].item()),
        "build_peak_bytes": int(peak_t[2].item()),
        "device_peak_bytes": int(peak_t[3].item()) or None,
        "host_peak_bytes": int(host_t[0].item()),
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "losses": [float(x) for x in loss_t.tolist()],
        "capacity_bytes": capacity,
    }


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    out = Path(args.out)
    (out.parent / f"pid.{rank}").write_text(str(os.getpid()))
    rank_file = out.parent / f"{out.name}.rank{rank}.json"
    spec = json.loads(Path(args.spec).read_text())
    try:
        result = run(spec, rank, world, local_rank)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a status
        status = "oom" if is_oom(exc) else "error"
        lines = traceback.format_exception(exc)
        message = f"rank {rank}: {type(exc).__name__}: {exc}"
        _write(rank_file, {"status": status, "message": message, "traceback": "".join(lines)})
        print("".join(lines[-20:]), file=sys.stderr, flush=True)
        os._exit(1)  # no process-group teardown: other ranks may be stuck in a collective
    _write(rank_file, {"status": "ok", "message": ""})
    if result is not None:
        _write(out, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
