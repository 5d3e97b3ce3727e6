"""Train with an exported plan: `autofit.load_plan` + `autofit.apply`, then an ordinary loop.

`autofit.apply` returns the run as the trials measured it: `run.model` (the plain module on one
GPU, a DDP wrapper, or an FSDP2 root laid out as torchtitan), `run.optimizer` (torch AdamW, a
torchao low-bit AdamW or the CPU-offloaded one) and `run.train_step(micro_batches)`, the step the
trials ran (`run.autocast()` and `run.gradient_sync(...)` are its parts).

A one-GPU plan (`--gpus 1`, `wrap: none`) is the plain module: no torchrun, no process group:

    autofit plan --model llama-debug --gpus 1 --device cpu --space examples/tiny_space.yaml \\
        --seq-len 64 --export plan.yaml
    python examples/train_with_plan.py --plan plan.yaml                   # CPU, llama-debug
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        python examples/train_with_plan.py --plan plan.yaml --device cuda  # one GPU

Plans for several GPUs (DDP or FSDP2), and a one-GPU FSDP2 plan (offload: params), run under
torchrun, one process per GPU (on CPU, gloo processes stand in for GPUs):

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        torchrun --nproc-per-node 2 examples/train_with_plan.py --plan plan.yaml --device cuda

The model here is built from a preset with random weights; in your script load your checkpoint
instead (in bf16 for LoRA/QLoRA, on every rank) and call `autofit.apply` on it the same way.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import autofit
from autofit.models import resolve_model


def init_distributed(device: str, wrap: str) -> tuple[int, int]:
    """(rank, world size). A process group only where the plan needs one: several processes
    (torchrun sets WORLD_SIZE) or an FSDP2 plan (a one-rank mesh is still a process group); a
    one-GPU plain-module plan runs without one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and wrap == "none":
        if device == "cuda":
            torch.cuda.set_device(0)
        return 0, 1
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"),
                       ("RANK", "0"), ("LOCAL_RANK", "0")):  # fmt: skip
        os.environ.setdefault(key, value)  # a plain `python` run of a one-GPU FSDP2 plan
    os.environ["WORLD_SIZE"] = str(world)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="an autofit plan YAML (--format autofit)")
    parser.add_argument("--model", default="llama-debug", help="preset to build (random weights)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    args = parser.parse_args()

    try:
        plan = autofit.load_plan(args.plan)
    except autofit.AutofitError as exc:  # no plan file, or a malformed one: its paragraph
        parser.exit(2, f"{exc}\n")
    cfg = plan.best.config
    rank, world = init_distributed(args.device, cfg.wrap)
    if rank == 0:
        print(f"plan: {cfg.short()} (seq_len {cfg.seq_len}) for {plan.n_gpus} GPU(s)")
        if world != plan.n_gpus:
            print(
                f"note: the plan was measured on {plan.n_gpus} GPU(s); running {world} process(es)"
            )

    torch.manual_seed(0)  # every rank builds (loads) the same weights
    model = AutoModelForCausalLM.from_config(resolve_model(args.model).to_hf_config())
    if args.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    run = autofit.apply(model, cfg, device=device)  # quant, LoRA, checkpointing, DDP/FSDP2, optim
    if rank == 0:
        print(f"sharding: {run.sharding}; optimizer: {type(run.optimizer).__name__}")

    vocab = resolve_model(args.model).vocab
    gen = torch.Generator().manual_seed(rank)  # each rank its own (fixed) data
    batch = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq_len), generator=gen)
    batch = batch.to(run.device)
    for step in range(args.steps):
        # one optimizer step: grad_accum micro-batches, forward and backward as trials measured
        # them (autocast, gradient sync on the last micro-step only), then the optimizer step
        loss = run.train_step([batch] * cfg.grad_accum).item()
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
