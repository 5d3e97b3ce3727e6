"""A training script for `accelerate launch --config_file <autofit accelerate export>`.

Accelerate reads sharding, resharding, offload, checkpointing, mixed precision and the number of
processes from the exported config. What its format cannot carry (LoRA, quantization, micro-batch
and accumulation) comes from the side file `<name>.autofit.yaml` written next to it:

    autofit export --storage sqlite:///autofit-runs/<study>/study.db --study <study> \\
        --format accelerate --output fsdp2.yaml
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        accelerate launch --config_file fsdp2.yaml examples/accelerate_train.py \\
        --plan fsdp2.autofit.yaml
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from transformers import LlamaForCausalLM

import autofit
from autofit.models import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True, help="the .autofit.yaml side file")
    parser.add_argument("--model", default="llama-debug", help="preset to build (random weights)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    plan = autofit.load_plan(args.plan)
    cfg = plan.best.config
    if cfg.quant != "none" or cfg.offload == "optimizer" or cfg.optimizer != "adamw":
        raise SystemExit(
            f"This plan uses quant={cfg.quant}, offload={cfg.offload}, optimizer={cfg.optimizer}: "
            "Accelerate's FSDP2 plugin cannot set those up. Use examples/train_with_plan.py "
            "(autofit.apply does all of it) with torchrun instead."
        )
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if cfg.is_lora or cfg.precision == "bf16" else torch.float32
    model = LlamaForCausalLM(resolve_model(args.model).to_hf_config()).to(dtype)
    if cfg.is_lora:
        from peft import LoraConfig, get_peft_model

        lora = plan.document.get("lora") or {}
        model = get_peft_model(model, LoraConfig(
            r=cfg.lora_rank, lora_alpha=cfg.alpha, lora_dropout=0.0, bias="none",
            target_modules=lora.get("target_modules"), task_type="CAUSAL_LM",
        ))  # fmt: skip
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)

    vocab = resolve_model(args.model).vocab
    gen = torch.Generator().manual_seed(accelerator.process_index)
    batch = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq_len), generator=gen)
    batch = batch.to(accelerator.device)
    for step in range(args.steps * cfg.grad_accum):
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.is_main_process and accelerator.sync_gradients:
            print(f"step {step // cfg.grad_accum}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
