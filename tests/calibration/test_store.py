"""This machine's stored calibration: kept per machine, whole, and only for this napkin."""

from __future__ import annotations

import json
import sys

import pytest

from autofit.calibration import MEMORY_TERMS, PEAK_TERMS, SPEED_TERMS, Observation
from autofit.calibration import store as cal_store
from autofit.estimate import estimate
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model

MiB = 1024**2
ACT = MEMORY_TERMS.index("activations")


def obs(activations_mib: float, measured_mib: float) -> Observation:
    terms = [0.0] * len(PEAK_TERMS)
    terms[ACT] = activations_mib * MiB
    return Observation(tuple(terms), (0.0,) * len(SPEED_TERMS), 1, measured_mib * MiB)


def test_saved_calibration_is_found_again_for_the_same_machine_only(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CALIBRATION_DIR", str(tmp_path))
    two = resolve_hardware("2", device="cpu", gpu_memory=64 * MiB)
    assert cal_store.load(two, "cpu") is None
    path, stored = cal_store.save(two, "cpu", [("s#0", obs(10, 5)), ("s#1", obs(20, 10))])
    assert path.parent == tmp_path and stored.source == "stored" and stored.n_trials == 2
    found = cal_store.load(two, "cpu")
    assert found is not None and found.source == "stored"
    assert found.memory["activations"] == pytest.approx(0.5, abs=0.03)
    # the memory cap is not the machine: the same two processes under another cap share it
    assert cal_store.load(resolve_hardware("2", device="cpu", gpu_memory=32 * MiB), "cpu")
    # another count of GPUs is another machine
    assert cal_store.load(resolve_hardware("1", device="cpu", gpu_memory=64 * MiB), "cpu") is None
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_the_same_trial_saved_twice_is_kept_once_and_others_add_up(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CALIBRATION_DIR", str(tmp_path))
    hw = resolve_hardware("2", device="cpu", gpu_memory=64 * MiB)
    cal_store.save(hw, "cpu", [("s#0", obs(10, 5))])
    cal_store.save(hw, "cpu", [("s#0", obs(10, 5)), ("t#0", obs(30, 15))])
    path, stored = cal_store.save(hw, "cpu", [])
    data = json.loads(path.read_text())
    assert [o["id"] for o in data["observations"]] == ["s#0", "t#0"]
    assert stored.n_trials == 2
    assert data["machine"]["device"] == "cpu" and "torch" in data["machine"]


def test_a_record_of_another_napkin_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CALIBRATION_DIR", str(tmp_path))
    hw = resolve_hardware("2", device="cpu", gpu_memory=64 * MiB)
    path, _ = cal_store.save(hw, "cpu", [("s#0", obs(10, 5))])
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "napkin": "another-version"}))
    assert cal_store.load(hw, "cpu") is None
    # its observations are not mixed into the next record either: their terms are stale
    _, stored = cal_store.save(hw, "cpu", [("t#0", obs(20, 20))])
    assert stored.n_trials == 1
    path.write_text("{not json")  # a damaged file is no calibration, not an error
    assert cal_store.load(hw, "cpu") is None


@pytest.mark.parametrize(
    "damage",
    [
        {"calibration": {"memory": "not a mapping"}},  # valid JSON, not a calibration
        {"observations": [{"id": "s#0", "memory": [1.0], "time": "x"}]},
        {"napkin": None},
    ],
    ids=["factors", "observation", "napkin"],
)
def test_a_record_of_the_wrong_shape_is_no_calibration_and_the_next_save_replaces_it(
    tmp_path, monkeypatch, damage
):
    monkeypatch.setenv("AUTOFIT_CALIBRATION_DIR", str(tmp_path))
    hw = resolve_hardware("2", device="cpu", gpu_memory=64 * MiB)
    path, _ = cal_store.save(hw, "cpu", [("s#0", obs(10, 5))])
    path.write_text(json.dumps({**json.loads(path.read_text()), **damage}))
    assert cal_store.load(hw, "cpu") is None  # read whole or not at all
    _, stored = cal_store.save(hw, "cpu", [("t#0", obs(20, 10))])
    assert stored.n_trials == 1 and cal_store.load(hw, "cpu") == stored


