"""This machine's stored calibration: kept per machine, whole, and only for this napkin."""

from __future__ import annotations

import json

import pytest

from autofit.calibration import MEMORY_TERMS, SPEED_TERMS, Observation
from autofit.calibration import store as cal_store
from autofit.hardware import resolve_hardware

MiB = 1024**2
ACT = MEMORY_TERMS.index("activations")


def obs(activations_mib: float, measured_mib: float) -> Observation:
    terms = [0.0] * len(MEMORY_TERMS)
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
