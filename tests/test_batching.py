"""The `batching` knob on the data's lengths: how micro-batches are laid out
(`autofit.data.batching`), what the estimate reads of them, and when the plan searches it."""

from __future__ import annotations

import random

import pytest

from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.data.batching import data_shape, longest_micro_batch, micro_batches
from autofit.estimate import estimate
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.space_file import load_space

OUTLIER = LengthHistogram.of([64] * 63 + [1024])


def test_padded_width_is_the_longest_of_its_draws() -> None:
    # two lengths, equally common; a micro-batch of 2 is 10 wide only when both draws are 10
    # (1 in 4), else 20: 0.25 x 10 + 0.75 x 20 = 17.5 positions a row, 15 of them useful
    shape = data_shape(LengthHistogram.of([10, 20]), "padded", 2, seq_len=64)
    assert shape.mean_width == pytest.approx(17.5)
    assert shape.mean_useful == pytest.approx(15.0)
    assert shape.padding_share == pytest.approx(1 - 15 / 17.5)
    # drawn micro-batches agree with it
    drawn = micro_batches(OUTLIER, "padded", 4, 1024, 20_000, random.Random(1))
    width = sum(b.width for b in drawn) / len(drawn)
    assert width == pytest.approx(data_shape(OUTLIER, "padded", 4, 1024).mean_width, rel=0.03)


def test_truncation_caps_every_row() -> None:
    assert data_shape(OUTLIER, "padded", 1, seq_len=256).peak_len == 256
    assert longest_micro_batch(OUTLIER, "padded", 3, 256).tokens == 3 * 256
    drawn = micro_batches(OUTLIER, "grouped", 4, 256, 500, random.Random(0))
    assert max(b.width for b in drawn) == 256


def test_packed_rows_hold_every_token_without_padding() -> None:
    drawn = micro_batches(OUTLIER, "packed", 2, 512, 50, random.Random(0))
    assert len(drawn) == 50
    assert all(b.width == 512 and b.useful_tokens == 2 * 512 for b in drawn)
    shape = data_shape(OUTLIER, "packed", 2, 512)
    assert (shape.peak_len, shape.padding_share) == (512, 0.0)


def test_grouping_by_length_pads_less_than_dataset_order() -> None:
    # HF's group_by_length exists for this: the outlier waits with its peers, not with 64s
    padded = data_shape(OUTLIER, "padded", 8, 1024).padding_share
    grouped = data_shape(OUTLIER, "grouped", 8, 1024).padding_share
    assert padded > 0.5 and grouped < padded / 3
    assert data_shape(OUTLIER, "grouped", 8, 1024).peak_len == 1024  # the same longest batch


# ----- the estimate ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def debug() -> tuple:
    return resolve_model("llama-debug"), resolve_hardware("2", device="cpu", gpu_memory="1GiB")


def test_data_of_full_length_sequences_changes_no_estimate(debug: tuple) -> None:
    """Every example `seq_len` long: every batching is the run the napkin always assumed."""
    spec, hw = debug
    full = LengthHistogram.of([1024] * 10)
    for batching in ("padded", "grouped", "packed"):
        cfg = Config(micro_batch=4, seq_len=1024, batching=batching)
        blind = estimate(spec, hw, cfg.replace(batching="padded"), device="cpu")
        known = estimate(spec, hw, cfg, device="cpu", lengths=full)
        if batching != "packed":
            assert (known.peak_bytes, known.tokens_per_s) == (blind.peak_bytes, blind.tokens_per_s)
        assert known.padding_share == 0.0
        # a packed config without the data's lengths: rows of one sequence, no mask
        assert estimate(spec, hw, cfg, device="cpu").peak_bytes == blind.peak_bytes


def test_padded_peak_is_the_outlier_s_and_speed_counts_useful_tokens(debug: tuple) -> None:
    spec, hw = debug
    cfg = Config(micro_batch=4, seq_len=1024)
    known = estimate(spec, hw, cfg, device="cpu", lengths=OUTLIER)
    # the longest micro-batch: four rows of 1,024, as if every sequence were that long
    assert known.peak_bytes == estimate(spec, hw, cfg, device="cpu").peak_bytes
    # tokens/s: 79 useful tokens a row (63 x 64 + 1024 over 64) at the step time of the mean
    # width; the padding share is the rest
    width = data_shape(OUTLIER, "padded", 4, 1024).mean_width
    at_width = estimate(spec, hw, cfg.replace(seq_len=round(width)), device="cpu")
    assert known.step_time_s == at_width.step_time_s
    assert known.tokens_per_s == pytest.approx(4 * 2 * 79 / at_width.step_time_s)
    assert known.padding_share == pytest.approx(1 - 79 / width)


