"""Train with a `launch: trainer` plan's Trainer export: HF `Trainer` with its TrainingArguments.

A plan made for an HF Trainer script (`--launch trainer`) measured `Trainer.train()` on the model
such a script loads; its trainer export is the `TrainingArguments` measured (JSON) beside the
plan file (`*.autofit.yaml`: the model, the knobs and peft's `lora` section). This script loads
the model the way the trial did, in a few lines, and trains it with those arguments:

    autofit plan --model llama-debug --gpus 1 --device cpu --space examples/tiny_space.yaml \\
        --launch trainer --trials 2 --export args.json --format trainer
    python examples/trainer_train.py --arguments args.json --plan args.autofit.yaml

A plan for several GPUs (`--gpus 2`: DDP replicas, as `torchrun` runs a Trainer script) is
started as its launch line says: `torchrun --nproc-per-node 2 examples/trainer_train.py ...`.
The model here is built from the plan's preset with random weights (`from_config`); in your
script load your checkpoint with `from_pretrained(..., dtype=...)` in the same dtype instead.
`--peak` prints the step's peak memory as the trials measure it (on CPU the live tensor bytes,
autofit's tracker; on a GPU `max_memory_reserved`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import autofit
from autofit.models import resolve_model


def load_model(plan: object, device: str) -> torch.nn.Module:
    """The model as the trial loaded it: a LoRA base frozen in bf16 (a full fine-tune in its
    train dtype: fp32 masters under bf16-mixed), then peft LoRA of the plan's `lora` section,
    its adapters in fp32 under bf16-mixed (the embedding and head copies `train_embeddings:
    full` trains stay bf16, as peft makes them; `tokens:N`'s rows are upcast with the adapters).
    A QLoRA plan (`quant_backend: bitsandbytes`): loaded by `from_pretrained` with its
    `BitsAndBytesConfig`, then `prepare_model_for_kbit_training` (`load_qlora`)."""
    doc = plan.document  # type: ignore[attr-defined]
    cfg = plan.best.config  # type: ignore[attr-defined]
    mixed = cfg.precision == "bf16-mixed"
    dtype = torch.float32 if mixed and not cfg.is_lora else torch.bfloat16
    hf_config = resolve_model(doc["model"]).to_hf_config()
    hf_config.use_cache = False
    if cfg.quant_backend == "bitsandbytes":
        model = load_qlora(hf_config, cfg, device)
    else:
        with torch.device(device):  # your script: AutoModelForCausalLM.from_pretrained(path,
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)  # dtype=dtype)
    lora = doc.get("lora")
    if lora:
        from peft import LoraConfig, get_peft_model

        # what train_embeddings trains: copies (full) or token rows (tokens:N)
        trained = ("modules_to_save", "ensure_weight_tying", "trainable_token_indices")
        config = LoraConfig(
            r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"], bias="none", task_type="CAUSAL_LM",
            **{key: lora[key] for key in trained if key in lora},
        )  # fmt: skip
        model = get_peft_model(model, config, autocast_adapter_dtype=mixed)
    return model


def load_qlora(hf_config: object, cfg: object, device: str) -> torch.nn.Module:
    """A QLoRA script's model: `from_pretrained` with the plan's `BitsAndBytesConfig` (NF4, bf16
    compute; the LM head stays bf16), in bf16, then peft's `prepare_model_for_kbit_training`
    (every non-NF4 parameter upcast to fp32; activation checkpointing where the plan has it).
    Random weights here: a random bf16 model saved to a temporary folder stands for your
    checkpoint's path."""
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=cfg.bnb_4bit_use_double_quant,  # type: ignore[attr-defined]
        bnb_4bit_quant_storage=STORAGE[cfg.bnb_4bit_quant_storage],  # type: ignore[attr-defined]
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as path:  # your script: your checkpoint's path
        AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).save_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quantization, dtype=torch.bfloat16, device_map={"": device}
        )
    ckpt = cfg.checkpointing == "full"  # type: ignore[attr-defined]
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=ckpt)


STORAGE = {"uint8": torch.uint8, "bf16": torch.bfloat16, "fp16": torch.float16,
           "fp32": torch.float32}  # fmt: skip
