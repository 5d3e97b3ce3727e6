"""The estimate against real CPU trials: each case's error stays where docs/accuracy.md records it.

One trial per case, the cases of one model and rank count in one launch (`measure_all`);
`bench/mutate_memory_terms.py` runs the same cases once and applies the same check with each
memory term scaled by 0.7 and 1.3.
"""

from __future__ import annotations

import pytest

from autofit.trials import TrialResult

from .measured import CASES, Case, measure_all, problem

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def measured() -> dict[str, TrialResult]:
    return measure_all(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_estimate_is_within_the_recorded_error_of_a_real_trial(
    measured: dict[str, TrialResult], case: Case
) -> None:
    failure = problem(case, measured[case.name])
    assert failure is None, failure


# WIDE_VOCAB's trainable parameters, counted by hand: per decoder layer q and o 256 x 256, k and v
# 256 x 128 (2 KV heads of 64), gate, up and down 256 x 256, two norms of 256: 393,728; two
# layers, the embedding and the (untied) head 16,384 x 256 each, the final norm 256.
WIDE_VOCAB_TRAINABLE = 2 * (5 * 256 * 256 + 2 * 256 * 128 + 2 * 256) + 2 * 16_384 * 256 + 256
WIDE_VOCAB_LARGEST = 16_384 * 256  # the embedding (or the head)


def test_the_adamw_implementation_moves_the_measured_step_peak_by_the_hand_count(
    measured: dict[str, TrialResult],
) -> None:
    """torch 2.13's AdamW step (torch/optim/adam.py), fp32 masters on the plain module, read by
    hand: fused (`_fused_adamw_`, torch's CPU kernel) allocates nothing; foreach
    (`_multi_tensor_adam`) holds `exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)`, one tensor the
    size of every parameter, at once (4 B x 9,176,320 = 36,705,280 B); the for-loop
    (`_single_tensor_adam`, torch's choice on CPU: `optimizer_impl: auto` here) holds
    `exp_avg_sq.sqrt()` and its quotient, two the size of one parameter, the largest
    (2 x 4 B x 4,194,304 = 33,554,432 B). Measured on three configs that differ in nothing else,
    in one launch, the step's peak moves by that much."""
    assert WIDE_VOCAB_TRAINABLE == 9_176_320
    fused = measured["plain-full-wide-vocab-fused"].peak_bytes
    foreach = measured["plain-full-wide-vocab-foreach"].peak_bytes
    loop = measured["plain-full-wide-vocab"].peak_bytes
    assert foreach - fused == pytest.approx(WIDE_VOCAB_TRAINABLE * 4, rel=0.01)
    assert loop - fused == pytest.approx(2 * WIDE_VOCAB_LARGEST * 4, rel=0.01)
