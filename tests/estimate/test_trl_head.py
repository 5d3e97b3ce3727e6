"""TRL's fused LM head (`launch: trl`), counted from its source (`autofit.estimate.memory.trl`),
against TRL 1.16's own `ChunkedLogProbFunction` run on CPU under autofit's tensor tracker: the
bytes its forward and its backward hold at their peaks on top of their inputs."""

from __future__ import annotations

import inspect

import pytest
import torch

from autofit.estimate.memory.trl import (
    TOKEN_CHUNK,
    VOCAB_CHUNK,
    collated_rows,
    fused_head_bytes,
)
from autofit.trials.memory import TensorTracker

pytest.importorskip("trl")
pytestmark = pytest.mark.timeout(120)

BYTES = {torch.bfloat16: 2, torch.float32: 4}


def _measured(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, trains: bool):
    """(forward, backward) peak bytes of TRL's function over `tokens` hidden states, as
    SFTTrainer calls it (bf16 autocast, log-probabilities, entropy and top-1 hits)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from autofit.builder.trl import TRL_OUTPUTS

    torch.manual_seed(0)
    tracker = TensorTracker()
    with tracker:
        h = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
        w = torch.randn(vocab, hidden, dtype=dtype, requires_grad=trains)
        targets = torch.randint(0, vocab, (tokens,))
        before = tracker.current
        tracker.reset_peak()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logprobs, *_ = ChunkedLogProbFunction.apply(
                h, w, None, targets, 1.0, VOCAB_CHUNK, None, 1.0, TRL_OUTPUTS
            )
        forward = tracker.peak - before
        loss = -logprobs.sum()
        before = tracker.current
        tracker.reset_peak()
        loss.backward()
        backward = tracker.peak - before
    return forward, backward


@pytest.mark.parametrize(
    ("tokens", "hidden", "vocab", "dtype", "trains"),
    [
        (126, 256, 1024, torch.bfloat16, False),  # LoRA: a frozen bf16 head
        (126, 256, 1024, torch.float32, True),  # a full fine-tune under bf16-mixed
        (40, 64, 3000, torch.bfloat16, True),  # pure bf16, a vocabulary off the tile's width
    ],
)
def test_trls_fused_head_holds_what_its_source_says(tokens, hidden, vocab, dtype, trains) -> None:  # type: ignore[no-untyped-def]
    forward, backward = _measured(tokens, hidden, vocab, dtype, trains)
    counted = fused_head_bytes(
        1, tokens + 1, hidden, vocab, BYTES[dtype], BYTES[dtype], trains, triton=False
    )
    assert counted.forward == forward
    # the backward's last few scalars and the loss's gradient: within 256 bytes
    assert 0 <= backward - counted.backward <= 256, (backward, counted.backward)


def test_the_head_reads_trls_own_constants_and_outputs() -> None:
    from trl.kernels import chunked_logprob
    from trl.trainer import sft_trainer, utils

    from autofit.builder.trl import TRL_OUTPUTS

    assert chunked_logprob.TOKEN_CHUNK_SIZE == TOKEN_CHUNK
    assert utils._CHUNKED_LOGPROB_CHUNK_SIZE == VOCAB_CHUNK
    asked = "outputs=(" + ", ".join(f'"{name}"' for name in TRL_OUTPUTS) + ")"
    assert asked in inspect.getsource(sft_trainer.SFTTrainer.__init__)


def test_packed_micro_batches_reach_the_model_as_one_row() -> None:
    # padding-free: SFTTrainer's collator flattens the micro-batch; unpacked rows stay rows
    assert collated_rows(4, 256, packed=True) == (1, 1024)
    assert collated_rows(4, 256, packed=False) == (4, 256)
    # on a GPU Triton folds the tiles in place: the CPU's fp32 temporaries are gone
    cpu = fused_head_bytes(4, 256, 4096, 32000, 2, 2, False, triton=False)
    gpu = fused_head_bytes(4, 256, 4096, 32000, 2, 2, False, triton=True)
    assert gpu.backward < cpu.backward and gpu.forward < cpu.forward
