"""A trial's budget held to what GPU trials took: autofit's own H200 trials of 2026-11-27
(`bench/data/gpu-check/h200-2026-11-27-run1.json`, each config's wall time in its launch) and
the first GPU run's int8 trial, which the issue reported (10 s build, 36 s warm-up, then about
26 s a measured step against 0.61 s estimated, until its 600 s limit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autofit.config import Config
from autofit.estimate import estimate
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.trials.budget import START_S, trial_limit, trial_time

RUN = Path(__file__).resolve().parents[2] / "bench/data/gpu-check/h200-2026-11-27-run1.json"


def replayed() -> list[dict]:
    rows = json.loads(RUN.read_text())["rows"]
    return [r for r in rows if r["section"] == "replay" and r["status"] == "ok"]


@pytest.mark.parametrize("row", replayed(), ids=lambda r: r["name"])
def test_no_trial_of_the_h200_run_would_have_been_stopped(row: dict) -> None:
    # each ran 1 warm-up and 3 measured steps; its own step time (measured) is far below the
    # slow mark its estimate gives, and its whole time (a launch's first config paid the start)
    # below its limit
    cfg = Config.from_dict(row["config"])
    timing = trial_time(resolve_model(row["model"]), cfg, row["est_step_time_s"], 3)
    assert row["step_time_s"] < timing.slow_after_s
    assert row["wall_s"] < trial_limit(timing, None)
    # and the expected time is the right size: within 3x of what the config took (the start,
    # paid once per launch, counted for the first config of each model only)
    first = row["name"] in {"llama-7b nf4 r64 mb1x1 wrap=none ckpt=full",
                            "tinyllama-1.1b full mb4x1 wrap=none ckpt=full",
                            "llama-3-8b nf4 r16 mb2x1 wrap=none ckpt=full"}  # fmt: skip
    expected = timing.expected_s - (0 if first else START_S["cuda"])
    assert expected / 3 < row["wall_s"] < 3 * expected, (expected, row["wall_s"])


def test_the_crawling_int8_trial_is_stopped_at_its_first_measured_step() -> None:
    cfg = Config(quant="int8", lora_rank=16, micro_batch=4, checkpointing="selective",
                 loss="chunked", compile=True, wrap="none")  # fmt: skip
    est = estimate(resolve_model("llama-7b"), resolve_hardware("1xh200"), cfg)
    # the issue quoted 0.61 s; with the host's ops as a term of their own (issue 33) 0.64 s
    assert est.step_time_s == pytest.approx(0.61, rel=0.1)
    timing = trial_time(resolve_model("llama-7b"), cfg, est.step_time_s, 3)
    assert timing.slow_after_s < 26.0  # its first measured step ends it as slow ...
    first_measured_step_done = 10 + 36 + 26  # s: build, warm-up with compile, one step
    assert first_measured_step_done < trial_limit(timing, None) < 600  # ... before any limit
    assert trial_limit(timing, 900.0) == 900.0  # --trial-timeout given: that, as asked


def test_a_capped_trials_cap_counts_the_machines_measured_context():
    """The bytes a capped GPU trial leaves outside its cap (`launcher._outside_bytes`): the CUDA
    context this machine's calibration measured where it has one (700 MiB here), else the
    estimate's default (767 MiB, the H200's), and a one-GPU FSDP2 config's communicator (NCCL
    2.28's 512 MiB one-rank buffer and its own 48 MiB); the search passes the measured context
    to every trial it runs (`budget.measured_context`)."""
    from autofit.config import Config
    from autofit.hardware import resolve_hardware
    from autofit.trials import launcher
    from autofit.trials.budget import measured_context

    mib = 2**20
    measured = resolve_hardware("1xh200").with_context(700 * mib)
    assert measured_context(measured) == {"context_bytes": 700 * mib}
    assert measured_context(resolve_hardware("1xh200")) == {}
    plain, fsdp = Config(lora_rank=16, wrap="none"), Config(lora_rank=16, wrap="layer")
    assert launcher._outside_bytes("cuda", 1, [plain], 700 * mib) == 700 * mib
    assert launcher._outside_bytes("cuda", 1, [plain]) == 767 * mib
    assert launcher._outside_bytes("cuda", 1, [plain, fsdp], 700 * mib) == (700 + 512 + 48) * mib
    assert launcher._outside_bytes("cpu", 1, [fsdp], 700 * mib) == 0
