"""A calibration never leaves an estimate worse than its prior was on the study's own trials
(issue 23): a correction that does not pay for itself is not applied.

The trials are real: the 8 of a CPU plan of llama-mini on 2 gloo processes (seq 64, 2 steps, a
space of LoRA / NF4 / full fine-tunes under each checkpointing), the case of issue 23: its plan
printed a median peak error of 0.1% for the napkin, 1.0% calibrated. Each is recorded as the
fit sees it: the napkin's terms at the time (non-zero ones, by name), the measured peak
(`max_memory_reserved`) and the step time of its measured tokens/s. Recorded terms, not today's
estimate: the test holds the fit, not the estimator's formulas. Errors are computed here by hand
from those numbers, in the plan's measure (estimated / measured - 1 of the peak and of tokens/s).
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from autofit.calibration import (
    MEMORY_ERROR,
    MEMORY_TERMS,
    NAPKIN,
    PEAK_TERMS,
    SPEED_TERMS,
    TIME_FACTOR_TERMS,
    Calibration,
    Observation,
    calibration_from_dict,
    calibration_to_dict,
    fit_calibration,
)

# label, measured peak (bytes), measured step (s: tokens of a step / measured tokens/s),
# the napkin's memory terms (bytes), the napkin's time terms (s)
LLAMA_MINI_CPU = [
    ("lora r16 mb8x1 wrap=none ckpt=selective", 189833448, 1.52575,
     {"base_weights": 67126272, "trainable_weights": 4980736, "gradients": 4980736,
      "optimizer_state": 9961472, "gathered_params": 2490368, "activations": 51380224,
      "logits_loss": 51517504, "activations|lora": 102897728,
      "activations|checkpointing=selective": 102897728, "activations|wrap=none": 102897728},
     {"compute": 0.474899, "memory_bound": 0.253306, "overhead": 0.00824,
      "communication": 0.0023282, "optimizer": 0.00498074, "step|lora": 0.743754,
      "step|checkpointing=selective": 0.743754, "step|wrap=none": 0.743754}),
    ("lora r16 mb8x1 wrap=none", 229005032, 1.57179,
     {"base_weights": 67126272, "trainable_weights": 4980736, "gradients": 4980736,
      "optimizer_state": 9961472, "gathered_params": 2490368, "activations": 89161728,
      "logits_loss": 50462784, "activations|lora": 139624512, "activations|wrap=none": 139624512},
     {"compute": 0.474899, "memory_bound": 0.180205, "overhead": 0.00552,
      "communication": 0.0023282, "optimizer": 0.00498074, "step|lora": 0.667934,
      "step|wrap=none": 0.667934}),
    ("nf4 r16 mb8x1 wrap=layer ckpt=selective", 134067356, 2.81617,
     {"base_weights": 14886912, "trainable_weights": 2490368, "optimizer_state": 4980736,
      "gathered_params": 16779264, "activations": 51380224, "logits_loss": 43657344,
      "activations|lora": 95037568, "activations|quant=nf4": 95037568,
      "activations|checkpointing=selective": 95037568},
     {"compute": 0.474899, "memory_bound": 0.253306, "overhead": 0.011, "dequant": 0.237278,
      "communication": 0.0391493, "optimizer": 0.00249037, "step|lora": 1.01812,
      "step|quant=nf4": 1.01812, "step|checkpointing=selective": 1.01812}),
    ("lora r16 mb8x1 wrap=layer ckpt=selective", 152741676, 1.15424,
     {"base_weights": 33563136, "trainable_weights": 2490368, "optimizer_state": 4980736,
      "gathered_params": 16779264, "activations": 51380224, "logits_loss": 43657344,
      "activations|lora": 95037568, "activations|checkpointing=selective": 95037568},
     {"compute": 0.474899, "memory_bound": 0.253306, "overhead": 0.011,
      "communication": 0.0491099, "optimizer": 0.00249037, "step|lora": 0.790806,
      "step|checkpointing=selective": 0.790806}),
    ("full mb8x1 wrap=layer ckpt=selective", 312692872, 1.64448,
     {"trainable_weights": 67126272, "gradients": 92295168, "optimizer_state": 151029760,
      "gathered_params": 8388608},
     {"compute": 0.65364, "memory_bound": 0.181703, "overhead": 0.00428,
      "communication": 0.0656821, "optimizer": 0.0671263,
      "step|checkpointing=selective": 0.972432}),
    ("lora r16 mb8x1 wrap=layer", 189472044, 1.32735,
     {"base_weights": 33563136, "trainable_weights": 2490368, "optimizer_state": 4980736,
      "gathered_params": 16779264, "activations": 89161728, "logits_loss": 42602624,
      "activations|lora": 131764352},
     {"compute": 0.474899, "memory_bound": 0.180205, "overhead": 0.00828,
      "communication": 0.0491099, "optimizer": 0.00249037, "step|lora": 0.714985}),
    ("lora r16 mb8x1 wrap=layer ckpt=full", 105555756, 1.17534,
     {"base_weights": 33563136, "trainable_weights": 2490368, "optimizer_state": 4980736,
      "gathered_params": 16779264, "activations": 4194304, "logits_loss": 43657344,
      "activations|lora": 47851648, "activations|checkpointing=full": 47851648},
     {"compute": 0.673656, "memory_bound": 0.253306, "overhead": 0.011,
      "communication": 0.0491099, "optimizer": 0.00249037, "step|lora": 0.989562,
      "step|checkpointing=full": 0.989562}),
    ("lora r16 mb8x1 wrap=none ckpt=full", 142647528, 0.835549,
     {"base_weights": 67126272, "trainable_weights": 4980736, "gradients": 4980736,
      "optimizer_state": 9961472, "gathered_params": 2490368, "activations": 4194304,
      "logits_loss": 51517504, "activations|lora": 55711808,
      "activations|checkpointing=full": 55711808, "activations|wrap=none": 55711808},
     {"compute": 0.673656, "memory_bound": 0.253306, "overhead": 0.00824,
      "communication": 0.0023282, "optimizer": 0.00498074, "step|lora": 0.942511,
      "step|checkpointing=full": 0.942511, "step|wrap=none": 0.942511}),
]  # fmt: skip


def observation(label: str, peak: float, step: float, mem: dict, time: dict) -> Observation:
    return Observation(
        memory=tuple(float(mem.get(k, 0)) for k in PEAK_TERMS),
        time=tuple(float(time.get(k, 0.0)) for k in SPEED_TERMS),
        micro_steps=1,
        peak_bytes=float(peak),
        step_time_s=step,
        label=label,
    )


def napkin_peak(mem: dict) -> float:
    """The napkin's peak: the sum of its memory terms (each factor 1, no share, no constant)."""
    return sum(v for k, v in mem.items() if k in MEMORY_TERMS)


