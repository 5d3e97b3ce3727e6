"""The napkin held to published measurements from real GPUs (bench/data/gpu-measurements).

Each case is one row of `measurements.csv`, mapped onto `autofit.estimate` by `bench/published.py`
(its module docstring gives every mapping choice and the source line it comes from) and compared
with the row's own figure: fms-acceleration's peak `max_memory_allocated` on rank 0, Qwen's
README "G" (compared device-level, one G read as 1000 MiB: `published.QWEN_G`). The rows span
the paths: one GPU with the plain module (Qwen-7B LoRA), FSDP on one rank and on two GPUs
(Mistral-7B LoRA), FSDP QLoRA on two GPUs (Mistral-7B NF4), an MoE over two GPUs (Mixtral
LoRA), and the FSDP full fine-tune at its optimizer step.

Tolerances are the issue's goal, not a restated formula: no row under by more than 10%
(`TOL_UNDER`) and none over by more than 10% (`TOL_OVER`, the napkin's stated error,
`autofit.estimate.MEMORY_ERROR`). A case whose CURRENT error (in its comment, as of 2026-11-26) is
outside that band is `xfail(strict=True)`: when the estimator gets it inside, the XPASS fails the
suite and the mark is removed, which makes the case a guard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.benches import load_bench

TOL_UNDER = 0.10  # the goal: no row under by more than 10%
TOL_OVER = 0.10  # the napkin's stated error (autofit.estimate.MEMORY_ERROR)
GiB = 1024**3

published = load_bench("published")
ROWS = published.load_rows()


def _compare(row: int, strict: bool = True) -> tuple[Any, Any]:
    """(the row's own comparison, the estimate) of CSV data row `row`."""
    mapped = published.map_row(row, ROWS[row], strict=strict)
    assert isinstance(mapped, published.Mapped), mapped
    compared, _, est = published.compare_row(mapped)
    return compared[0], est


def _within_goal(measured: float, estimate: float) -> None:
    assert estimate >= measured * (1 - TOL_UNDER), (
        f"under-estimate: {estimate:.2f} GiB vs measured {measured:.2f} "
        f"({estimate / measured - 1:+.1%})"
    )
    assert estimate <= measured * (1 + TOL_OVER), (
        f"over-estimate: {estimate:.2f} GiB vs measured {measured:.2f} "
        f"({estimate / measured - 1:+.1%})"
    )


def _under(reason: str) -> Any:
    return pytest.mark.xfail(strict=True, reason=reason)


CASES = [
    # (row, what) -- current error in the comment / xfail reason
    pytest.param(
        24,
        "Qwen-7B LoRA r64 all-linear, 1 GPU plain module, seq 256, device-level: 20.1 G",
        # current error -2.1% (19.22 GiB vs 19.63), read as HF Trainer with fp32 adapters
        id="qwen7b-lora-plain-s256",
    ),
    pytest.param(
        55,
        "Qwen-14B LoRA r64, 1 GPU plain module, seq 4096, device-level: 42.5 G",
        # current error +0.8% (41.83 GiB vs 41.50): inside the goal
        id="qwen14b-lora-plain-s4096",
    ),
    pytest.param(
        185,
        "Mistral-7B LoRA r16 q/k/v/o, FSDP on 1 GPU, mb 4 x 4096: 24.87 GiB allocated",
        # current error -3.2% (24.08 GiB vs 24.87): inside the goal
        id="mistral-lora-fsdp1gpu-mb4",
    ),
    pytest.param(
        186,
        "Mistral-7B LoRA r16 q/k/v/o, FSDP on 2 GPUs, mb 2 x 4096: 14.11 GiB allocated",
        marks=_under("current error -13.7% (12.17 GiB vs 14.11): FSDP1 on 2 GPUs (named)"),
        id="mistral-lora-fsdp2gpu-mb2",
    ),
    pytest.param(
        198,
        "Mistral-7B QLoRA (bnb NF4 + double quant) r16, FSDP on 2 GPUs, mb 2: 8.78 GiB allocated",
        marks=_under("current error -15.3% (7.43 GiB vs 8.78): FSDP1 on 2 GPUs (named)"),
        id="mistral-qlora-fsdp2gpu-mb2",
    ),
    pytest.param(
        190,
        "Mixtral-8x7B LoRA r16 q/k/v/o (bf16 experts), FSDP on 2 GPUs, mb 2: 53.60 GiB allocated",
        # current error +1.9% (54.60 GiB vs 53.60): inside the goal
        id="mixtral-lora-fsdp2gpu-mb2",
    ),
]


@pytest.mark.parametrize(("row", "what"), CASES)
def test_estimate_within_the_goal_of_a_published_gpu_peak(row: int, what: str) -> None:
    c, _ = _compare(row)
    assert c.primary and c.metric in ("allocated", "device"), what
    _within_goal(c.measured_gib, c.estimate_gib)


FULL_FT = [
    pytest.param(
        173,
        "Mistral-7B full fine-tune, pure bf16, FSDP on 1 GPU, mb 4 x 4096: 67.46 GiB allocated",
        # current error +2.2% (68.92 GiB vs 67.46), foreach AdamW's temporary counted
        id="mistral-full-fsdp1gpu-mb4",
    ),
    pytest.param(
        174,
        "Mistral-7B full fine-tune, pure bf16, FSDP on 2 GPUs, mb 2 x 4096: 33.74 GiB allocated",
        # current error +4.3% (35.20 GiB vs 33.74), foreach AdamW's temporary counted
        id="mistral-full-fsdp2gpu-mb2",
    ),
]


@pytest.mark.parametrize(("row", "what"), FULL_FT)
def test_full_fine_tune_peaks_at_the_optimizer_step_of_a_published_run(row: int, what: str) -> None:
    # HF's adamw_torch is torch's foreach AdamW, whose step allocates
    # `torch._foreach_sqrt(exp_avg_sqs)`, one temporary the size of every local parameter (bf16
    # here), where autofit runs fused AdamW: the bench maps the rows with the launch's own
    # `optimizer_impl="foreach"`. The runs peak at that step: the figure does not move with the
    # micro-batch (rows 173/175: 67.46 GiB at mb 4 and 8; 174/176: 33.74 at mb 2 and 4), 10.0 B
    # per parameter per GPU. So the estimate must put the peak at the optimizer step, within the
    # goal of the measured peak.
    c, est = _compare(row)
    assert est.peak_phase == "optimizer", (what, est.peak_phase)
    _within_goal(c.measured_gib, c.estimate_gib)


def test_rows_listed_not_fitted_keep_their_reason() -> None:
    # Every row the yardstick does not compare is listed with a reason, none silently dropped;
    # the count of fixed-length rows it maps is pinned so a mapping change is seen here.
    mapped, listed = 0, {}
    for i, row in enumerate(ROWS):
        m = published.map_row(i, row)
        if isinstance(m, published.Mapped):
            mapped += 1
        else:
            assert m.reason and m.detail, (i, m)
            listed[m.reason] = listed.get(m.reason, 0) + 1
    assert mapped + sum(listed.values()) == len(ROWS) == 242
    # 18 Qwen LoRA + 18 Qwen LoRA (emb) (train_embeddings="full") + 13 fms
    assert mapped == 49, listed
    assert listed[published.FRAMEWORK] == 6


EMB_PAIRS = [
    # (LoRA row, LoRA (emb) row, what): Qwen's README at 256 tokens, same model and launch but
    # for the trainable embedding and head copies (peft modules_to_save)
    pytest.param(0, 6, "Qwen-1.8B: 6.7 -> 13.7 G", id="qwen1.8b"),
    pytest.param(24, 30, "Qwen-7B: 20.1 -> 33.7 G", id="qwen7b"),
    pytest.param(51, 57, "Qwen-14B: 34.6 -> 51.2 G", id="qwen14b"),
]


@pytest.mark.parametrize(("plain", "emb", "what"), EMB_PAIRS)
def test_trained_embeddings_cost_what_the_published_pairs_add(
    plain: int, emb: int, what: str
) -> None:
    # What training the embedding and head copies adds, read off the published pair: whatever
    # the plain rows' own gap is (docs/accuracy.md section 3), it is in both figures. The copies
    # (0.62, 1.25, 1.56 B parameters) cost their weight, gradient, two AdamW moments and, on
    # Qwen's torch 2.0, two foreach intermediates: 12 B each in bf16, where torch 2.1+'s one
    # intermediate would be 10 B. The pair tells the two steps apart: the estimate with Qwen's
    # step is nearer the published difference than with torch 2.1's (1000-MiB "G": -0.5%,
    # +3.7%, +7.1% against -20.8%, -15.3%, -11.2%), and within the napkin's stated error.
    measured, estimated = _emb_difference(plain, emb)
    _, one_step = _emb_difference(plain, emb, foreach_intermediates=1)
    error, one_error = estimated / measured - 1, one_step / measured - 1
    assert abs(error) < abs(one_error), (what, f"{error:+.1%}", f"{one_error:+.1%}")
    assert abs(error) <= TOL_OVER, (what, round(estimated, 2), round(measured, 2))


@pytest.mark.parametrize("row", [0, 24, 51, 6, 30, 57])
def test_qwens_adapters_are_the_fp32_ones_of_the_peft_of_its_day(row: int) -> None:
    # Qwen measured its table on 2023-10-07 and re-measured it on 2023-11-30 with an unpinned
    # peft. Every peft release of those days (<= 0.6.2, 2023-11-13) made a new LoRA layer's
    # adapters in fp32 (its `update_layer` ran before the layer had a weight to take a dtype
    # from); 0.7.0 (2023-12-06) first gave them the base weight's bf16. Each published row at
    # 256 tokens, with and without the embedding copies, lies nearer the fp32 reading (-8.1%,
    # -2.1%, -2.7%, -4.2%, +0.3%, +0.5%) than the bf16 one (-18.9%, -12.0%, -10.5%, -9.0%,
    # -5.7%, -4.8%), and the fp32 reading is within the goal.
    m = published.map_row(row, ROWS[row])
    assert m.knobs["precision"] == "bf16-mixed" and m.knobs["launch"] == "trainer"
    fp32 = published.compare_row(m)[0][0]
    bf16_knobs = {**m.knobs, "precision": "bf16"}
    bf16 = published.compare_row(dataclasses.replace(m, knobs=bf16_knobs))[0][0]
    assert abs(fp32.error) < abs(bf16.error), (row, f"{fp32.error:+.1%}", f"{bf16.error:+.1%}")
    _within_goal(fp32.measured_gib, fp32.estimate_gib)


def _emb_difference(plain: int, emb: int, **extra: Any) -> tuple[float, float]:
    """(measured, estimated) GiB of LoRA (emb) row `emb` minus LoRA row `plain`, with `extra`
    over each row's own estimate settings."""
    out = []
    for row in (plain, emb):
        m = published.map_row(row, ROWS[row])
        m = dataclasses.replace(m, extra={**m.extra, **extra})
        out.append(published.compare_row(m)[0][0])
    return (
        out[1].measured_gib - out[0].measured_gib,
        out[1].estimate_gib - out[0].estimate_gib,
    )


def test_qwen_g_is_read_as_the_largest_unit_the_card_allows() -> None:
    # Qwen's README prints "G" with no unit. Its 7B full-parameter run on two A100-SXM4-80GB
    # (81,920 MiB each) shows 162.0G at 1024 tokens, the longest that fit: 81.0 G per card. As
    # GiB that is more than the card holds, so the bench may not read "G" as GiB; as nvidia-smi's
    # MiB / 1000 it is 79.1 GiB (98.9% of the card), as SI GB 75.4 GiB.
    bound = published.qwen_g_bound(ROWS)
    assert 81.0 * bound == pytest.approx(80.0)
    assert published.QWEN_G_GIB["gib"] > bound
    fits = {k: v for k, v in published.QWEN_G_GIB.items() if v <= bound}
    assert published.QWEN_G == max(fits, key=fits.__getitem__) == "1000-mib"
    m = published.map_row(24, ROWS[24])
    assert m.measured_gib == pytest.approx(20.1 * 1000 / 1024)
