"""`bench/gpu_rows.py` (this commit's estimate against autofit's own GPU trials) held to the files
it reads: every trial row is there, and the numbers it prints as measured are the files' own,
read here from the JSON without the bench."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.benches import load_bench

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "bench" / "data" / "gpu-measurements"
GPU_CHECK = ROOT / "bench" / "data" / "gpu-check"
GIB = 2**30


gpu_rows = load_bench("gpu_rows")


def _trials_in_files() -> dict[str, list[dict[str, Any]]]:
    """Each file's trial rows as the JSON holds them, in order: the first run's whole list,
    gpu_check's `replay` section. The measured levels as (allocated, reserved, device) bytes and
    tokens/s."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(MEASUREMENTS.glob("autofit-h200-*.json")):
        out[path.name] = [
            {
                "status": r["status"],
                "levels": [r["measured"][k] for k in ("max_memory_allocated",
                                                       "max_memory_reserved", "device_level")],
                "tokens_per_s": r["measured"]["tokens_per_s"],
            }
            for r in json.loads(path.read_text())
        ]  # fmt: skip
    for path in sorted(GPU_CHECK.glob("*.json")):
        if path.name.endswith("-plan.json"):  # a plan document its `plan` section wrote
            continue
        rows = [
            r
            for r in json.loads(path.read_text())["rows"]
            if r["section"] == "replay" and "config" in r  # not the rows a budget skipped
        ]
        if rows:
            out[path.name] = [
                {
                    "status": r["status"],
                    "levels": [
                        r[k] * GIB if r.get(k) is not None else None
                        for k in ("allocated_gib", "peak_gib", "device_gib")
                    ],
                    "tokens_per_s": r.get("tokens_per_s"),
                }
                for r in rows
            ]
    return out


FILES = _trials_in_files()


@pytest.fixture(scope="module")
def printed() -> tuple[list[Any], list[str]]:
    rows = gpu_rows.estimate_rows(gpu_rows.load_rows())
    return rows, gpu_rows.report(rows).splitlines()


def test_every_trial_row_of_the_files_is_read(printed):
    rows, _ = printed
    # the first GPU run (11 trials) and gpu_check's replays of the same configs: 11, then on
    # 2026-11-28 6 before the section's budget ran out and all 11 again
    assert {name: len(trials) for name, trials in FILES.items()} == {
        "autofit-h200-2026-11-27.json": 11,
        "h200-2026-11-27-run1.json": 11,
        "h200-2026-11-28-run1.json": 6,
        "h200-2026-11-28-run2.json": 11,
    }
    for name, trials in FILES.items():
        mine = [r for r in rows if r.file == name]
        assert [r.status for r in mine] == [t["status"] for t in trials], name


def test_the_numbers_printed_as_measured_are_the_files(printed):
    rows, lines = printed
    seen = 0
    for name, trials in FILES.items():
        mine = [r for r in rows if r.file == name]
        for row, trial in zip(mine, trials, strict=True):
            at = [i for i, line in enumerate(lines) if line.startswith(f"{row.id} ")]
            if trial["status"] != "ok":
                # listed apart, with whether the estimate said it would not fit
                apart = next(i for i, t in enumerate(lines) if t.startswith("Out of memory"))
                assert len(at) == 1 and at[0] > apart
                said = lines[at[0] + 1]
                assert said.lstrip().startswith(trial["status"] + ";"), said
                if trial["status"] == "oom":  # both OOMs of the first run were foreseen
                    assert "estimate OOM" in said and ": as estimated" in said, said
                continue
            [i] = at
            cells = lines[i + 1].split()
            alloc, reserved, device = trial["levels"]
            assert cells[0::3][:3] == [f"{b / GIB:.2f}" for b in (alloc, reserved, device)]
            assert cells[9] == f"{trial['tokens_per_s']:,.0f}"
            seen += 1
    assert seen == 29  # 7 trials of the first run ran, 9 of each full replay, 4 of the cut one


def test_the_table_fits_80_columns(printed):
    _, lines = printed
    assert max(map(len, lines)) <= 80


def test_every_reserved_peak_without_offload_is_estimated_within_3_percent(printed):
    """The outside truth of the H200: `max_memory_reserved` of every trial that ran without
    offload, the chunked loss's on Llama 3's 128K vocabulary among them (+13.4% while the
    allocator replay ran the standard loss's allocations for it, issue 33), within 3% of this
    commit's estimate. (`offload: params` below.)"""
    rows, _ = printed
    held = [r for r in rows if gpu_rows.ran(r) and r.config["offload"] == "none"]
    assert len(held) == 25
    assert any(r.config["loss"] == "chunked" for r in held)
    for r in held:
        assert abs(r.errors["reserved"]) <= 0.03, (r.id, r.label, r.errors["reserved"])


def test_every_reserved_peak_under_param_offload_is_estimated_within_4_percent(printed):
    """`offload: params` on one H200 (FSDP2's `CPUOffloadPolicy` on a one-rank mesh): no
    all-gather, each parameter copied from the host on the compute stream, and each unit's
    gradients copied to the host at its reduce. While the allocator replay gathered into a
    buffer on a stream of its own and kept every sharded gradient on the GPU, the tinyllama-1.1b
    full fine-tune was estimated +21.5% and +23.5% above its measured reserved peak. The NF4 rows
    are still 2-4% under (NF4's dequantization transients are not replayed)."""
    rows, _ = printed
    held = [r for r in rows if gpu_rows.ran(r) and r.config["offload"] == "params"]
    assert len(held) == 4
    for r in held:
        assert abs(r.errors["reserved"]) <= 0.04, (r.id, r.label, r.errors["reserved"])
        if r.config["lora_rank"] == 0:
            assert abs(r.errors["reserved"]) <= 0.025, (r.id, r.label, r.errors["reserved"])


