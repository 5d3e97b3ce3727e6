"""`launch: trl`: the data, the tokenizer and TRL's `SFTTrainer` an SFT script sets up, which the
trial runs (`autofit.trials.trl`) instead of autofit's own builder and loop, and the stand-in for
TRL's fused LM head that the layer trace runs (`traced_fused_head`).

Read from TRL 1.16 (`trl/trainer/sft_trainer.py`, `trl/trainer/utils.py`,
`trl/kernels/chunked_logprob.py`):

- the model is what an SFT script passes: the base from `from_config` in the dtype it trains
  (`autofit.builder.trainer.trainer_model` without LoRA); LoRA is SFTTrainer's own peft wrapping
  of `peft_config` (the export's `LoraConfig`: `autofit.builder.trainer.lora_config`), whose
  adapters peft keeps in fp32 (`get_peft_model`'s default `autocast_adapter_dtype`);
- the data is rows of token ids (`input_ids`), which SFTTrainer labels, truncates to
  `max_length` and with `packing` packs (best-fit decreasing, each row's `seq_lengths`); its
  collator (`DataCollatorForLanguageModeling`) pads each micro-batch and passes its attention
  mask, or, packed (`padding_free`), flattens the micro-batch into one row whose position ids
  restart at each document;
- the loss: SFTTrainer gives the model a fused LM head (`add_fused_lm_head`, asked for the
  log-probabilities, the entropy and the top-1 hits: `TRL_OUTPUTS`) and takes the negative
  log-likelihood of its log-probabilities; the logits never exist. The head's buffers are
  counted by the estimator from TRL's source (`autofit.estimate.memory.trl`); the layer trace
  runs TRL's own head around `_HeadStandIn`, which returns and keeps what TRL's kernel does
  without its buffers;
- the tokenizer: SFTTrainer needs a processing class with a pad token, and the data is token ids
  already, so a word-level tokenizer of three tokens built in code serves (nothing downloaded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autofit.builder.trainer import lora_config

TRL_OUTPUTS = ("log_probs", "entropy", "is_top1")
"""What SFTTrainer asks its fused LM head for (`add_fused_lm_head(..., outputs=...)` in TRL 1.16's
`SFTTrainer.__init__`): the entropy and top-1 hits feed the metrics it logs at every step."""

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "</s>", "<unk>"
PAD_ID = 0
"""The pad token's id: TRL's collator pads `input_ids` with it (labels with -100)."""


def offline_tokenizer() -> Any:
    """A tokenizer SFTTrainer accepts as its processing class (pad and EOS tokens, pad id
    `PAD_ID`), built in code: the data is token ids already, so no vocabulary is needed."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD_TOKEN: PAD_ID, EOS_TOKEN: 1, UNK_TOKEN: 2}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=UNK_TOKEN)),
        pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN,
    )  # fmt: skip


def token_dataset(docs: Sequence[Sequence[int]]) -> Any:
    """A `datasets.Dataset` of `docs` (token id lists) in an `input_ids` column: a tokenized
    dataset, which SFTTrainer labels, truncates and packs itself."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [[int(t) for t in doc] for doc in docs]})


def make_sft_trainer(
    model: nn.Module, arguments: dict[str, Any], dataset: Any, lora: dict[str, Any] | None,
    callbacks: list[Any],
) -> Any:  # fmt: skip
    """TRL's `SFTTrainer` of `model` with `SFTConfig(**arguments)` (the trainer export's for a
    `launch: trl` plan, with the trial's own), training on `dataset`, wrapping the model with peft
    LoRA of `lora` (the export's section) itself, with `callbacks`."""
    from trl import SFTConfig, SFTTrainer

    return SFTTrainer(
        model=model,
        args=SFTConfig(**arguments),
        train_dataset=dataset,
        processing_class=offline_tokenizer(),
        peft_config=lora_config(lora) if lora is not None else None,
        callbacks=callbacks,
    )


# ----- the layer trace's stand-in for TRL's fused LM head -------------------------------------
class _HeadStandIn(torch.autograd.Function):
    """TRL's `ChunkedLogProbFunction` without its buffers: the outputs it returns (fp32
    log-probabilities and entropy, bool top-1 hits, one per token) and what it saves for backward
    (the hidden states, the head weight, the targets, fp32 `log_z` and the entropy), no tile, no
    statistics, no gradient buffer. Its backward calls `stop` (the trace's end of the loss) and
    returns zero gradients in the inputs' dtypes, as TRL's returns them."""

    stop: Callable[[], None] | None = None

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        targets: torch.Tensor, temperature: float, chunk_size: int,
        final_logit_softcapping: float | None = None, logit_scale: float = 1.0,
        outputs: tuple[str, ...] = TRL_OUTPUTS,
    ) -> tuple[Any, ...]:  # fmt: skip
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        log_z = hidden.new_empty((n,), dtype=torch.float32)
        logprobs = hidden.new_empty((n,), dtype=torch.float32)
        entropy = hidden.new_empty((n,), dtype=torch.float32) if "entropy" in outputs else None
        top1 = hidden.new_empty((n,), dtype=torch.bool) if "is_top1" in outputs else None
        kept = log_z if entropy is None else entropy
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, kept)
        if top1 is not None:
            ctx.mark_non_differentiable(top1)
        return logprobs, entropy, None, None, top1

    @staticmethod
    def backward(ctx: Any, *_grads: Any) -> tuple[Any, ...]:  # type: ignore[override]
        if _HeadStandIn.stop is not None:
            _HeadStandIn.stop()
        hidden, weight, bias = ctx.saved_tensors[:3]
        wants_h, wants_w, wants_b = ctx.needs_input_grad[:3]
        return (
            torch.zeros_like(hidden) if wants_h else None,
            torch.zeros_like(weight) if wants_w else None,
            torch.zeros_like(bias) if wants_b and bias is not None else None,
            None, None, None, None, None, None,
        )  # fmt: skip


def add_fused_head(model: nn.Module) -> nn.Module:
    """Give `model` TRL's fused LM head as SFTTrainer does (on the causal LM inside a peft
    wrapper), asked for `TRL_OUTPUTS`."""
    from trl.trainer.utils import add_fused_lm_head

    from autofit.builder.loss import causal_lm

    add_fused_lm_head(causal_lm(model), outputs=TRL_OUTPUTS)
    return model


@contextlib.contextmanager
def traced_fused_head(stop: Callable[[], None] | None = None) -> Iterator[None]:
    """While active, TRL's fused head computes through `_HeadStandIn` (its buffers are the
    estimator's, `autofit.estimate.memory.trl`), whose backward calls `stop` first."""
    from unittest import mock

    from trl.trainer import utils

    with mock.patch.object(utils, "_ChunkedLogProbFunction", _HeadStandIn):
        _HeadStandIn.stop = stop
        try:
            yield
        finally:
            _HeadStandIn.stop = None


def fused_head_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The loss of `ids` as SFTTrainer's `compute_loss` takes it from the fused head: the
    negative log-likelihood summed over the labelled tokens, over their count."""
    out = model(input_ids=ids, labels=ids, use_cache=False, fused_lm_head=True)
    return -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)
