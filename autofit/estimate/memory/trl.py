"""`launch: trl`: the buffers of TRL's fused LM head, which replaces the model's own loss, and the
rows its collator makes.

Read from TRL 1.16's source. SFTTrainer gives the model a fused LM head
(`trl.trainer.utils.add_fused_lm_head`, asked for log-probabilities, entropy and top-1 hits) and
takes its loss from the log-probabilities: the `(tokens, vocab)` logits never exist. The head
slices off each row's last position (`N` tokens score a next token) and hands
`ChunkedLogProbFunction` (`trl/kernels/chunked_logprob.py`) the hidden states as `(N, hidden)`:
a copy where the slice is not contiguous (more than one row; on a GPU with Triton the labelled
positions, `hidden_states[mask]`, always), which the function keeps for backward in place of the
final norm's output (no backward needs that), so the trace's one row, whose view keeps the
output, counts it already. The function projects tiles of at
most `TOKEN_CHUNK` tokens by `VOCAB_CHUNK` vocabulary entries into one bf16 buffer (`mm_buf`,
`min(N, TOKEN_CHUNK) x VOCAB_CHUNK` whatever the vocabulary: a 1,024-token vocabulary gets the
full 32,768 columns) and folds each tile into running per-token statistics (seven fp32 vectors);
its backward recomputes each tile into a second such buffer, turns it into the logits' gradient in
place and accumulates the hidden states' gradient (and a trained head's) in fp32 buffers of their
full size, returned in the inputs' dtypes. The folds are Triton kernels on CUDA, which allocate
nothing; elsewhere (a CPU trial) torch ops on the whole tile, whose fp32 temporaries are counted
here as the source makes them (`_forward_tile`: 13 bytes per tile entry at its peak, with the
entropy and the top-1 hits; `_backward_tile`: 29; the CPU's fp32 matmul of each tile, `_addmm_fp32`,
an fp32 copy of the tile and of the weight chunk or hidden chunk). Checked against TRL's own
function on CPU under autofit's tensor tracker (`tests/estimate/test_trl_head.py`: exact in
forward, within 160 bytes in backward).

Torch-free: the estimator's arithmetic.
"""

from __future__ import annotations

from typing import NamedTuple

from autofit.estimate.memory.widths import BF16, FP32

TOKEN_CHUNK = 4096
"""Tokens per tile (`trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE`)."""
VOCAB_CHUNK = 32768
"""Vocabulary entries per tile, and the tile buffer's width (`_CHUNKED_LOGPROB_CHUNK_SIZE` of
`trl.trainer.utils`, which SFTTrainer's head passes as `chunk_size`)."""
STATS = 7
"""fp32 per-token vectors the forward keeps while it folds the tiles (running max, sums of the
exponentials, of their products with the logits and squares, the logits' sum, the largest logit
before the target and the target's logit)."""
CPU_FOLD_FORWARD = 13
"""Bytes per tile entry `_forward_tile` holds at its peak (torch ops, no Triton): the fp32 logits,
the bool mask of the entries before the target, and `z - max` with its exponential."""
CPU_FOLD_BACKWARD = 29
"""Bytes per tile entry `_backward_tile` holds at its peak: the fp32 tile and logits, the
log-probabilities, probabilities and gradient, the bool target mask and two fp32 temporaries of
the gradient's expression."""
CPU_FOLD_PER_TOKEN = 20
"""Bytes per token of the tile `_forward_tile` adds beside the entries (the targets' offsets,
int64; the new running max, its rescale and the tile's max, fp32)."""


class FusedHead(NamedTuple):
    """The fused head's bytes on top of what lives outside the layers when it runs (per
    micro-batch): at its forward's peak and at its backward's."""

    forward: float
    backward: float


def collated_rows(micro_batch: int, seq_len: int, packed: bool) -> tuple[int, int]:
    """(rows, tokens per row) of a micro-batch as TRL's collator hands it to the model: `packed`
    (`packing`, whose best-fit-decreasing strategy SFTTrainer runs padding-free) flattens the
    micro-batch into one row of every token; otherwise rows of `seq_len`."""
    return (1, micro_batch * seq_len) if packed else (micro_batch, seq_len)


def fused_head_bytes(
    rows: int, width: int, hidden: int, vocab: int, hidden_bytes: int, weight_bytes: int,
    head_trains: bool, triton: bool,
) -> FusedHead:  # fmt: skip
    """TRL's fused LM head over `rows` rows of `width` tokens (`N = rows x (width - 1)` scored),
    hidden states of `hidden_bytes` per value, a head weight of `weight_bytes` that trains or not
    (`head_trains`: a full fine-tune's), tiles projected in bf16 (SFTTrainer's autocast), folded
    by Triton's kernels (`triton`: CUDA) or by torch ops (a CPU trial). The hidden states it is
    handed are the trace's (`autofit.structure.TRL_LOSS`), not counted here.

    Forward: the statistics, the tile buffer, a bf16 copy of a token chunk's hidden states when
    they are not bf16, and either a bf16 copy of the weight chunk (a weight not in bf16, during the
    tile's matmul) or the fold's temporaries after it. Backward: the fp32 gradients of the hidden
    states (and of a trained head), a tile buffer again, the chunks' bf16 copies, and the larger
    of the fold's temporaries and the fp32 matmuls' copies (CPU); then the gradients returned in
    the inputs' dtypes beside their fp32 buffers."""
    n_scored = rows * max(width - 1, 0)
    tile_rows = min(n_scored, TOKEN_CHUNK)
    tile_cols = min(vocab, VOCAB_CHUNK)
    tile = tile_rows * tile_cols  # entries of one tile
    buffer = tile_rows * VOCAB_CHUNK * BF16
    hidden_chunk = tile_rows * hidden * BF16 if hidden_bytes != BF16 else 0
    weight_chunk = tile_cols * hidden * BF16 if weight_bytes != BF16 else 0
    grad_hidden = FP32 * n_scored * hidden
    grad_weight = FP32 * vocab * hidden if head_trains else 0
    if triton:
        fold_forward = per_token = 0
        fold_backward = 0
    else:
        fold_forward = CPU_FOLD_FORWARD * tile
        per_token = CPU_FOLD_PER_TOKEN * tile_rows
        # `_addmm_fp32` on CPU: fp32 copies of the tile and of the weight chunk (the hidden
        # states' gradient) or of the hidden chunk (the head's)
        matmul_h = FP32 * (tile + tile_cols * hidden)
        matmul_w = FP32 * (tile + tile_rows * hidden) if head_trains else 0
        fold_backward = max(CPU_FOLD_BACKWARD * tile, matmul_h, matmul_w)
    forward = (
        STATS * FP32 * n_scored + per_token + buffer + hidden_chunk
        + max(fold_forward, weight_chunk)
    )  # fmt: skip
    looping = (
        FP32 * n_scored + grad_hidden + grad_weight + buffer + hidden_chunk + weight_chunk
        + fold_backward
    )  # fmt: skip
    returned = (
        grad_hidden + grad_weight
        + (n_scored * hidden * hidden_bytes if hidden_bytes != FP32 else 0)
        + (vocab * hidden * weight_bytes if head_trains and weight_bytes != FP32 else 0)
    )  # fmt: skip
    return FusedHead(float(forward), float(max(looping, returned)))