def test_no_device_level_is_under_estimated_by_more_than_3_percent(printed):
    """The level that decides whether a config fits the card (`mem_get_info`): the first run's
    trials held 1,325 MiB outside the allocator (a CUDA context and a one-rank NCCL group), which
    the estimate once put at 512 MiB (0.8 GiB under on every row, issue 33); the plain-module
    trials of 2026-11-28, with no process group, held 766.8 MiB."""
    rows, _ = printed
    ran = [r for r in rows if gpu_rows.ran(r)]
    errors = sorted(r.errors["device"] for r in ran)
    assert len(errors) == 29
    assert abs(errors[len(errors) // 2]) <= 0.03
    for r in ran:
        assert r.errors["device"] >= -0.03, (r.id, r.label, r.errors["device"])


def test_the_configs_run_several_times_are_the_files_own(printed):
    """The same config in several runs, as the files hold them: llama-7b NF4 r64 at micro-batch
    1 measured 2,853 (the first run), 3,748, 3,325 and 2,852 tokens/s, a 31% spread, the bf16
    LoRA r64 twin 18%; the micro-batch 4 rows within 3%."""
    rows, lines = printed
    found = {c["label"]: c for c in gpu_rows.same_configs(rows)}
    nf4 = found["llama-7b nf4 r64 mb1x1 wrap=none ckpt=full"]
    assert nf4["ids"] == ["a0", "b0", "d0", "e0"]
    tokens = [FILES[n][0]["tokens_per_s"] for n in sorted(FILES)]
    assert nf4["tokens_per_s"] == tokens
    assert [round(t) for t in tokens] == [2853, 3748, 3325, 2852]
    assert nf4["spread"] == pytest.approx(3748.0 / 2852.3 - 1, abs=1e-3)
    assert found["llama-7b lora r64 mb1x1 wrap=none ckpt=full"]["spread"] > 0.15
    assert found["llama-7b nf4 r64 mb4x1 wrap=none ckpt=full"]["spread"] < 0.03
    assert len(found) == 9
    assert "Tokens/s of the configs measured in several runs" in lines


def test_each_config_runs_tokens_per_s_median_is_estimated_within_15_percent(printed):
    """A run's tokens/s at micro-batch 1 moves by up to 31% from one run of a config to the next
    (the host issuing kernels: issue 33), more than any one estimate can follow; against the
    median of a config's runs every estimate is within 15%."""
    rows, _ = printed
    for c in gpu_rows.same_configs(rows):
        assert abs(c["error"]) <= 0.15, (c["label"], c["error"])


def _fitted_context(path: Path, kept: str) -> tuple[float, Any, Any]:
    """A calibration of the `ok` trials of one file: its context, and the first trial's
    estimate and calibration."""
    from autofit.calibration import Observation, fit_calibration
    from autofit.config import Config
    from autofit.estimate import estimate
    from autofit.hardware import resolve_hardware
    from autofit.models import resolve_model
    from autofit.trials import TrialResult

    hardware = resolve_hardware(gpu_rows.GPUS, gpu_memory=gpu_rows.gpu_check.CAP)
    obs, ests = [], []
    for row in gpu_rows.load_rows([path]):
        if row.status != "ok" or row.config["offload"] != "none":
            continue
        m = row.measured
        est = estimate(resolve_model(row.model), hardware, Config.from_dict(row.config))
        result = TrialResult(
            status="ok", config=row.config, model=row.model, peak_bytes=m["reserved"],
            device_peak_bytes=m["device"], peak_allocated_bytes=m["allocated"],
            tokens_per_s=m["tokens_per_s"], process_group=row.process_group,
        )  # fmt: skip
        obs.append(Observation.of(est, result))
        ests.append(est)
    assert len(obs) == 7, kept
    cal = fit_calibration(obs)
    return cal.context_bytes, cal, ests[0]


def test_the_h200_trials_measure_one_cuda_context_with_and_without_a_process_group() -> None:
    """Calibration reads the context off each GPU trial (device level - reserved peak - NCCL's
    bytes). The same seven plain-module configs held 1,324.8-1,326.8 MiB outside the allocator in
    a one-rank NCCL group (the first run's trials all joined one) and 766.8 MiB with none
    (2026-11-28): the context both calibrations read is the one measured without NCCL, to 2 MiB,
    so a communicator is its 512 MiB buffer (NVIDIA/nccl#2363) and 46-48 MiB of its own. A
    calibrated estimate's usable bytes are the cap less that context."""
    with_group, _, _ = _fitted_context(next(MEASUREMENTS.glob("autofit-h200-*.json")), "group")
    alone, cal, est = _fitted_context(GPU_CHECK / "h200-2026-11-28-run2.json", "no group")
    assert alone == 766.8125 * 2**20  # the device level less the reserved peak, no NCCL
    assert abs(with_group - alone) <= 2 * 2**20
    calibrated = cal.apply(est)
    assert calibrated.overhead["nccl"] == 0  # the plain module's job: no communicator
    assert calibrated.usable_bytes == 24 * GIB - int(cal.context_bytes)
