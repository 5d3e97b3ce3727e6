"""Trials on the data's lengths (issue 26): a dataset of 64-token examples with one 1,024-token
outlier. Planned without the data (every sequence 64 tokens), llama-debug on 2 CPU ranks under a
72 MiB cap takes micro-batch 8; the outlier, padded with 7 others to 1,024 tokens, runs that
out of memory. Planned with the data, the winner fits the longest micro-batch, and its trial peaks
where the estimate says."""

from __future__ import annotations

from pathlib import Path

import pytest

from autofit.data import LengthHistogram
from autofit.estimate import MEMORY_ERROR, estimate
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.plan import plan_estimates
from autofit.request import PlanRequest
from autofit.space_file import load_space
from autofit.trials import run_trials
from autofit.units import MiB

pytestmark = pytest.mark.slow

LENGTHS = LengthHistogram.of([64] * 63 + [1024])
TINY = Path(__file__).resolve().parents[1] / "search" / "tiny_space.yaml"  # seq_len 64, mb 2-8
CAP = "72MiB"
SEQ_LEN = 1024  # the run's truncation length: the outlier is kept whole


def test_the_longest_batch_sets_the_peak_and_a_plan_without_data_ooms() -> None:
    spec = resolve_model("llama-debug")
    hw = resolve_hardware("2", device="cpu", gpu_memory=CAP)
    space = load_space(TINY)
    blind = plan_estimates(PlanRequest.of(spec, hw, space, seq_len=64, device="cpu",
                                          calibration="off"))  # fmt: skip
    informed = plan_estimates(PlanRequest.of(spec, hw, space, seq_len=SEQ_LEN, device="cpu",
                                             calibration="off", lengths=LENGTHS))  # fmt: skip
    assert blind.best is not None and informed.best is not None
    chosen, fits = blind.best.config.replace(seq_len=SEQ_LEN), informed.best.config
    assert (chosen.micro_batch, fits.micro_batch) == (8, 2)
    assert fits.batching == chosen.batching == "padded"
    # its padding: 2 draws, 64 unless one is the outlier (2 x 1/64 - 1/64²), useful 79 a row
    p_outlier = 1 - (63 / 64) ** 2
    width = 64 + 960 * p_outlier
    assert informed.best.estimate.padding_share == pytest.approx(1 - (64 + 960 / 64) / width)

    packed = fits.replace(batching="packed", micro_batch=1)
    results = run_trials(spec, [fits, packed, chosen], nprocs=2, device="cpu",
                         gpu_memory=hw.capacity_bytes, steps=2, timeout_s=240,
                         lengths=LENGTHS)  # fmt: skip
    ok, packed_run, blind_run = results
    assert ok.status == "ok", ok.message
    expected = informed.best.estimate.peak_bytes
    assert abs(ok.peak_bytes / expected - 1) <= MEMORY_ERROR, (ok.peak_bytes / MiB, expected / MiB)
    assert packed_run.status == "ok", packed_run.message
    packed_est = estimate(spec, hw, packed, device="cpu", lengths=LENGTHS)
    assert abs(packed_run.peak_bytes / packed_est.peak_bytes - 1) <= MEMORY_ERROR, (
        packed_run.peak_bytes / MiB, packed_est.peak_bytes / MiB,
    )  # fmt: skip
    # the blind plan's micro-batch meets the outlier in its first step and runs out of memory
    assert blind_run.status == "oom", blind_run.message
    assert blind_run.oom_of == "gpu"
