"""Trained embeddings and LM head (`train_embeddings`): their copies, rows, gradients and loss
tensors.
"""

from __future__ import annotations

import autofit.recipe as recipe
from autofit.errors import ConfigError
from autofit.estimate.memory.widths import BF16, FP32, grad_bytes, traced_loss
from autofit.layout import Sharding
from autofit.settings import trained_token_count, trained_tokens_error
from autofit.structure import TRL_LOSS, Structure
from autofit.values import Loss, TrainEmbeddings


# ----- trainable embeddings and LM head (`train_embeddings`) -------------------------------------
# The builder trains the modules `autofit.recipe.trained_embedding_modules` names (the input
# embedding, and the LM head unless it is tied to it), the rows `trained_token_ids` says, with
# peft beside the frozen LoRA base (`autofit.builder.lora.embedding_options`). The frozen originals
# stay (counted with the base, `frozen_other_bytes`); the trained weights are trainable
# parameters like the adapters (fp32 masters, gradients and optimizer state by `trainable`).
def trained_rows(s: Structure, train_embeddings: str) -> int:
    """Token rows trained in each trained module; `tokens:N` beyond the vocabulary is a
    `ConfigError`."""
    problem = trained_tokens_error(train_embeddings, s.vocab)
    if problem is not None:
        raise ConfigError(problem)
    return len(recipe.trained_token_ids(train_embeddings, s.vocab))


