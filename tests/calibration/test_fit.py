"""The calibration fit against hand-made truths: measurements built from factors written here, so a
test fails when the fit does not find what the measurements say (not when a formula changes)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autofit.calibration import (
    MEMORY_TERMS,
    MIN_BAND,
    NAPKIN,
    PEAK_TERMS,
    SPEED_TERMS,
    Calibration,
    Observation,
    fit_calibration,
)
from autofit.calibration.records import ObservationRecord
from autofit.config import Config
from autofit.estimate import estimate
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model

MiB = 1024**2
ACT = MEMORY_TERMS.index("activations")
BASE = MEMORY_TERMS.index("base_weights")
COMPUTE = SPEED_TERMS.index("compute")
OPTIMIZER = SPEED_TERMS.index("optimizer")


def mem_obs(activations_mib: float, base_mib: float, measured_mib: float, oom: bool = False):
    terms = [0.0] * len(PEAK_TERMS)
    terms[ACT], terms[BASE] = activations_mib * MiB, base_mib * MiB
    return Observation(tuple(terms), (0.0,) * len(SPEED_TERMS), 1, measured_mib * MiB, oom, None)


def speed_obs(compute_s: float, other_s: float, measured_s: float, micro_steps: int = 1):
    times = [0.0] * len(SPEED_TERMS)
    times[COMPUTE], times[OPTIMIZER] = compute_s, other_s
    return Observation((0.0,) * len(PEAK_TERMS), tuple(times), micro_steps, None, False,
                       measured_s)  # fmt: skip


def predict_mem(cal: Calibration, activations_mib: float, base_mib: float) -> float:
    return (cal.memory["activations"] * activations_mib + cal.memory["base_weights"] * base_mib
            + cal.memory_constant / MiB)  # fmt: skip


def test_two_trials_find_the_term_that_is_off():
    # The truth, by hand: activations really take 0.7x what the napkin says, weights are right.
    # Trial A: 10 MiB of activations + 5 of weights -> 7 + 5 = 12 MiB; trial B: 20 + 5 -> 19.
    cal = fit_calibration([mem_obs(10, 5, 12), mem_obs(20, 5, 19)])
    assert cal.source == "study"
    # An untried config with 40 MiB of activations: 28 + 5 = 33 MiB (the napkin says 45).
    assert predict_mem(cal, 40, 5) == pytest.approx(33, rel=0.03)
    assert cal.memory["activations"] == pytest.approx(0.7, abs=0.05)


def test_twenty_trials_pin_the_factors_down():
    # truth: activations 0.8x, weights 1.1x, plus 2 MiB the napkin does not know of; 20 trials
    obs = [mem_obs(a, b, 0.8 * a + 1.1 * b + 2) for a in (4, 9, 15, 22, 30) for b in (3, 6, 12, 20)]
    cal = fit_calibration(obs)
    assert cal.memory["activations"] == pytest.approx(0.8, abs=0.02)
    assert cal.memory["base_weights"] == pytest.approx(1.1, abs=0.03)
    assert cal.memory_constant / MiB == pytest.approx(2, abs=0.5)
    assert cal.memory_band <= 0.02  # it explains its trials: the band it prunes with is small


def test_an_oom_is_a_lower_bound():
    # The napkin says 40 MiB; the trial ran out of a 50 MiB GPU. Two trials that fit show the
    # activations are 1.5x the napkin's: 10 + 10 -> 25, 20 + 10 -> 40 MiB. The OOM config
    # (20 + 20 of napkin activations + weights: 1.5 x 20 + 20 = 50) must come out at 50 or above.
    cal = fit_calibration([mem_obs(10, 10, 25), mem_obs(20, 10, 40), mem_obs(20, 20, 50, oom=True)])
    assert predict_mem(cal, 20, 20) >= 50 * 0.98
    # An OOM alone only pushes up: a napkin already above the bound is left where it is.
    held = fit_calibration([mem_obs(30, 30, 50, oom=True)])
    assert held.memory["activations"] == pytest.approx(1.0, abs=1e-6)


def test_one_strange_trial_does_not_drag_the_fit():
    # Six trials say the napkin is right; one says 2x (a run that went wrong). Robust: the
    # others stay predicted within 2%.
    good = [mem_obs(a, 8, a + 8) for a in (4, 8, 12, 16, 20, 24)]
    cal = fit_calibration([*good, mem_obs(14, 8, 44)])
    for a in (4, 12, 24, 40):
        assert predict_mem(cal, a, 8) == pytest.approx(a + 8, rel=0.02)


def test_speed_factors_and_the_cost_per_micro_step():
    # truth: compute runs at half the napkin's assumed efficiency (2x its time), the optimizer as
    # assumed, and every micro-step pays 10 ms the napkin does not know of
    def truth(c, o, ga):
        return 2 * c + o + 0.010 * ga

    obs = [speed_obs(c, o, truth(c, o, ga), ga) for c in (0.05, 0.2, 0.5) for o in (0.01, 0.1)
           for ga in (1, 4)]  # fmt: skip
    cal = fit_calibration(obs)
    assert cal.speed["compute"] == pytest.approx(2.0, rel=0.05)
    assert cal.speed_constant == pytest.approx(0.010, abs=0.003)
    assert cal.speed_band <= 0.05


def test_no_measurement_keeps_the_prior():
    assert fit_calibration([]) is NAPKIN
    stored = Calibration(memory={**NAPKIN.memory, "activations": 0.5}, source="stored")
    assert fit_calibration([], stored) is stored
    # a timeout measured nothing: not an observation
    empty = Observation((1.0,) * len(PEAK_TERMS), (1.0,) * len(SPEED_TERMS), 1)
    assert fit_calibration([empty]) is NAPKIN


def test_a_stored_prior_holds_what_the_study_cannot_tell():
    # This machine's store says activations are 0.5x. The study's one trial has no activations at
    # all (weights only, napkin right): the stored factor stays.
    stored = Calibration(memory={**NAPKIN.memory, "activations": 0.5}, source="stored")
    cal = fit_calibration([mem_obs(0, 10, 10)], stored)
    assert cal.memory["activations"] == pytest.approx(0.5, rel=1e-3)
    assert cal.memory["base_weights"] == pytest.approx(1.0, abs=0.02)


def test_band_is_the_leave_one_out_error_and_never_below_the_floor():
    exact = [mem_obs(a, 5, a + 5) for a in (2, 6, 10, 14)]
    assert fit_calibration(exact).memory_band == MIN_BAND
    # one trial: nothing left out to judge it by: the prior's band (the napkin's 10%)
    assert fit_calibration(exact[:1]).memory_band == NAPKIN.memory_band


def test_a_calibrated_estimate_is_a_whole_estimate():
    model = resolve_model("llama-debug")
    hw = resolve_hardware("2", device="cpu", gpu_memory=64 * MiB)
    est = estimate(model, hw, Config(micro_batch=4, seq_len=64), device="cpu")
    cal = Calibration(
        memory={**NAPKIN.memory, "activations": 0.5},
        speed={**NAPKIN.speed, "compute": 2.0},
        source="study",
    )
    out = cal.apply(est)
    acts = est.breakdown["activations"]
    assert out.peak_bytes == pytest.approx(est.peak_bytes - acts / 2, abs=2)
    assert out.peak_allocated_bytes == pytest.approx(sum(out.breakdown.values()), abs=8)
    compute = est.time_breakdown["compute"]
    assert out.step_time_s == pytest.approx(est.step_time_s + compute)
    assert math.isclose(out.tokens_per_s * out.step_time_s, est.tokens_per_s * est.step_time_s)
    assert NAPKIN.apply(est) is est


def test_observation_of_a_trial():
    from autofit.trials.result import TrialResult

    model = resolve_model("llama-debug")
    hw = resolve_hardware("2", device="cpu", gpu_memory=64 * MiB)
    cfg = Config(micro_batch=4, grad_accum=2, seq_len=64)
    est = estimate(model, hw, cfg, device="cpu")
    ok = TrialResult("ok", cfg.to_dict(), "llama-debug", "cpu", 2, peak_bytes=30 * MiB,
                     tokens_per_s=1024.0)  # fmt: skip
    obs = Observation.of(est, ok)
    assert obs.peak_bytes == 30 * MiB and not obs.oom
    assert obs.step_time_s == pytest.approx(4 * 2 * 2 * 64 / 1024.0)  # tokens of a step / rate
    oom = Observation.of(est, TrialResult("oom", cfg.to_dict(), "llama-debug", "cpu", 2))
    assert oom.oom and oom.peak_bytes == est.usable_bytes and oom.step_time_s is None
    host = TrialResult("oom", cfg.to_dict(), "llama-debug", "cpu", 2, oom_of="host")
    assert not Observation.of(est, host).informative  # host RAM says nothing of GPU memory
    assert ObservationRecord.of(obs).observation() == obs  # as the store writes and reads it


def test_a_fitted_mode_share_never_makes_a_step_free():
    # a hand case: a napkin step of 1.0 s (all in the first time term) of a config in a mode whose
    # fitted share is -2.0 (a fit on a few trials): 1.0 - 2.0 x 1.0 = -1.0 s; the step is held at
    # a tenth of the napkin's, 0.1 s, not at 1e-9 s (5e11 tokens/s for 512 tokens)
    from autofit.calibration.model import MIN_STEP_SHARE
    from autofit.calibration.terms import SPEED_MODE_TERMS, TIME_FACTOR_TERMS

    mode = SPEED_MODE_TERMS[0]
    cal = Calibration(speed={**NAPKIN.speed, mode: -2.0}, source="study")
    row = np.zeros(len(SPEED_TERMS))
    row[0] = 1.0  # the napkin's first time term: the whole step
    row[len(TIME_FACTOR_TERMS)] = 1.0  # the mode is on: its term is the napkin's step
    steps = cal.step_times(np.array([row]), np.array([1.0]))
    assert MIN_STEP_SHARE == 0.1 and steps[0] == pytest.approx(0.1)
    row[len(TIME_FACTOR_TERMS)] = 0.0  # a config not in that mode keeps the napkin's 1.0 s
    assert cal.step_times(np.array([row]), np.array([1.0]))[0] == pytest.approx(1.0)


def test_a_slow_host_moves_the_host_term():
    # The host's exposed work is its own term (`host`), which calibration fits per machine: on
    # this machine's trials the host's excess over the device takes 1.5x the napkin's. Steps the
    # host bounds (micro-batch 1) are that much slower; those the device bounds are as estimated.
    from autofit.calibration.terms import memory_terms, time_terms

    h200 = resolve_hardware("1xh200")
    obs = []
    for quant in ("none", "int8", "nf4"):
        for mb, ckpt in ((1, "full"), (1, "every-2"), (8, "full")):
            config = Config(quant=quant, lora_rank=64, micro_batch=mb, checkpointing=ckpt,
                            wrap="none")  # fmt: skip
            est = estimate(resolve_model("llama-7b"), h200, config)
            measured = est.step_time_s + 0.5 * est.time_breakdown["host"]
            obs.append(Observation(memory_terms(est), time_terms(est), 1, None, False, measured))
    assert sum(o.time[SPEED_TERMS.index("host")] > 0 for o in obs) == 6
    cal = fit_calibration(obs)
    assert cal.speed["host"] == pytest.approx(1.5, rel=0.1)
    assert cal.speed["compute"] == pytest.approx(1.0, abs=0.05)