"""`bnb_4bit_quant_storage` words as torch dtypes."""


def pad(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A micro-batch padded to its longest row, labels -100 at the padding."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros((len(examples), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = e["input_ids"]
        mask[i, : len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def command_line(description: str) -> tuple[argparse.Namespace, object, dict]:
    """The example's options, the plan file read back and the export's arguments (a plan that
    cannot be read: one paragraph, exit 2)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--arguments", required=True, help="the trainer export (JSON)")
    parser.add_argument("--plan", required=True, help="the plan file beside it (.autofit.yaml)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--peak", action="store_true", help="print the peak memory")
    args = parser.parse_args()
    try:
        plan = autofit.load_plan(args.plan)
    except autofit.AutofitError as exc:
        parser.exit(2, f"{exc}\n")
    with open(args.arguments) as fh:
        arguments = json.load(fh)
    return args, plan, arguments


def random_rows(plan: object) -> torch.Tensor:
    """One optimizer step's rows of `seq_len` random token ids for every rank torchrun started
    (your data instead; Trainer deals them to the ranks)."""
    cfg = plan.best.config  # type: ignore[attr-defined]
    torch.manual_seed(0)
    vocab = resolve_model(plan.document["model"]).vocab  # type: ignore[attr-defined]
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    return torch.randint(0, vocab, (cfg.micro_batch * cfg.grad_accum * ranks, cfg.seq_len))


def peak_tracker(args: argparse.Namespace) -> contextlib.AbstractContextManager[object]:
    """With `--peak` on CPU, autofit's tensor tracker (the trials' measure): active from the
    model's build on."""
    if args.peak and args.device == "cpu":
        from autofit.trials.memory import TensorTracker

        return TensorTracker()
    return contextlib.nullcontext()


def report(trainer: object, tracker: object, args: argparse.Namespace) -> None:
    """Each step's loss, and with `--peak` the peak memory (of the fullest rank), once."""
    peak = 0
    if args.peak:
        peak = (
            tracker.peak  # type: ignore[attr-defined]
            if args.device == "cpu"
            else torch.cuda.max_memory_reserved()
        )
        mine = torch.tensor([peak], device=trainer.args.device)  # type: ignore[attr-defined]
        peak = int(trainer.accelerator.gather(mine).max())  # type: ignore[attr-defined]
    if not trainer.is_world_process_zero():  # type: ignore[attr-defined]
        return
    for entry in trainer.state.log_history:  # type: ignore[attr-defined]
        if "loss" in entry:
            print(f"step {entry['step']}: loss {entry['loss']:.4f}")
    if args.peak:
        print(f"peak bytes: {peak}")


def finish(trainer: object) -> None:
    """End the process group torchrun's ranks joined, once nothing holds it: DDP's reducer
    keeps the group alive, and a group torn down at interpreter exit can hang there."""
    accelerator = trainer.accelerator  # type: ignore[attr-defined]
    trainer.model_wrapped = trainer.model = None  # type: ignore[attr-defined]
    accelerator.free_memory()  # its references to the wrapped model, optimizer and data
    accelerator.end_training()


def main() -> None:
    args, plan, arguments = command_line(__doc__.splitlines()[0])
    cfg = plan.best.config  # type: ignore[attr-defined]
    print(f"plan: {cfg.short()} (seq_len {cfg.seq_len}); optim {arguments['optim']}")
    tracker = peak_tracker(args)
    data = [{"input_ids": row} for row in random_rows(plan)]
    with tracker, tempfile.TemporaryDirectory() as out:
        model = load_model(plan, args.device)
        training = TrainingArguments(
            **{**arguments, "output_dir": out}, max_steps=args.steps, save_strategy="no",
            logging_steps=1, report_to="none", disable_tqdm=True,
            use_cpu=args.device == "cpu",
        )  # fmt: skip
        trainer = Trainer(model=model, args=training, train_dataset=data, data_collator=pad)
        trainer.train()
    report(trainer, tracker, args)
    finish(trainer)


if __name__ == "__main__":
    main()
