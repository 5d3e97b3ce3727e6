"""The `autofit` command line through typer's CliRunner: output, JSON contract, exit codes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import autofit
from autofit.cli import app
from autofit.models import PRESETS
from tests.test_models import PUBLISHED

runner = CliRunner()


def run(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args))


def assert_clean_failure(result, *fragments: str) -> None:  # type: ignore[no-untyped-def]
    text = result.output
    assert result.exit_code == 2, text
    assert "Traceback" not in text
    assert isinstance(result.exception, SystemExit)
    assert text.startswith("error:")
    assert len([line for line in text.strip().splitlines() if line.strip()]) == 1  # one paragraph
    for fragment in fragments:
        assert fragment in text, text


QLORA_FLAGS = [
    "--quant",
    "nf4",
    "--lora-rank",
    "64",
    "--micro-batch",
    "8",
    "--seq-len",
    "2048",
    "--checkpointing",
    "full",
]


def test_version():
    result = run("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"autofit {autofit.__version__}"


def test_hardware_without_a_driver_says_so_and_exits_zero(no_driver):
    result = run("hardware")
    assert result.exit_code == 0
    assert "No NVIDIA GPU driver found (Driver Not Loaded)" in result.stdout
    assert "--gpus 2xrtx3090" in result.stdout
    assert "Traceback" not in result.output


def test_hardware_json_without_a_driver_has_an_empty_gpu_list(no_driver):
    result = run("hardware", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["gpus"] == [] and data["source"] == "none"
    assert "Driver Not Loaded" in data["reason"]
    assert data["host_ram_bytes"] > 0


def test_hardware_lists_fake_nvml_gpus_and_pairs(fake_nvml):
    result = run("hardware")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "NVIDIA H100 80GB HBM3" in out and "NVIDIA GeForce RTX 3090" in out
    assert "gen5 x16" in out and "gen3 x8" in out
    assert "0 <-> 1" in out and "NVLink" in out and "PCIe" in out


def test_hardware_json_with_fake_nvml(fake_nvml):
    data = json.loads(run("hardware", "--json").stdout)
    assert [g["name"] for g in data["gpus"]][:2] == ["NVIDIA H100 80GB HBM3"] * 2
    assert data["gpus"][0]["compute_capability"] == "9.0"
    assert data["gpus"][0]["nvlink_links"] == 18
    assert data["gpus"][3]["bf16"] is False
    assert {"a": 0, "b": 1, "link": "nvlink"} in data["pairs"]
    assert {"a": 0, "b": 2, "link": "pcie"} in data["pairs"]


def test_hardware_presets_lists_the_common_cards_with_figures():
    result = run("hardware", "--presets")
    assert result.exit_code == 0
    out = result.stdout
    for name in (
        "rtx3090",
        "rtx4090",
        "a10g",
        "l4",
        "l40s",
        "a100-40gb",
        "a100-80gb",
        "h100-80gb",
        "h200",
    ):
        assert name in out
    for header in ("memory", "bf16 TFLOP/s", "mem GB/s", "link GB/s"):
        assert header in out
    assert "989" in out and "3350" in out and "450" in out  # H100: TFLOP/s, HBM, NVLink


def test_hardware_presets_json():
    data = json.loads(run("hardware", "--presets", "--json").stdout)
    h100 = next(p for p in data["presets"] if p["name"] == "h100-80gb")
    assert h100["bf16_tflops"] == 989.0 and h100["mem_bw_gbs"] == 3350.0
    assert h100["link_bw_gbs"] == 450.0 and h100["memory_bytes"] > 80 * 10**9


def test_models_shows_exact_parameter_counts():
    result = run("models")
    assert result.exit_code == 0
    assert "6,738,415,616" in result.stdout
    assert "tinyllama-1.1b" in result.stdout


def test_models_json():
    """Every preset, each published model with its exact published parameter count."""
    data = json.loads(run("models", "--json").stdout)
    counts = {m["name"]: m["n_params"] for m in data["models"]}
    assert list(counts) == list(PRESETS)
    assert {name: counts[name] for name in PUBLISHED} == PUBLISHED
    assert all(n > 0 for n in counts.values())


def test_estimate_text_report():
    result = run("estimate", "--model", "llama-7b", "--gpus", "2xrtx3090", *QLORA_FLAGS)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Peak memory per GPU" in out
    assert "frozen base weights" in out and "activations" in out
    assert "fits" in out and "tokens/s" in out


def test_estimate_json_is_exactly_one_object_with_the_contract_fields():
    result = run("estimate", "-m", "llama-7b", "-g", "2xrtx3090", *QLORA_FLAGS, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # fails if anything else is on stdout
    assert isinstance(data, dict)
    for key in (
        "peak_bytes",
        "peak_allocated_bytes",
        "capacity_bytes",
        "fits",
        "breakdown",
        "step_time_s",
        "tokens_per_s",
    ):
        assert key in data
    assert sum(data["breakdown"].values()) == data["peak_allocated_bytes"]
    assert data["fits"] is True


def test_estimate_that_does_not_fit_suggests_next_steps():
    result = run("estimate", "-m", "llama-7b", "-g", "1xh100-80gb")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "does not fit" in text and "Next step, each of which fits by the estimate:" in text
    # full recomputation alone leaves the 16 B/param of a full fine-tune (108 GB): not named
    assert "--quant nf4 --lora-rank 16" in text and "--checkpointing full" not in text


def test_estimate_gpu_memory_caps_capacity():
    data = json.loads(
        run(
            "estimate",
            "-m",
            "llama-7b",
            "-g",
            "1xh100-80gb",
            "--gpu-memory",
            "24GiB",
            "--quant",
            "nf4",
            "--lora-rank",
            "16",
            "--json",
        ).stdout
    )
    assert data["capacity_bytes"] == 24 * 1024**3


def test_plan_no_trials_text():
    result = run("plan", "-m", "llama-7b", "-g", "2xrtx3090", "--space", "qlora", "--no-trials")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Configs that fit, fastest first (estimates)" in out
    assert "combinations considered" in out and "ruled out by the estimate" in out
    assert "estimated peak above GPU memory" in out
    assert "Winner (estimated)" in out
    assert "Why: " in out


def test_plan_no_trials_json():
    result = run(
        "plan", "-m", "llama-7b", "-g", "2xrtx3090", "--no-trials", "--json", "--global-batch", "32"
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["best"]["config"]["micro_batch"] * data["best"]["config"]["grad_accum"] * 2 == 32
    assert data["pruned"] and all(v > 0 for v in data["pruned"].values())
    assert data["trials"] == []


def test_plan_with_a_space_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("knobs:\n  quant: [nf4]\n  lora_rank: [16]\n  micro_batch: [1, 2]\n")
    result = run(
        "plan", "-m", "llama-7b", "-g", "1xrtx3090", "--space", str(path), "--no-trials", "--json"
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["space"] == "tiny" and data["considered"] == 2


def test_plan_with_a_bad_space_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("knobs:\n  quant: [fp3]\n")
    result = run("plan", "-m", "llama-7b", "-g", "1xrtx3090", "--space", str(path), "--no-trials")
    assert_clean_failure(result, str(path), "'quant'", "none, int8, nf4")


def test_plan_where_nothing_fits_explains_and_exits_one():
    result = run("plan", "-m", "llama-70b", "-g", "1xrtx3090", "--space", "full", "--no-trials")
    assert result.exit_code == 1
    assert "No config fits" in result.stdout and "What would make it fit" in result.stdout
    assert "Traceback" not in result.output


def test_plan_gpus_auto_without_gpus_explains_and_fails(no_driver):
    result = run("plan", "-m", "llama-7b", "--gpus", "auto", "--no-trials")
    assert_clean_failure(result, "needs NVIDIA GPUs", "--gpus 2xrtx3090")


BAD_INPUTS = [
    (["-m", "llama-7x", "-g", "1xrtx3090"], ["Unknown model 'llama-7x'", "llama-7b"]),
    (["-m", "llama-7b", "-g", "1xrtx3090", "--quant", "fp3"], ["'fp3'", "none, int8, nf4"]),
    (["-m", "llama-7b", "-g", "3xfoo"], ["Unknown GPU preset 'foo'", "rtx3090"]),
    (["-m", "llama-7b", "-g", "2xrtx309"], ["Did you mean 'rtx3090'"]),
    (["-m", "llama-7b", "-g", "1xrtx3090", "--gpu-memory", "24XB"], ["'24XB'", "24GiB"]),
    (["-m", "llama-7b", "-g", "1xrtx3090", "--lora-rank", "-1"], ["'lora_rank'", "0 to 4,096"]),
    (
        ["-m", "llama-7b", "-g", "1xrtx3090", "--quant", "nf4", "--lora-rank", "0"],
        ["needs LoRA", "lora_rank > 0"],
    ),
    (["-m", "llama-7b", "-g", "1xrtx3090", "--reshard", "maybe"], ["true or false"]),
    (["-m", "llama-7b", "-g", "1xrtx3090", "--device", "tpu"], ["--device"]),
]
KNOB_FLAGS = ("--quant", "--lora-rank", "--reshard")  # estimate/trial flags; plan searches them


@pytest.mark.parametrize(("args", "fragments"), BAD_INPUTS)
def test_bad_estimate_inputs_give_one_paragraph_and_exit_2(args, fragments):
    assert_clean_failure(run("estimate", *args), *fragments)


@pytest.mark.parametrize(
    ("args", "fragments"), [b for b in BAD_INPUTS if not set(KNOB_FLAGS) & set(b[0])]
)
def test_bad_plan_inputs_give_one_paragraph_and_exit_2(args, fragments):
    assert_clean_failure(run("plan", *args, "--no-trials"), *fragments)


def test_missing_model_is_a_usage_error():
    result = run("estimate", "-g", "1xrtx3090")
    assert result.exit_code == 2
    assert "--model" in result.output


# ----- the LoRA settings: flags of estimate, trial and plan -------------------------------------
LORA_SETTING_FLAGS = ["--lora-targets", "q_proj, v_proj", "--lora-dropout", "0.05"]


def test_estimate_lora_setting_flags_reach_the_json_config():
    result = run("estimate", "-m", "llama-debug", "-g", "1xrtx3090", "--lora-rank", "8",
                 *LORA_SETTING_FLAGS, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)["config"]
    assert config["lora_targets"] == ["q_proj", "v_proj"] and config["lora_dropout"] == 0.05
    assert autofit.Config.from_dict(config) == autofit.Config(
        lora_rank=8, lora_targets=("q_proj", "v_proj"), lora_dropout=0.05
    ).resolved(1)  # wrap: auto is the plain module on one GPU


def test_estimate_all_linear_is_the_default():
    result = run("estimate", "-m", "llama-debug", "-g", "1xrtx3090", "--lora-rank", "8",
                 "--lora-targets", "all-linear", "--lora-dropout", "0", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)["config"]
    assert "lora_targets" not in config and "lora_dropout" not in config


def test_trial_lora_setting_flags_reach_the_trial(monkeypatch):
    import autofit.trials
    from autofit.trials import TrialResult

    def fake(spec, cfg, **kw):  # type: ignore[no-untyped-def]
        return TrialResult(status="ok", config=cfg.to_dict(), model=spec.name, device="cpu",
                           nprocs=1)  # fmt: skip

    monkeypatch.setattr(autofit.trials, "run_trial", fake)
    result = run("trial", "-m", "llama-debug", "-g", "1", "--device", "cpu", "--lora-rank", "8",
                 *LORA_SETTING_FLAGS, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)["config"]
    assert config["lora_targets"] == ["q_proj", "v_proj"] and config["lora_dropout"] == 0.05


def test_plan_lora_setting_flags_reach_every_candidate(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("knobs: {lora_rank: [8, 16], micro_batch: [1, 2]}\nlora_targets: o_proj\n")
    result = run("plan", "-m", "llama-debug", "-g", "1xrtx3090", "--no-trials", "--space",
                 str(space), *LORA_SETTING_FLAGS, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    configs = [c["config"] for c in data["ranked"]]
    assert len(configs) == 4 and data["best"]["config"] == configs[0]
    assert {(tuple(c["lora_targets"]), c["lora_dropout"]) for c in configs} == {
        (("q_proj", "v_proj"), 0.05)
    }
    assert "targets=q_proj,v_proj drop=0.05" in data["best"]["label"]


def test_train_embeddings_flag_reaches_estimate_trial_and_plan(monkeypatch, tmp_path):
    import autofit.trials
    from autofit.trials import TrialResult

    result = run("estimate", "-m", "llama-debug", "-g", "1xrtx3090", "--lora-rank", "8",
                 "--train-embeddings", "full", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["config"]["train_embeddings"] == "full"
    plain = run("estimate", "-m", "llama-debug", "-g", "1xrtx3090", "--lora-rank", "8", "--json")
    assert data["peak_bytes"] > json.loads(plain.stdout)["peak_bytes"]  # the copies cost memory

    def fake(spec, cfg, **kw):  # type: ignore[no-untyped-def]
        return TrialResult(status="ok", config=cfg.to_dict(), model=spec.name, device="cpu",
                           nprocs=1)  # fmt: skip

    monkeypatch.setattr(autofit.trials, "run_trial", fake)
    result = run("trial", "-m", "llama-debug", "-g", "1", "--device", "cpu", "--lora-rank", "8",
                 "--train-embeddings", "tokens:4", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["train_embeddings"] == "tokens:4"

    space = tmp_path / "space.yaml"
    space.write_text("knobs: {lora_rank: [0, 8], micro_batch: [1, 2]}\n")
    result = run("plan", "-m", "llama-debug", "-g", "1xrtx3090", "--no-trials", "--space",
                 str(space), "--train-embeddings", "full", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    configs = [c["config"] for c in data["ranked"]]
    assert len(configs) == 2  # the full fine-tunes train the embeddings anyway: skipped
    assert {(c["lora_rank"], c["train_embeddings"]) for c in configs} == {(8, "full")}
    assert "emb=full" in data["best"]["label"]