def test_packed_peak_holds_its_attention_mask(debug: tuple) -> None:
    spec, hw = debug
    cfg = Config(micro_batch=1, seq_len=1024, batching="packed", wrap="none")
    packed = estimate(spec, hw, cfg, device="cpu", lengths=OUTLIER)
    rows = estimate(spec, hw, cfg.replace(batching="padded"), device="cpu")
    # 10.0 MiB more measured on this model: the bool mask (1 MiB), and in each of the 4 layers
    # that keep their activations a bf16 copy of it (2 MiB) and k and v repeated from 2 heads
    # to 4 (2 x 1,024 x 2 x 64 x 2 B = 0.5 MiB)
    assert packed.peak_allocated_bytes - rows.peak_allocated_bytes == (1 + 4 * 2.5) * 2**20


# ----- the search -------------------------------------------------------------------------------
def test_batching_is_searched_only_with_the_data() -> None:
    space = load_space("default")
    assert space.knobs["batching"] == ("padded", "grouped", "packed")
    blind, _ = space.candidates(2, device="cpu")
    known, _ = space.candidates(2, device="cpu", data=True)
    assert {c.batching for c in blind} == {"padded"}
    assert len(known) == 3 * len(blind)


def test_a_plan_on_data_ranks_by_useful_tokens_and_shows_the_padding(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from rich.console import Console

    from autofit.plan import plan_estimates
    from autofit.report.tables import plan_table
    from autofit.request import PlanRequest

    space = tmp_path / "space.yaml"
    space.write_text(
        "seq_len: 1024\nknobs:\n  micro_batch: [1, 2]\n  wrap: [layer]\n"
        "  checkpointing: [full]\n  batching: [padded, grouped, packed]\n"
    )
    spec = resolve_model("llama-debug")
    hw = resolve_hardware("2", device="cpu", gpu_memory="1GiB")
    plan = plan_estimates(PlanRequest.of(spec, hw, load_space(space), device="cpu",
                                         calibration="off", lengths=OUTLIER))  # fmt: skip
    assert len(plan.ranked) == 6  # 2 micro-batches x 3 batchings, all fit 1 GiB
    speeds = [c.estimate.tokens_per_s for c in plan.ranked]
    assert speeds == sorted(speeds, reverse=True)
    # packed computes no padding: per token it is the fastest (the mask costs no FLOP here)
    assert plan.best is not None and plan.best.config.batching == "packed"
    padded = next(c for c in plan.ranked if c.config.batching == "padded" and
                  c.config.micro_batch == 2)  # fmt: skip
    share = data_shape(OUTLIER, "padded", 2, 1024).padding_share
    assert padded.to_dict()["estimate"]["padding_share"] == share
    console = Console(width=250, record=True)
    console.print(plan_table(plan))
    text = console.export_text()
    assert "padding" in text and f"{share:.0%}" in text and "useful tokens" in text


def test_the_search_measures_every_trial_on_the_data(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every trial the search runs, and the winner's verification, gets the data's lengths; a
    study on data is another study than the same plan without them."""
    from autofit.search import search
    from autofit.search.study import default_study_name
    from autofit.trials import TrialResult

    seen: list[tuple[Config, int, LengthHistogram | None]] = []

    def measure(model, config, *, nprocs, device, gpu_memory, steps, timeout_s,  # type: ignore[no-untyped-def]
                lengths=None, **hooks):  # fmt: skip
        seen.append((config, steps, lengths))
        hw = resolve_hardware(str(nprocs), device="cpu", gpu_memory=gpu_memory)
        est = estimate(model, hw, config, device="cpu", lengths=lengths)
        return TrialResult(status="ok", config=config.to_dict(), model=model.name, device=device,
                           nprocs=nprocs, capacity_bytes=gpu_memory, peak_bytes=est.peak_bytes,
                           tokens_per_s=est.tokens_per_s, step_time_s=est.step_time_s,
                           losses=[2.0] * (steps + 1))  # fmt: skip

    space = tmp_path / "space.yaml"
    space.write_text(
        "seq_len: 1024\nknobs:\n  micro_batch: [1, 2]\n  wrap: [layer]\n"
        "  checkpointing: [full]\n  batching: [padded, packed]\n"
    )
    spec, hw = resolve_model("llama-debug"), resolve_hardware("2", device="cpu", gpu_memory="1GiB")
    plan = search(model=spec, hardware=hw, space=load_space(space), seq_len=1024, trials=2,
                  steps=2, device="cpu", gpu_memory=hw.capacity_bytes, run_dir=tmp_path / "run",
                  calibration="off", lengths=OUTLIER, run_trial=measure, seed=0)  # fmt: skip
    assert plan.best is not None and plan.best.verified
    assert len(seen) == 3 and seen[-1][1] > 2  # two trials, then the verification
    assert all(lengths is OUTLIER for _, _, lengths in seen)
    sp = load_space(space)
    assert default_study_name(spec, hw, sp, 1024, None, "cpu") != default_study_name(
        spec, hw, sp, 1024, None, "cpu", lengths=OUTLIER
    )
