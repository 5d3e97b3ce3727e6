"""Selective checkpointing's low-rank policy, held to the tensors a real forward keeps.

`autofit.builder.checkpoint` saves matmul outputs but recomputes LoRA's rank-r -> d expansion
(lora_B) unless d < 8r. llama-debug's k/v projections are d = 128 wide, so rank 16 sits on the
boundary (8 x 16 = 128: recomputed) and rank 17 just past it (136 > 128: saved); q/o (256),
gate/up (688) and down (256) stay recomputed at both ranks.
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autofit.arch import activations_of
from autofit.builder import apply
from autofit.builder.model import build_meta_model
from autofit.config import Config
from autofit.models import PRESETS
from autofit.structure import ActivationKey

# llama-debug (hidden 256, kv 2 x 64 = 128, intermediate 688), two of its four layers for speed.
SPEC = dataclasses.replace(PRESETS["llama-debug"], layers=2)
BATCH, SEQ = 2, 32
TOKENS = BATCH * SEQ


class MatmulOutputs(TorchDispatchMode):
    """Every `aten.mm` output of a forward: contraction width, output shape, a weak reference to
    its storage (alive after forward only if something kept it for backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, tuple[int, ...], weakref.ref, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default:
            st = out.untyped_storage()
            self.seen.append((args[0].shape[-1], tuple(out.shape), weakref.ref(st), st.nbytes()))
        return out

    def kept(self) -> list[tuple[int, tuple[int, ...], int]]:
        return [(k, shape, n) for k, shape, ref, n in self.seen if ref() is not None]


def kept_after_forward(rank: int) -> list[tuple[int, tuple[int, ...], int]]:
    torch.manual_seed(0)
    config = Config(
        lora_rank=rank, wrap="none", checkpointing="selective", precision="bf16", seq_len=SEQ
    )
    run = apply(build_meta_model(SPEC), config, device="cpu")
    ids = torch.randint(0, SPEC.vocab, (BATCH, SEQ))
    outputs = MatmulOutputs()
    with outputs:
        loss = run.model(input_ids=ids, labels=ids).loss
    assert loss.requires_grad  # `loss` holds the graph: what is alive is what backward needs
    return outputs.kept()


@pytest.mark.parametrize("rank, expansions_kept", [(16, 0), (17, 2 * SPEC.layers)])
def test_lora_b_expansion_is_saved_only_when_d_is_under_8r(rank, expansions_kept):
    kept = kept_after_forward(rank)
    lora_b = [(shape, n) for k, shape, n in kept if k == rank]  # contraction over r: lora_B
    lora_a = [(shape, n) for k, shape, n in kept if shape == (TOKENS, rank)]  # r-wide: lora_A

    # By hand: rank 17 keeps k_proj's and v_proj's lora_B output in each of the 2 layers, each
    # 64 tokens x 128 wide x 2 B (bf16) = 16,384 B; rank 16 keeps none of them.
    assert len(lora_b) == expansions_kept
    assert all(shape == (TOKENS, 128) and n == TOKENS * 128 * 2 for shape, n in lora_b)
    # lora_A's r-wide outputs are kept at every rank: 7 projections x 2 layers, 64 x r x 2 B.
    assert len(lora_a) == 7 * SPEC.layers
    assert all(n == TOKENS * rank * 2 for _, n in lora_a)

    # The estimator's LoRA part of a selective layer (its one-layer trace at this rank less the
    # trace without LoRA, bytes per token per layer) is what the forward kept: rank 16 ->
    # 14 x 16 = 224 B; rank 17 -> 14 x 17 + 2 x (128 x 2) = 750 B.
    measured = sum(n for _, n in lora_a + lora_b) / (TOKENS * SPEC.layers)
    assert measured == {16: 224, 17: 750}[rank]

    def traced(r: int) -> float:  # bytes per token one selective layer keeps, pure bf16
        return activations_of(SPEC, ActivationKey(SEQ, r, policy="selective")).layer / SEQ

    assert traced(rank) - traced(0) == measured