def napkin_step(time: dict) -> float:
    return sum(v for k, v in time.items() if k in TIME_FACTOR_TERMS)


def median_abs(errors: list[float]) -> float:
    return statistics.median(abs(e) for e in errors)


def calibrated_errors(cal: Calibration, trials: list) -> tuple[list[float], list[float]]:
    """The calibration's errors on `trials`, as the plan reports them: peak and tokens/s."""
    mem, spd = [], []
    for label, peak, step, m, t in trials:
        o = observation(label, peak, step, m, t)
        mem.append(cal.peaks(np.array([o.memory]))[0] / peak - 1)
        # tokens/s is the inverse of the step time
        spd.append(step / cal.step_times(np.array([o.time]), np.array([1.0]))[0] - 1)
    return mem, spd


def test_napkin_within_a_percent_is_not_made_worse_by_the_calibration():
    trials = LLAMA_MINI_CPU
    # by hand, estimated / measured - 1 of each peak: +1.37% +0.07% +0.08% +0.07% +1.97% +0.06%
    # +0.10% +1.83% (the napkin misses three configs by 1.4-2%, nails the other five): median
    # |error| (0.080 + 0.104) / 2 = 0.09%
    napkin_mem = [napkin_peak(m) / peak - 1 for _, peak, _, m, _ in trials]
    assert napkin_mem[0] == pytest.approx(0.01372, abs=1e-4)
    assert median_abs(napkin_mem) == pytest.approx(0.00092, abs=2e-5)
    # tokens/s: the napkin's speed constants are CPU guesses, 19% to 177% fast
    napkin_speed = [step / napkin_step(t) - 1 for _, _, step, _, t in trials]
    assert median_abs(napkin_speed) > 0.5

    cal = fit_calibration(observation(*t) for t in trials)
    cal_mem, cal_speed = calibrated_errors(cal, trials)
    # the study's own trials: memory no worse than the napkin's (it was, 0.41%, before issue 23:
    # the factors moved to explain the three 2% misses put the five exact ones 0.4% off) ...
    assert median_abs(cal_mem) <= median_abs(napkin_mem)
    check = cal.memory_check
    assert check is not None and not check.applied and check.prior == "none" and check.n == 8
    assert check.prior_error == pytest.approx(median_abs(napkin_mem), rel=1e-6)
    assert check.fitted_error > check.prior_error  # left out of the fit: 1.0% against 0.09%
    assert cal.memory == NAPKIN.memory and cal.memory_constant == 0.0
    # ... its band the napkin's error measured on them: the 90th percentile, the 1.97% miss
    assert cal.memory_band == pytest.approx(max(abs(e) for e in napkin_mem), rel=1e-6)
    assert cal.memory_band < MEMORY_ERROR
    assert cal.notes == [check.reason]
    assert "calibration not applied to memory: the napkin was already within 0.1%" in check.reason
    # speed, 77% off, is corrected: a fit that did not see a trial misses it by far less
    assert cal.speed_check is not None and cal.speed_check.applied
    assert cal.speed_check.fitted_error < median_abs(napkin_speed) / 2
    assert median_abs(cal_speed) < median_abs(napkin_speed) / 10


