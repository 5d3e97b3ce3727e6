"""A trial of `launch: trl`: TRL's `SFTTrainer.train()` runs the config's steps in the trial's
process.

`autofit.trials.trainer.run_trainer` runs it as it runs HF Trainer's loop (the same tracker, caps,
step times, slow stop and result); this sets the SFTTrainer up as an SFT script does
(`sft_setup`): the base model from `from_config` in the dtype it trains, LoRA as SFTTrainer's own
peft wrapping of the export's `LoraConfig`, the trainer export's `SFTConfig` arguments (for
`batching: packed` `packing` with TRL's best-fit-decreasing strategy, which SFTTrainer runs
padding-free) with the trial's own, and a tokenized dataset of documents (`sft_documents`):

- without the data's lengths, one optimizer step's rows of `seq_len` random token ids, the rows of
  `launch: trainer`'s trial (packed, each row is a document of its own: the collator flattens a
  micro-batch of them into one row of that many documents);
- with them, `padded`/`grouped`: the rows `launch: trainer`'s trial draws, in its order (the
  longest micro-batch first in step `warmup - 1`); `packed`: documents at lengths drawn from the
  data (truncated to `seq_len`), enough for every step, which SFTTrainer packs itself; its packed
  rows then run with the micro-batch of the most tokens first in step `warmup - 1` (once the
  optimizer's state exists), the rest in TRL's order.

Useful tokens are counted from what TRL's collator makes of each micro-batch (the attention
mask's ones, or every token of a padding-free row).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from autofit.builder.trainer import trainer_model
from autofit.builder.trl import make_sft_trainer, token_dataset
from autofit.data import LengthHistogram
from autofit.trials.trainer import Made, Setup, step_rows, step_sums
from autofit.values import Batching


def sft_documents(setup: Setup) -> list[list[int]]:
    """The documents the trial's SFTTrainer trains on (see the module's docstring)."""
    config, spec = setup.config, setup.spec
    if not setup.lengths or config.batching != Batching.PACKED:
        rows, _ = step_rows(
            spec, config, setup.lengths, setup.steps, setup.warmup - 1, setup.world, setup.rank
        )
        return [row.tolist() for row in rows]
    hist = LengthHistogram.from_dict(setup.lengths)
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(1234)
    mean = max(hist.tokens(config.seq_len) / hist.examples, 1.0)
    rows = setup.steps * config.grad_accum * config.micro_batch * setup.world
    count = int(rows * config.seq_len / mean) + config.micro_batch + 1
    lengths = [min(n, config.seq_len) for n in hist.sample(count, rng)]
    return [torch.randint(0, spec.vocab, (n,), generator=gen).tolist() for n in lengths]


def fullest_first(dataset: Any, micro_batch: int, at: int) -> Any:
    """TRL's packed `dataset` with its `micro_batch` rows of the most tokens as micro-batch `at`
    (each row's tokens: `seq_lengths` summed), the other rows in TRL's order."""
    tokens = [sum(row) for row in dataset["seq_lengths"]]
    fullest = sorted(range(len(tokens)), key=lambda i: -tokens[i])[:micro_batch]
    chosen = set(fullest)
    rest = [i for i in range(len(tokens)) if i not in chosen]
    start = min(at * micro_batch, len(rest))
    return dataset.select(rest[:start] + fullest + rest[start:])


class _Counted:
    """TRL's collator, recording each micro-batch's tokens (padding excluded) as it makes it."""

    def __init__(self, collate: Callable[[list[Any]], dict[str, Any]]) -> None:
        self.collate = collate
        self.tokens: list[int] = []

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        batch = self.collate(examples)
        mask = batch.get("attention_mask")
        self.tokens.append(int(mask.sum()) if mask is not None else batch["input_ids"].numel())
        return batch


def sft_setup(setup: Setup) -> Made:
    """`launch: trl`: TRL's `SFTTrainer` as an SFT script sets it up (see the module's
    docstring), and each step's useful tokens once it ran (with the data's lengths)."""
    config = setup.config
    model = trainer_model(setup.spec, config, setup.layout, None, setup.device)
    model.train()
    dataset = token_dataset(sft_documents(setup))
    trainer = make_sft_trainer(model, setup.args, dataset, setup.lora, setup.callbacks)
    if setup.lengths and config.batching == Batching.PACKED:
        at = (setup.warmup - 1) * config.grad_accum * setup.world  # rank 0's, Accelerate deals
        trainer.train_dataset = fullest_first(trainer.train_dataset, config.micro_batch, at)
    counted = _Counted(trainer.data_collator)
    trainer.data_collator = counted

    def useful() -> list[int] | None:
        if not setup.lengths:
            return None
        return step_sums(counted.tokens, config.grad_accum)

    return trainer, useful