def test_a_fitted_calibration_reads_back_as_it_was_written(tmp_path, monkeypatch):
    from autofit.calibration import calibration_from_dict, calibration_to_dict

    monkeypatch.setenv("AUTOFIT_CALIBRATION_DIR", str(tmp_path))
    hw = resolve_hardware("2", device="cpu", gpu_memory=64 * MiB)
    _, stored = cal_store.save(hw, "cpu", [("s#0", obs(10, 5)), ("s#1", obs(20, 10))])
    data = json.loads(json.dumps(calibration_to_dict(stored)))
    assert data["memory_constant_bytes"] == int(round(stored.memory_constant))
    assert calibration_from_dict(data) == stored  # factors are kept to 4 places


def test_a_calibration_sweep_is_stored_and_the_next_plan_here_starts_from_it():
    from autofit.calibration.sweep import calibrate, sweep
    from autofit.plan import plan_estimates
    from autofit.request import PlanRequest
    from autofit.space_file import load_space
    from tests.search.conftest import TINY_SPACE, FakeTrials

    # The machine's truth, as the fake measures it: peaks 0.9x the napkin's, half its speed.
    fake = FakeTrials(peak_factor=lambda cfg: 0.9, speed_factor=lambda cfg: 0.5)
    hw = resolve_hardware("2", device="cpu", gpu_memory=256 * MiB)
    started: list[int] = []
    run = calibrate(hw, "cpu", gpu_memory=256 * MiB, steps=2, run_trials=fake.batch,
                    on_start=lambda i, n, model, cfg: started.append(i))  # fmt: skip
    assert len(run.trials) == len(sweep(hw, "cpu")) >= 10
    assert started == list(range(len(run.trials)))  # each announced once, in order
    assert [t.config for t in run.trials] == [c for _, c in sweep(hw, "cpu")]
    knobs = {(c.wrap, c.checkpointing, c.offload, c.quant) for _, c in sweep(hw, "cpu")}
    assert ("none", "none", "none", "none") in knobs  # DDP: communication
    assert ("layer", "none", "params", "none") in knobs  # host copies
    assert ("layer", "none", "none", "nf4") in knobs  # dequantisation
    assert run.path and cal_store.load(hw, "cpu") is not None

    request = PlanRequest.of(resolve_model("llama-debug"), hw, load_space(TINY_SPACE), seq_len=64,
                             device="cpu")  # fmt: skip
    plan = plan_estimates(request)
    assert plan.calibration["source"] == "stored"
    best = plan.best
    napkin = estimate(resolve_model("llama-debug"), hw, best.config, device="cpu")
    assert best.estimate.peak_bytes == pytest.approx(0.9 * napkin.peak_bytes, rel=0.03)
    assert best.estimate.tokens_per_s == pytest.approx(0.5 * napkin.tokens_per_s, rel=0.05)
    off = plan_estimates(PlanRequest.of(resolve_model("llama-debug"), hw, load_space(TINY_SPACE),
                                        seq_len=64, device="cpu", calibration="off"))  # fmt: skip
    assert off.calibration is None
    assert (
        off.best.estimate.peak_bytes
        == estimate(resolve_model("llama-debug"), hw, off.best.config, device="cpu").peak_bytes
    )


def test_a_gpu_machine_is_also_its_nccl_and_driver(fake_nvml, monkeypatch):
    """What lies outside the allocator (the CUDA context a calibration measures, NCCL's buffers)
    changes with the driver and the NCCL wheel: on GPUs both name the machine, as NVML reports the
    driver; on CPU neither does (its stored calibrations keep their key)."""
    h200 = resolve_hardware("1xh200")
    key = cal_store.machine_key(h200, "cuda")
    assert key["driver"] == "580.159.04" and "nccl" in key
    assert "driver" not in cal_store.machine_key(resolve_hardware("2", device="cpu"), "cpu")
    fake_nvml.driver = "590.10"
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.module())
    assert cal_store.machine_key(h200, "cuda")["driver"] == "590.10"
