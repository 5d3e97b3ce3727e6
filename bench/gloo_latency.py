"""Latency of small gloo collectives between two CPU processes: what a CPU trial's FSDP2 pays per
all-gather and reduce-scatter, the figure `autofit.estimate.comm.GLOO_LATENCY_S` records.

Run: `python bench/gloo_latency.py` (two processes, one thread each, on this machine's cores).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CALLS = 300


def _timed(collective, *tensors: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    for _ in range(20):
        collective(*tensors)
    start = time.perf_counter()
    for _ in range(CALLS):
        collective(*tensors)
    return (time.perf_counter() - start) / CALLS


def _work(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    for numel in (256, 65536):
        shard = torch.ones(numel, dtype=torch.bfloat16)
        full = torch.empty(2 * numel, dtype=torch.bfloat16)
        grads, out = torch.ones(2 * numel), torch.empty(numel)
        gather = _timed(dist.all_gather_into_tensor, full, shard)
        reduce = _timed(dist.reduce_scatter_tensor, out, grads)
        if rank == 0:
            print(
                f"{numel:6d} values: all_gather {gather * 1e6:5.0f} us, "
                f"reduce_scatter {reduce * 1e6:5.0f} us"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_work, nprocs=2)
