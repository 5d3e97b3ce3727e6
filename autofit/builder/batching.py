"""Micro-batches of token ids as the `batching` knob makes them (`autofit.data.batching` says how
sequences are laid out in rows; this makes the tensors). Trials run these on random tokens of the
data's lengths, and `Applied.collate` hands the same function to a user's loop.

- `padded`, `grouped`: each sequence (truncated to `seq_len`) is a row, right-padded to the
  longest row; padding positions are labelled `IGNORE_INDEX`. No attention mask is passed: under
  causal attention a real token never attends to a pad that follows it, so the loss is that of
  the unpadded sequences, and SDPA keeps its mask-free causal kernel (the one the estimate's
  trace measured; a 4-D padding mask would add `rows x width x width` bytes).
- `packed`: documents concatenated into rows of `seq_len` (one that does not fit continues as a
  document of its own at the start of the next row), position ids restarting at 0 for each
  document, the first token of each document labelled `IGNORE_INDEX` so no position predicts
  across a boundary (as `transformers.DataCollatorWithFlattening` labels them). Without an
  attention mask, transformers reads the document boundaries from the position ids
  (`masking_utils.find_packed_sequence_indices`): a block-diagonal causal mask under SDPA and
  eager, the varlen kernel under flash-attention. A last row that the documents do not fill is
  padded by a document of pad tokens without loss.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import islice

import torch

from autofit.builder.loss import IGNORE_INDEX
from autofit.data import LengthHistogram
from autofit.data.batching import check_batching, longest_micro_batch, micro_batches, pack_rows
from autofit.values import Batching

Inputs = dict[str, torch.Tensor]


def padded_batch(examples: Sequence[Sequence[int]], seq_len: int, pad_id: int = 0) -> Inputs:
    """`input_ids` and `labels` of `examples` (token id lists), each truncated to `seq_len`,
    right-padded to the longest."""
    rows = [list(e)[:seq_len] for e in examples]
    if not rows or not all(rows):
        raise ValueError("a micro-batch needs at least one example, and no example may be empty")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        labels[i, : len(r)] = ids[i, : len(r)]
    return {"input_ids": ids, "labels": labels}


def packed_rows(rows: Sequence[Sequence[Sequence[int]]], seq_len: int, pad_id: int = 0) -> Inputs:
    """`input_ids`, `labels` and `position_ids` of rows of documents (each row's documents hold
    at most `seq_len` tokens together; a row they do not fill ends in a pad document)."""
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for i, docs in enumerate(rows):
        at = 0
        for doc in docs:
            n = len(doc)
            if at + n > seq_len:
                raise ValueError(f"row {i} holds more than seq_len={seq_len} tokens")
            ids[i, at : at + n] = torch.tensor(list(doc), dtype=torch.long)
            labels[i, at + 1 : at + n] = ids[i, at + 1 : at + n]
            positions[i, at : at + n] = torch.arange(n)
            at += n
        positions[i, at:] = torch.arange(seq_len - at)  # the pad document, without loss
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def pack(examples: Sequence[Sequence[int]], seq_len: int) -> list[list[list[int]]]:
    """`examples` concatenated in order into rows of `seq_len` tokens (`pack_rows`, the rule the
    trials and the estimate count): each row's documents, the last row's too if it is not full."""
    docs = [list(e) for e in examples]
    full, last = pack_rows((len(d) for d in docs), seq_len)
    tokens = (token for doc in docs for token in doc)
    return [[list(islice(tokens, n)) for n in row] for row in (*full, last) if row]


def collate(
    examples: Sequence[Sequence[int]], batching: str, seq_len: int, pad_id: int = 0
) -> Inputs:
    """One micro-batch of `examples` (token id lists) as `batching` makes it: the keyword inputs
    of a HF causal LM (`Applied.loss` takes them). `grouped` batches are `padded` ones; the
    grouping is the order examples come in (a length-grouped sampler, HF's
    `LengthGroupedSampler`)."""
    check_batching(batching)
    if batching == Batching.PACKED:
        rows = pack(examples, seq_len)
        if not rows:
            raise ValueError("a micro-batch needs at least one token")
        return packed_rows(rows, seq_len, pad_id)
    return padded_batch(examples, seq_len, pad_id)


def drawn_micro_batches(
    lengths: LengthHistogram, batching: str, micro_batch: int, seq_len: int, vocab: int,
    count: int, seed: int, longest_at: int = 0,
) -> list[tuple[Inputs, int]]:  # fmt: skip
    """What a trial trains on with the data's `lengths`: `count` micro-batches of random tokens
    at lengths drawn from them (`autofit.data.batching.micro_batches`), each with its useful
    tokens. The one at index `longest_at` is the longest micro-batch the data can produce
    (`longest_micro_batch`), so the trial's peak is the one the data will reach."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layouts = micro_batches(lengths, batching, micro_batch, seq_len, count - 1, rng)
    layouts.insert(longest_at, longest_micro_batch(lengths, batching, micro_batch, seq_len))
    out = []
    for layout in layouts:
        rows = [
            [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in row]
            for row in layout.rows
        ]
        if batching == Batching.PACKED:
            inputs = packed_rows(rows, seq_len)
        else:
            inputs = padded_batch([docs[0] for docs in rows], seq_len)
        out.append((inputs, layout.useful_tokens))
    return out
