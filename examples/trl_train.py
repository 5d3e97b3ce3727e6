"""Train with a `launch: trl` plan's trainer export: TRL's SFTTrainer with its SFTConfig.

A plan made for a TRL script (`--launch trl`) measured `SFTTrainer.train()` on the model such a
script loads; its trainer export is the `SFTConfig` arguments measured (JSON: `packing` for
`batching: packed`, `max_length`, `activation_checkpointing` either way, the model's dtype in
`model_init_kwargs`) beside the plan file (`*.autofit.yaml`: the model, the knobs and peft's
`lora` section). This script loads the model the way the trial did, in a few lines, and trains
it with those arguments, SFTTrainer wrapping it with peft itself (its command line, data and
report are examples/trainer_train.py's):

    autofit plan --model llama-debug --gpus 1 --device cpu --space examples/tiny_space.yaml \\
        --launch trl --trials 2 --export args.json --format trainer
    python examples/trl_train.py --arguments args.json --plan args.autofit.yaml

The model here is built from the plan's preset with random weights (`from_config`), the data is
random token ids; in your script pass your checkpoint's path as `model` (SFTTrainer loads it with
the JSON's `model_init_kwargs`: without a `dtype` it would load float32) and your tokenizer as
`processing_class`. `--peak` prints the step's peak memory as the trials measure it (on CPU the
live tensor bytes, autofit's tracker; on a GPU `max_memory_reserved`).
"""

from __future__ import annotations

import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from trainer_train import command_line, finish, peak_tracker, random_rows, report
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from autofit.models import resolve_model


def load_model(plan: object, arguments: dict, device: str, folder: str) -> torch.nn.Module | str:
    """The model as the trial loaded it: from the plan's model in the dtype of the export's
    `model_init_kwargs` (bf16 for a LoRA base; a full fine-tune's train dtype). A QLoRA plan's
    `model_init_kwargs` also hold its `BitsAndBytesConfig` (as a dict): its model is saved to
    `folder` and its path returned, which SFTTrainer loads in 4 bits itself, as from your
    checkpoint's path."""
    kwargs = arguments["model_init_kwargs"]
    dtype = getattr(torch, kwargs["dtype"])
    hf_config = resolve_model(plan.document["model"]).to_hf_config()  # type: ignore[attr-defined]
    hf_config.use_cache = False
    if "quantization_config" in kwargs:  # your script: model="path/to/checkpoint"
        AutoModelForCausalLM.from_config(hf_config, dtype=dtype).save_pretrained(folder)
        return folder
    with torch.device(device):  # your script: model="path/to/checkpoint" instead
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def lora_config(plan: object) -> LoraConfig | None:
    """peft's LoraConfig of the plan's `lora` section (None for a full fine-tune), with the
    embedding and head copies `train_embeddings: full` trains (`modules_to_save`)."""
    lora = plan.document.get("lora")  # type: ignore[attr-defined]
    if not lora:
        return None
    trained = ("modules_to_save", "ensure_weight_tying")
    return LoraConfig(
        r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
        target_modules=lora["target_modules"], bias="none", task_type="CAUSAL_LM",
        **{key: lora[key] for key in trained if key in lora},
    )  # fmt: skip


def tokenizer() -> PreTrainedTokenizerFast:
    """A stand-in for your tokenizer: the data below is token ids already, and SFTTrainer needs
    a pad token (your script: AutoTokenizer.from_pretrained(path))."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
    )  # fmt: skip


def main() -> None:
    args, plan, arguments = command_line(__doc__.splitlines()[0])
    cfg = plan.best.config  # type: ignore[attr-defined]
    print(f"plan: {cfg.short()} (seq_len {cfg.seq_len}); packing {arguments['packing']}")
    tracker = peak_tracker(args)
    data = Dataset.from_dict({"input_ids": random_rows(plan).tolist()})
    with tracker, tempfile.TemporaryDirectory() as out:
        model = load_model(plan, arguments, args.device, f"{out}/model")
        config = SFTConfig(
            **{**arguments, "output_dir": out}, max_steps=args.steps, save_strategy="no",
            logging_steps=1, report_to="none", disable_tqdm=True,
            use_cpu=args.device == "cpu",
        )  # fmt: skip
        trainer = SFTTrainer(
            model=model, args=config, train_dataset=data, processing_class=tokenizer(),
            peft_config=lora_config(plan),
        )  # fmt: skip
        trainer.train()
    report(trainer, tracker, args)
    finish(trainer)


if __name__ == "__main__":
    main()
