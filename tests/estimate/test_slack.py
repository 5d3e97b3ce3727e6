"""The allocator's slack is read from a replay of a step composed from the one-layer model's
traced births and deaths (`autofit.estimate.slack`). Held here against the outside truth the
composition stands for: the same architecture with two layers, traced whole (its own births and
deaths, no composition), replayed through the same allocator model. The composition's rules
(a layer's output dies where the next layer's input does, the gradient a layer hands on dies in
the layer below) must give the peaks the real two-layer step gives.
Measured 2026-11-26 (torch 2.13.0+cpu, transformers 5): reserved equal or one 2 MiB small-pool
page apart, allocated equal or 1-2% low where checkpointed LoRA layers recompute (the one-layer
trace's recomputation does not see the next layer's input gradient)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autofit.arch import step_events_of
from autofit.builder.trace import traced_step
from autofit.estimate.allocator import replay
from autofit.estimate.slack import StepShape, step_events
from autofit.models import PRESETS
from autofit.structure import ActivationKey


def _numbered(events: list[tuple[object, int]]) -> list[tuple[int, int]]:
    keys: dict[object, int] = {}
    out = []
    for n, (key, size) in enumerate(events):
        if size:
            keys[key] = n
        out.append((keys[key], size))
    return out


@pytest.mark.parametrize(
    ("name", "rank", "policy"),
    [("llama-debug", 0, "none"), ("llama-debug", 16, "full"), ("llama-mini", 0, "full"),
     ("llama-mini", 16, "none"), ("llama-mini", 16, "selective")],
)  # fmt: skip
def test_composed_step_replays_like_the_two_layer_model(name: str, rank: int, policy: str) -> None:
    spec = PRESETS[name]
    key = ActivationKey(256, rank, None, 0.0, policy)
    one = step_events_of(spec, key)
    two = traced_step(spec, key, (None, None))[1]
    composed = replay(
        _numbered(step_events([one, one], StepShape(2, 1, 0.0, 0.0, 0.0), steps=1)),
        expandable_segments=True,
    )
    whole = replay(list(two.log), expandable_segments=True)
    # one small-pool page (2 MiB) apart at most: the order of a few small deaths differs
    assert composed.peak_reserved == pytest.approx(whole.peak_reserved, abs=2 * 2**20)
    assert composed.peak_allocated == pytest.approx(whole.peak_allocated, rel=0.02)


def test_slack_grows_with_the_micro_batch_and_stays_a_small_share_with_expandable_segments():
    """llama-mini LoRA r16, the plain module: the replayed slack of micro-batch 8 is more bytes
    than that of micro-batch 1 (more and larger holes), and under expandable segments it stays
    under 20% of the allocated peak plus one 20 MiB page (the large pool's mapping unit)."""
    from autofit.estimate.slack import replay_slack

    spec = PRESETS["llama-mini"]
    ev = step_events_of(spec, ActivationKey(512, 16, None, 0.0, "none"))
    small = replay_slack([ev] * 4, StepShape(4, 1, 8e6, 8e6, 1e5))
    large = replay_slack([ev] * 4, StepShape(4, 8, 8e6, 8e6, 1e5))
    assert large.slack >= small.slack
    for r in (small, large):
        assert r.slack <= 0.2 * r.peak_allocated + 20 * 2**20


def _loss_births(spec_name: str, key: ActivationKey, micro_batch: int) -> list[int]:
    """The sizes of the allocations a composed step (one step of two layers) makes between the
    layers' forward and their backward: the head's and the loss's."""
    events = step_events_of(PRESETS[spec_name], key)
    step = step_events([events, events], StepShape(2, micro_batch, 0.0, 0.0, 0.0), steps=1)
    return [size for k, size in step if size and k[0] == ("root", 0) and k[1] == "mid"]


def test_the_replayed_loss_is_the_configs_own_a_chunk_of_logits_at_a_time():
    """The allocator replay composes the loss the config runs. Llama 3 8B (vocabulary 128,256,
    hidden 4,096), LoRA, micro-batch 2 x 2,048 = 4,096 tokens: the chunked loss runs 128 tokens
    a chunk (Liger's rule, `loss_chunk_tokens`: 4,096 / ceil(128,256 / 4,096) = 128), 32 chunks,
    and its allocations over the vocabulary are each chunk's: the head's bf16 output and the
    gradient cast back to bf16, 128 x 128,256 x 2 = 32,833,536 B twice, and the fp32 logits
    (which become their gradient in place), 65,667,072 B once. The standard loss's are the
    whole batch's: 4,096 x 128,256 x 2 = 1,050,673,152 B (bf16) and x 4 = 2,101,346,304 B
    (fp32). (Replayed with the standard loss's allocations, the chunked run of the H200 rows had
    1.23 GiB of slack against 0.30 measured: bench/gpu_rows.py.)"""
    from autofit.builder.loss import loss_chunk_tokens

    tokens, vocab = 2 * 2048, 128256
    chunk = loss_chunk_tokens(tokens, 4096, vocab)
    assert chunk == 128
    key = ActivationKey(2048, 16, None, 0.0, "full", True)
    chunked = _loss_births("llama-3-8b", replace(key, loss="chunked"), micro_batch=2)
    standard = _loss_births("llama-3-8b", key, micro_batch=2)

    def over_the_vocabulary(births: list[int]) -> list[int]:
        return [b for b in births if b % vocab == 0 and b >= chunk * vocab * 2]

    assert sorted(set(over_the_vocabulary(chunked))) == [32_833_536, 65_667_072]
    assert over_the_vocabulary(chunked).count(chunk * vocab * 2) == 2 * tokens // chunk
    assert over_the_vocabulary(chunked).count(chunk * vocab * 4) == tokens // chunk
    assert sorted(set(over_the_vocabulary(standard))) == [1_050_673_152, 2_101_346_304]


def test_the_chunked_loss_sums_a_trained_heads_gradient_once_per_micro_step():
    """A full fine-tune in bf16 under the chunked loss: the fp32 sum of the LM head's gradient
    (`autofit.builder.loss`, vocabulary x hidden = 1,024 x 256 x 4 B = 1,048,576 B for
    llama-debug) is allocated once per micro-step whatever its tokens, where the chunks' tensors
    scale with the micro-batch: at micro-batch 4 the replay holds one such sum, not four."""
    key = ActivationKey(128, 0, None, 0.0, "none", False, "chunked")
    one, four = (_loss_births("llama-debug", key, mb) for mb in (1, 4))
    assert one.count(1024 * 256 * 4) == four.count(1024 * 256 * 4) == 1
    assert 4 * 1024 * 256 * 4 not in four
    assert sum(four) > sum(one)