def trained_module_params(s: Structure, train_embeddings: str) -> int:
    """Trained parameters of one trained module (the embedding's, or the head's: both are
    vocab x hidden): its trained rows x its width."""
    if train_embeddings == TrainEmbeddings.NONE:
        return 0
    return trained_rows(s, train_embeddings) * (s.embedding_params // max(s.vocab, 1))


def trained_embedding_params(s: Structure, train_embeddings: str) -> int:
    """Trainable parameters `train_embeddings` adds to a LoRA run: `full` a trainable copy of the
    embedding and of an untied head (Qwen-7B: 2 x 151,936 x 4,096 = 1.24 B; its README's "LoRA
    (emb)" run measures 13.6 GB more than its LoRA run, 33.7 vs 20.1 GB at seq 256 on one A100);
    `tokens:N` N rows of each. A tied head's trained weight is the embedding's: counted once."""
    modules = recipe.trained_embedding_modules(train_embeddings, s.tied_embeddings)
    return len(modules) * trained_module_params(s, train_embeddings)


def trained_token_buffer_bytes(s: Structure, train_embeddings: str) -> float:
    """`tokens:N`: peft keeps the original values of the trained rows as a buffer beside each
    trained module's rows (`TrainableTokensLayer.trainable_tokens_original`, in the frozen dtype:
    the builder casts it); a buffer is whole on every GPU (FSDP2 shards parameters only)."""
    if trained_token_count(train_embeddings) is None:
        return 0.0
    return trained_embedding_params(s, train_embeddings) * BF16


def trained_unit_grad_bytes(s: Structure, train_embeddings: str, sharding: Sharding) -> float:
    """Under FSDP2 the embedding unit and `[norm, head]` (or, tied, the root) hold the trained
    weights, so the unit reduced at the end of its backward has their unsharded gradients, bf16
    from autograd and FSDP2's fp32 copy for the reduce-scatter (`unit_grad_bytes`' rule for the
    units of the embedding and head of a full fine-tune); the largest unit sets the peak."""
    if sharding is not Sharding.FSDP2:
        return 0.0
    return trained_module_params(s, train_embeddings) * (BF16 + FP32)


def trained_head_autocast_bytes(s: Structure, train_embeddings: str, autocast: bool) -> float:
    """Under autocast (the plain module and DDP, bf16-mixed) the head's fp32 trainable copy
    (`full`; tied: the embedding's copy) is multiplied through autocast's cached bf16 copy, kept
    for backward (`autocast_copy_bytes`' rule for the head of a full fine-tune). The embedding
    lookup is not autocast. `tokens:N` merges its rows into the bf16 weight instead
    (`trained_head_loss_bytes`)."""
    if not autocast or train_embeddings != TrainEmbeddings.FULL:
        return 0.0
    return trained_module_params(s, train_embeddings) * BF16


def trained_largest_tensor(s: Structure, train_embeddings: str) -> int:
    """Elements of the largest trainable tensor `train_embeddings` adds (one module's trained
    weight): what CPU AdamW's temporaries are sized by (`optimizer_temp_bytes`)."""
    return trained_module_params(s, train_embeddings)


def trained_head_loss_bytes(
    s: Structure, micro_batch: int, seq_len: int, train_embeddings: str, loss: str
) -> tuple[float, float]:
    """What a trained LM head adds outside the layers that a frozen one's traced loss does not
    keep, (at the loss's peak through the start of its backward, at the peak of its forward):

    - `standard`: the head's input (the final norm's bf16 output, tokens x hidden), which the
      head's matmul saves for its weight gradient (a frozen head saves only its weight);
    - `tokens:N`: the merged weight peft builds at each forward (`get_merged_weights`: the frozen
      weight with the trained rows copied in, vocab x hidden in bf16), which the head's matmul
      saves for the input gradient (`standard`), or which the chunked loss reads through its
      forward;
    - `chunked` (and Liger's `fused`, counted as it): the fp32 sum of the head weight's gradient,
      vocab x hidden, from the loss's forward through its backward (`autofit.builder.loss`; as
      `head_grad_sum_bytes` for a full fine-tune);
    - TRL's fused head (`TRL_LOSS`, `launch: trl`): nothing here, its function keeps its input
      whatever trains and makes the weight's fp32 gradient in its backward
      (`autofit.estimate.memory.trl.fused_head_bytes`, told the head trains).

    `loss` is the loss the trace runs (`traced_loss`)."""
    if train_embeddings == TrainEmbeddings.NONE or loss == TRL_LOSS:
        return 0.0, 0.0
    head = trained_module_params(s, "full")  # the head's whole weight, vocab x hidden
    merged = head * BF16 if trained_token_count(train_embeddings) is not None else 0.0
    if traced_loss(loss) == Loss.CHUNKED:
        grad_sum = head * FP32
        return grad_sum, grad_sum + merged
    kept = micro_batch * seq_len * s.hidden * BF16 + merged
    return kept, kept


def trained_head_grad_bytes(
    s: Structure, train_embeddings: str, sharding: Sharding, shard: int, precision: str,
    optimizer: str, accumulates: bool,
) -> float:  # fmt: skip
    """The trained head's gradient in the last decoder layer's backward (the head's backward ran
    first): the plain module's `.grad` in the trainable dtype. Under FSDP2, the `[norm, head]`
    unit's reduce-scattered shard, and the reduce-scatter's input (the unit's unsharded gradients
    in the reduce dtype), which FSDP2 keeps until the next unit's reduce-scatter
    (`reduce_scatter_states`, torch 2.13 `_fsdp_param_group.post_backward`; measured on CPU
    trials: +1.5 MiB at llama-debug's last layer's backward for a 1 MiB fp32 head copy on 2
    ranks); with a tied head, the root unit's unsharded bf16 gradient, which the root reduces
    only at the end of backward. DDP's buckets and accumulated gradients are counted whole from
    the start of forward already."""
    head = trained_module_params(s, train_embeddings)
    if not head or accumulates or sharding is Sharding.DDP:
        return 0.0
    if sharding is Sharding.FSDP2 and s.tied_embeddings:
        return head * BF16
    if sharding is Sharding.FSDP2:
        reduce_input = recipe.DTYPE_BYTES[recipe.reduce_dtype(precision)]
        return head * (grad_bytes(precision, optimizer) / shard + reduce_input)
    return head * grad_bytes(precision, optimizer)


def trained_token_grad_bytes(s: Structure, train_embeddings: str) -> float:
    """`tokens:N`: the embedding's backward makes the gradient of the whole merged weight
    (dense, vocab x hidden, in its bf16 dtype) before peft keeps its trained rows: a transient at
    the end of backward (beside the gradients then alive: the optimizer step's moment)."""
    if trained_token_count(train_embeddings) is None:
        return 0.0
    return trained_module_params(s, "full") * BF16
