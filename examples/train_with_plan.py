"""Train with an exported plan: `autofit.load_plan` + `autofit.apply`, then an ordinary loop.

Runs on CPU in one process (a gloo group of world size 1) or under torchrun on GPUs:

    python examples/train_with_plan.py --plan plan.yaml                 # CPU, llama-debug
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        torchrun --nproc-per-node 2 examples/train_with_plan.py --plan plan.yaml --device cuda

The model here is built from a preset with random weights; in your script load your checkpoint
instead (in bf16 for LoRA/QLoRA) and call `autofit.apply` on it the same way.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

import autofit
from autofit.models import resolve_model


def init_process_group(device: str) -> None:
    """torchrun sets RANK/WORLD_SIZE; a plain `python` run becomes a group of one."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="an autofit plan YAML (--format autofit)")
    parser.add_argument("--model", default="llama-debug", help="preset to build (random weights)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    plan = autofit.load_plan(args.plan)
    cfg = plan.best.config
    init_process_group(args.device)
    rank = dist.get_rank()
    if rank == 0:
        print(f"plan: {cfg.short()} (seq_len {cfg.seq_len}); {plan.reason}")

    torch.manual_seed(0)
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    if args.device == "cpu":
        device = torch.device("cpu")
    with device:
        model = LlamaForCausalLM(resolve_model(args.model).to_hf_config())
    model = autofit.apply(model, cfg)  # quantize, LoRA, checkpointing, FSDP2: as measured
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq_len), generator=gen).to(device)
    for step in range(args.steps):
        total = 0.0
        for _ in range(cfg.grad_accum):
            loss = model(input_ids=batch, labels=batch).loss
            (loss / cfg.grad_accum).backward()
            total += loss.item() / cfg.grad_accum
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {total:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
