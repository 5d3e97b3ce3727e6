"""A training script for `accelerate launch --config_file <autofit accelerate export>`.

The export's `distributed_type` is the path the trials measured: `NO` (one GPU, the plain module),
`MULTI_GPU` (DDP) or `FSDP` (FSDP2 laid out as torchtitan). `accelerate launch` starts that many
processes and the `Accelerator` sets up the process group, the device and logging; the model and
optimizer come from `autofit.apply`, which builds exactly the measured path: quantization, LoRA,
checkpointing, DDP or FSDP2 units, and the optimizer (torchao low-bit, CPU-offloaded) included.
The plan is the side file `<name>.autofit.yaml` written next to the export:

    autofit export --storage sqlite:///autofit-runs/<study>/study.db --study <study> \\
        --format accelerate --output accelerate.yaml
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        accelerate launch --config_file accelerate.yaml examples/accelerate_train.py \\
        --plan accelerate.autofit.yaml

The model and optimizer are NOT passed to `accelerator.prepare`: for a DDP model Accelerate's
`prepare_model` would wrap it in a second `DistributedDataParallel`; for an FSDP2 model
`fsdp2_prepare_model` returns it as it is, but `prepare` still wraps each decoder layer in a
second activation checkpoint over autofit's (`fsdp_activation_checkpointing`). Nothing there is
needed: `run.train_step()` is the measured autocast, accumulation and optimizer step.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

import autofit
from autofit.models import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True, help="the .autofit.yaml side file")
    parser.add_argument("--model", default="llama-debug", help="preset to build (random weights)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    args = parser.parse_args()

    accelerator = Accelerator()  # launch, process group, device, logging: nothing is prepared
    try:
        plan = autofit.load_plan(args.plan)
    except autofit.AutofitError as exc:  # no plan file, or a malformed one: its paragraph
        parser.exit(2, f"{exc}\n")
    cfg = plan.best.config
    accelerator.print(f"plan: {cfg.short()} (seq_len {cfg.seq_len}) for {plan.n_gpus} GPU(s)")
    if accelerator.num_processes != plan.n_gpus:
        accelerator.print(
            f"note: the plan was measured on {plan.n_gpus} GPU(s); "
            f"running {accelerator.num_processes} process(es)"
        )

    if cfg.wrap != "none" and not dist.is_initialized():
        # FSDP2 needs a process group even on one device (a one-rank mesh): `accelerate launch`
        # makes one on GPUs (it runs torchrun), not for one process on --cpu.
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"),
                           ("RANK", "0"), ("WORLD_SIZE", "1")):  # fmt: skip
            os.environ.setdefault(key, value)
        dist.init_process_group("nccl" if accelerator.device.type == "cuda" else "gloo")

    torch.manual_seed(0)  # every process builds (loads) the same weights
    # Your script: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), every process.
    model = AutoModelForCausalLM.from_config(resolve_model(args.model).to_hf_config())
    run = autofit.apply(model, cfg, device=accelerator.device)
    accelerator.print(f"sharding: {run.sharding}; optimizer: {type(run.optimizer).__name__}")

    vocab = resolve_model(args.model).vocab
    gen = torch.Generator().manual_seed(accelerator.process_index)
    batch = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq_len), generator=gen)
    batch = batch.to(run.device)
    for step in range(args.steps):
        # one optimizer step: grad_accum micro-batches, forward and backward as trials measured
        # them (autocast, gradient sync on the last micro-step only), then the optimizer step
        loss = run.train_step([batch] * cfg.grad_accum).item()
        accelerator.print(f"step {step}: loss {loss:.4f}")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
