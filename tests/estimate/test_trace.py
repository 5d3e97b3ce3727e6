"""The one-layer trace (`autofit.arch.activations_of`, run under FakeTensorMode) against the same
layer run with real tensors on CPU and counted by the trials' own `TensorTracker`
(`bench/accuracy.py --trace`, `measured_activations`): within 1% per family, checkpointing
policy and LoRA rank (they agree to the byte at the debug widths; `--trace --width real` checks
real widths). The layer's bytes are the two-layer model's minus the one-layer model's; the
root's are the rest of the peak over the loss (its forward and the start of its backward).
"""

from __future__ import annotations

import pytest

from autofit.arch import activations_of
from autofit.models import PRESETS
from autofit.structure import ActivationKey
from bench.accuracy import measured_activations

FAMILIES = ["llama-debug", "qwen2-debug", "gemma2-debug", "phi3-debug", "mixtral-debug"]
SEQ = 64


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
@pytest.mark.parametrize("rank", [0, 16])
@pytest.mark.parametrize("name", FAMILIES)
def test_trace_matches_the_layer_run_with_real_tensors(name: str, rank: int, policy: str) -> None:
    spec = PRESETS[name]
    key = ActivationKey(SEQ, rank, None, 0.0, policy)
    traced, real = activations_of(spec, key), measured_activations(spec, key)
    assert traced.layer == pytest.approx(real.layer, rel=0.01), (traced, real)
    assert traced.root == pytest.approx(real.root, rel=0.01), (traced, real)
    assert traced.root_forward == pytest.approx(real.root_forward, rel=0.01), (traced, real)


@pytest.mark.parametrize("name", ["llama-debug", "gemma2-debug"])
@pytest.mark.parametrize("rank", [0, 16])
def test_trace_of_the_chunked_loss_matches_real_tensors(name: str, rank: int) -> None:
    """`loss: chunked` (Gemma 2: soft-capped logits; rank 0: the head's weight gradient too):
    the layer is the standard loss's, and what lives outside the layers matches real tensors,
    at the peak of forward (where the chunked loss does all its work) and through backward."""
    spec = PRESETS[name]
    key = ActivationKey(SEQ, rank, None, 0.0, "none", loss="chunked")
    traced, real = activations_of(spec, key), measured_activations(spec, key)
    standard = activations_of(spec, ActivationKey(SEQ, rank, None, 0.0, "none"))
    assert traced.layer == standard.layer
    assert traced.root == pytest.approx(real.root, rel=0.01), (traced, real)
    assert traced.root_forward == pytest.approx(real.root_forward, rel=0.01), (traced, real)
    if rank:  # the whole vocabulary's logits are never live
        assert traced.root < standard.root / 2
    # a full fine-tune sums the head's gradient in fp32 from forward on (4 B x vocab x hidden),
    # more than 64 tokens' logits at the debug width: chunking pays from ~hidden/3 tokens on


@pytest.mark.parametrize("name", ["llama-debug", "gemma2-debug"])
def test_trace_under_autocast_leaves_out_only_the_weight_copies(name: str) -> None:
    """The plain module under bf16-mixed: fp32 weights, whose bf16 copies autocast keeps (counted
    by the estimator from the weights) are all the trace leaves out."""
    spec = PRESETS[name]
    for rank in (0, 16):
        key = ActivationKey(SEQ, rank, ("q_proj", "v_proj"), 0.1, "none", autocast=True)
        traced, real = activations_of(spec, key), measured_activations(spec, key)
        assert traced.layer == pytest.approx(real.layer, rel=0.01), (key, traced, real)
        assert traced.root == pytest.approx(real.root, rel=0.01), (key, traced, real)
