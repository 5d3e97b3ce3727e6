"""`launch: trainer`: the model and the `transformers.Trainer` a Trainer script sets up, which the
trial runs (`autofit.trials.trainer`) instead of autofit's own builder and loop.

The model is what such a script loads: `AutoModelForCausalLM.from_config` with random weights
in the dtype it trains (a LoRA base frozen in bf16, a full fine-tune in the config's train dtype:
fp32 masters under `bf16-mixed`, bf16 under `bf16`), then peft LoRA with the export's
`LoraConfig` (its rank, alpha, dropout and targets; the adapters in fp32 under `bf16-mixed`,
peft's `autocast_adapter_dtype`). Nothing of autofit's builder touches it: peft casts each
adapter's input to the adapter's dtype (autofit's builder switches that off, `keep_lora_inputs`),
activation checkpointing is Trainer's own (`activation_checkpointing_enable`, non-reentrant),
and the optimizer is the one `TrainingArguments.optim` names, made by Trainer in `train()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autofit.builder.dtypes import TORCH_DTYPES
from autofit.config import Config
from autofit.layout import Layout
from autofit.models import ModelSpec
from autofit.recipe import EMBEDDING_PEFT_OPTIONS
from autofit.values import Checkpointing


def trainer_model(
    spec: ModelSpec, config: Config, layout: Layout, lora: dict[str, Any] | None,
    device: torch.device,
) -> nn.Module:  # fmt: skip
    """`spec`'s causal LM as a Trainer script loads it for `config`: `from_config` in the dtype
    it trains (`Layout.base_dtype`), random weights, on `device`, its projections bitsandbytes
    NF4 for QLoRA (`as_loaded_in_4bit`), with peft LoRA of `lora` (the export's `lora` section,
    `autofit.export.schema.lora_section`) after `prepare_model_for_kbit_training` for a LoRA
    config; `lora` None: the model as an SFT script hands it to `SFTTrainer`, which wraps it."""
    from transformers import AutoModelForCausalLM

    hf_config = spec.to_hf_config()
    hf_config.use_cache = False
    with device:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=TORCH_DTYPES[layout.base_dtype])
    if layout.bnb is not None:
        model = as_loaded_in_4bit(model, layout, device)
    if lora is None:  # a full fine-tune, or the base that SFTTrainer wraps with peft itself
        return model
    from peft import get_peft_model

    if layout.bnb is not None:
        from peft import prepare_model_for_kbit_training

        ckpt = config.checkpointing == Checkpointing.FULL
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=ckpt)

    fp32_adapters = TORCH_DTYPES[layout.param_dtype] == torch.float32
    return get_peft_model(model, lora_config(lora), autocast_adapter_dtype=fp32_adapters)


def as_loaded_in_4bit(model: nn.Module, layout: Layout, device: torch.device) -> nn.Module:
    """`model` (bf16, from `from_config`) as `from_pretrained(..., quantization_config=
    BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=
    torch.bfloat16, ...), dtype=torch.bfloat16)` loads it (transformers 5.24's
    `Bnb4BitHfQuantizer`): every decoder projection a bitsandbytes `Linear4bit` of `layout.bnb`
    (`replace_with_bnb_linear` converts every `nn.Linear` but the output embeddings,
    `get_keys_to_not_convert`: the LM head stays bf16), the embeddings and norms bf16, and
    `is_loaded_in_4bit` set (`_process_model_after_weight_loading`), which
    `prepare_model_for_kbit_training` reads. Built in place, layer by layer, rather than saved
    and loaded (tests/builder/test_trainer_qlora.py holds it to `from_pretrained`'s parameters)."""
    from autofit.builder.model import decoder_layers, decoder_projections
    from autofit.builder.quantize import quantize_layer

    for layer in decoder_layers(model):
        every = [name for name, _ in decoder_projections(layer)]
        quantize_layer(layer, layout.quant, every, device, bnb=layout.bnb)
    model.is_loaded_in_4bit = True
    return model


def lora_config(lora: dict[str, Any]) -> Any:
    """peft's `LoraConfig` of the export's `lora` section (rank, alpha, dropout, targets, and
    the modules `train_embeddings` trains: `recipe.EMBEDDING_PEFT_OPTIONS`)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=lora["target_modules"],
        bias="none",
        task_type="CAUSAL_LM",
        **{key: lora[key] for key in EMBEDDING_PEFT_OPTIONS if key in lora},
    )


class TokenRows(torch.utils.data.Dataset):
    """Rows of token ids, each a causal LM example with its ids as labels: the data a Trainer
    trial trains on (`collate_rows` pads a micro-batch of them)."""

    def __init__(self, rows: Sequence[torch.Tensor]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]}


PAD_ID = 0


def collate_rows(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One micro-batch padded to its longest row (right padding, pad id 0, labels -100 and the
    attention mask 0 at the padding), as `DataCollatorForLanguageModeling` pads one."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = e["input_ids"]
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def make_trainer(
    model: nn.Module, arguments: dict[str, Any], dataset: TokenRows, callbacks: list[Any]
) -> Any:
    """`transformers.Trainer` of `model` with `TrainingArguments(**arguments)` (the trainer
    export's, with the trial's own: steps, where it writes, no saving or reporting), training on
    `dataset` padded by `collate_rows`, with `callbacks`."""
    from transformers import Trainer, TrainingArguments

    return Trainer(
        model=model,
        args=TrainingArguments(**arguments),
        train_dataset=dataset,
        data_collator=collate_rows,
        callbacks=callbacks,
    )