def test_as_the_search_runs_each_trial_is_predicted_no_worse_than_by_the_napkin():
    # What the plan prints: each trial estimated by the calibration fitted on the trials before
    # it, against the napkin on the same trials (the second on: the first had nothing before it).
    trials = LLAMA_MINI_CPU
    napkin, calibrated = [], []
    for i in range(1, len(trials)):
        cal = fit_calibration(observation(*t) for t in trials[:i])
        label, peak, step, m, t = trials[i]
        napkin.append(napkin_peak(m) / peak - 1)
        calibrated.append(calibrated_errors(cal, [trials[i]])[0][0])
    # by hand: the napkin's errors on trials 1..7 sorted 0.056 0.069 0.072 0.080 0.104 1.83 1.97%
    assert median_abs(napkin) == pytest.approx(0.00080, abs=2e-5)
    assert median_abs(calibrated) <= median_abs(napkin)  # was 0.96% (issue 23)


def test_a_napkin_off_by_a_known_factor_is_corrected():
    # The same configs on a machine whose measured peaks are all 1.3x the napkin's: on CUDA, the
    # caching allocator's reserve beyond what tensors hold, which a napkin without its slack term
    # misses. By hand, estimated / measured - 1 = 1 / 1.3 - 1 = -23.1% on every trial.
    trials = [(lab, 1.3 * napkin_peak(m), s, m, t) for lab, _, s, m, t in LLAMA_MINI_CPU]
    napkin_mem = [napkin_peak(m) / peak - 1 for _, peak, _, m, _ in trials]
    assert median_abs(napkin_mem) == pytest.approx(1 - 1 / 1.3, rel=1e-9)

    cal = fit_calibration(observation(*t) for t in trials)
    cal_mem, _ = calibrated_errors(cal, trials)
    check = cal.memory_check
    assert check is not None and check.applied
    assert median_abs(cal_mem) < 0.02  # 23% -> within measurement noise
    assert check.fitted_error < 0.03  # and on trials the fit did not see
    assert all("memory" not in note for note in cal.notes)


def test_a_stored_calibration_as_the_prior_is_what_the_fit_is_held_against():
    # This machine's stored calibration knows the 1.3x; the study's trials agree with it as
    # closely as the napkin agreed with the real ones: the stored factors stay, and the note
    # names the stored calibration, not the napkin.
    stored = Calibration(
        memory={**NAPKIN.memory, **dict.fromkeys(MEMORY_TERMS, 1.3)},
        source="stored",
        n_trials=20,
        memory_band=0.03,
    )
    trials = [(lab, 1.3 * peak, s, m, t) for lab, peak, s, m, t in LLAMA_MINI_CPU]
    stored_mem = [1.3 * napkin_peak(m) / peak - 1 for _, peak, _, m, _ in trials]
    assert median_abs(stored_mem) == pytest.approx(0.00092, abs=2e-5)  # as the napkin above

    cal = fit_calibration((observation(*t) for t in trials), stored)
    check = cal.memory_check
    assert check is not None and not check.applied and check.prior == "stored"
    assert cal.memory == stored.memory and cal.n_trials == 28
    cal_mem, _ = calibrated_errors(cal, trials)
    # the stored factors, applied term by term: the same errors up to float rounding
    assert median_abs(cal_mem) == pytest.approx(median_abs(stored_mem), rel=1e-9)
    assert "this machine's stored calibration was already within" in check.reason
    # the napkin as the prior on the same trials is 23% off: there the fit pays for itself
    assert fit_calibration(observation(*t) for t in trials).memory_check.applied


def test_one_trial_corrects_only_what_is_beyond_measurement_noise():
    label, peak, step, m, t = LLAMA_MINI_CPU[1]  # the napkin within 0.07%
    cal = fit_calibration([observation(label, peak, step, m, t)])
    assert not cal.memory_check.applied and cal.memory == NAPKIN.memory
    assert cal.memory_band == NAPKIN.memory_band  # one trial cannot measure an error band
    off = fit_calibration([observation(label, 1.3 * napkin_peak(m), step, m, t)])
    assert off.memory_check.applied  # 23% off: beyond the noise of a peak (2%)
    predicted = off.peaks(np.array([observation(label, peak, step, m, t).memory]))[0]
    assert predicted == pytest.approx(1.3 * napkin_peak(m), rel=0.02)


def test_what_was_kept_and_why_survives_the_study_and_the_store():
    cal = fit_calibration(observation(*t) for t in LLAMA_MINI_CPU)
    again = calibration_from_dict(calibration_to_dict(cal))
    assert again.memory_check == cal.memory_check and again.speed_check == cal.speed_check
    assert again.notes == cal.notes == calibration_to_dict(cal)["notes"]
    assert (
        calibration_from_dict(calibration_to_dict(NAPKIN)).memory_check is None
    )  # records from before
