"""Bad input (issue 8, points 5, 6, 8, 9): one paragraph naming what was wrong and what is
allowed, exit 2, no traceback, one JSON object under --json, and bracketed text kept; all of it
checked before any trial runs (a trial here fails the test)."""

from __future__ import annotations

import json
import sqlite3
import time
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autofit
from autofit.checks import AutofitWarning
from autofit.cli import app, main
from autofit.errors import AutofitError, HardwareError, ModelError

runner = CliRunner()
TINY_SPACE = str(Path(__file__).parent / "search" / "tiny_space.yaml")
# a CPU search that would run real trials if nothing stopped it first
CPU_PLAN = ["plan", "-m", "llama-debug", "-g", "2", "--device", "cpu", "--trials", "2",
            "--seq-len", "64", "--space", TINY_SPACE]  # fmt: skip


@pytest.fixture(autouse=True)
def no_trial_may_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every check here comes before the first trial: running one fails the test. The working
    folder is a temp folder, so a default run folder (autofit-runs/...) lands there."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a trial ran although the input was refused up front")

    # where every launch of a trial starts (`run_trial` and `run_trials`), whoever imported them
    # by name
    monkeypatch.setattr("autofit.trials.launcher._launch", refuse)
    monkeypatch.setattr("autofit.hardware.cpu_cores", lambda: 2)
    monkeypatch.chdir(tmp_path)


def run(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args))


def plan_with_space_file(tmp_path: Path, content: str | bytes):  # type: ignore[no-untyped-def]
    """`autofit plan --no-trials` with a space file holding `content`."""
    space = tmp_path / "space.yaml"
    if isinstance(content, bytes):
        space.write_bytes(content)
    else:
        space.write_text(content)
    return run("plan", "-m", "llama-debug", "-g", "2xrtx3090", "--no-trials", "--space", str(space))


def assert_clean_failure(result, *fragments: str) -> str:  # type: ignore[no-untyped-def]
    """Exit 2, no traceback, one `error:` paragraph naming every fragment."""
    text = result.output
    assert result.exit_code == 2, text
    assert isinstance(result.exception, SystemExit), text
    assert "Traceback" not in text
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:") and lines.count(lines[-1]) == 1, text
    assert len([line for line in lines if not line.startswith("Running a trial")]) == 1, text
    for fragment in fragments:
        assert fragment in text, text
    return text


def assert_json_failure(result, *fragments: str) -> dict:  # type: ignore[no-untyped-def]
    """Exit 2 and stdout is one JSON object {"error": ..., "hint": ...}."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    data = json.loads(result.stdout)
    assert set(data) == {"error", "hint"} and data["error"] and data["hint"], data
    for fragment in fragments:
        assert fragment in data["error"] + " " + data["hint"], data
    return data


@pytest.fixture
def file_in_the_way(tmp_path: Path) -> Path:
    """A regular file: a path under it can be neither a folder nor a file's folder."""
    path = tmp_path / "file"
    path.write_text("not a folder\n")
    return path


# ----- 5. tracebacks, and outputs checked writable before any trial ------------------------------
def test_export_under_a_file_fails_before_the_search(file_in_the_way, tmp_path):
    target = file_in_the_way / "x.yaml"
    result = run(*CPU_PLAN, "--run-dir", str(tmp_path / "run"), "--export", str(target))
    assert_clean_failure(result, f"--export {target}", f"{file_in_the_way} is a file")
    assert not (tmp_path / "run").exists()


def test_export_into_proc_fails_before_the_search(tmp_path):
    result = run(*CPU_PLAN, "--run-dir", str(tmp_path / "run"), "--export", "/proc/x.yaml")
    assert_clean_failure(result, "--export /proc/x.yaml", "no file can be made in /proc")


def test_export_side_file_and_foreign_file_are_checked_up_front(tmp_path):
    (tmp_path / "mine.json").write_text("{}\n")  # not written by autofit
    result = run(*CPU_PLAN, "--export", str(tmp_path / "mine.json"), "--format", "trainer")
    assert_clean_failure(result, "was not written by autofit")


@pytest.mark.parametrize("under_file", [True, False])
def test_run_dir_that_cannot_be_written_fails_before_any_trial(file_in_the_way, under_file):
    run_dir = str(file_in_the_way / "af") if under_file else "/proc/af"
    result = run(*CPU_PLAN, "--run-dir", run_dir)  # a trial would fail it (`no_trial_may_run`)
    why = f"{file_in_the_way} is a file" if under_file else "no file can be made in /proc"
    assert_clean_failure(result, f"--run-dir {run_dir}", why)


def test_run_dir_error_under_json_is_one_object(file_in_the_way):
    result = run(*CPU_PLAN, "--run-dir", str(file_in_the_way / "af"), "--json")
    data = assert_json_failure(result, "--run-dir")
    assert data["hint"] == "Pass --run-dir a folder you can write in."


def test_a_binary_space_file_is_an_error(tmp_path):
    result = plan_with_space_file(tmp_path, bytes(range(128, 256)) * 3)
    assert_clean_failure(result, "not UTF-8 text", "knobs:")


def test_a_space_file_with_control_characters_is_one_paragraph(tmp_path):
    result = plan_with_space_file(tmp_path, "knobs:\n  quant: [none]\n\x00\x01\n")
    assert_clean_failure(result, "not valid YAML")


def write_config(tmp_path: Path, **overrides: object) -> str:
    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
           "intermediate_size": 688}  # fmt: skip
    cfg.update(overrides)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"hidden_size": "big"}, ["hidden_size is 'big'", "whole number of at least 1"]),
        ({"num_hidden_layers": -2}, ["num_hidden_layers is -2"]),
        ({"vocab_size": 0}, ["vocab_size is 0"]),
        ({"num_attention_heads": 3, "num_key_value_heads": 3},
         ["hidden_size (256) is not divisible by num_attention_heads (3)"]),
        ({"num_key_value_heads": 3}, ["num_attention_heads (4) is not a multiple of "
                                      "num_key_value_heads (3)"]),
        ({"intermediate_size": 1.5}, ["intermediate_size is 1.5"]),
        ({"num_hidden_layers": True}, ["num_hidden_layers is True"]),
        ({"rope_theta": "x"}, ["rope_theta is 'x'"]),
    ],
)  # fmt: skip
def test_bad_model_configs_are_refused_up_front(tmp_path, overrides, fragments):
    model = write_config(tmp_path, **overrides)
    assert_clean_failure(run("estimate", "-m", model, "-g", "2", "--device", "cpu"), *fragments)
    assert_clean_failure(run(*CPU_PLAN[:2], model, *CPU_PLAN[3:]), *fragments)
    with pytest.raises(ModelError):
        autofit.estimate(model, "2", device="cpu")


def test_a_good_model_config_with_floats_and_nulls_still_reads(tmp_path):
    model = write_config(tmp_path, hidden_size=256.0, num_key_value_heads=None, head_dim=None)
    est = autofit.estimate(model, "2", device="cpu", seq_len=64)
    assert est.peak_bytes > 0


def test_export_command_output_under_a_file(file_in_the_way, tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    output = file_in_the_way / "plan.yaml"
    result = run("export", "--storage", storage, "--study", "s", "--output", str(output))
    assert_clean_failure(result, f"--output {output}", "is a file, not a folder")


def test_export_of_a_plan_to_a_path_under_a_file_is_an_error_not_an_oserror(file_in_the_way):
    plan = autofit.plan("llama-debug", "2", device="cpu", seq_len=64, space=TINY_SPACE, trials=0)
    assert plan.best is not None
    with pytest.raises(AutofitError, match="is a file, not a folder"):
        plan.export("autofit", file_in_the_way / "plan.yaml")


# ----- 6. accepted today but wrong ---------------------------------------------------------------
def test_gpu_memory_without_a_unit_is_refused():
    result = run("estimate", "-m", "llama-debug", "-g", "2", "--device", "cpu",
                 "--gpu-memory", "24")  # fmt: skip
    assert_clean_failure(result, "--gpu-memory 24 has no unit", "24 bytes", "24GiB")


def test_gpu_memory_of_a_few_bytes_is_refused():
    result = run("estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--gpu-memory", "24B")
    assert_clean_failure(result, "less than 1 MiB")


def test_gpu_memory_above_a_preset_card_names_its_size():
    result = run("estimate", "-m", "llama-7b", "-g", "1xh100-80gb", "--gpu-memory", "100GiB")
    assert_clean_failure(result, "100.0 GiB is more than the 79.6 GiB", "H100")


def test_gpu_memory_above_a_real_card_names_its_size(fake_nvml):
    result = run("estimate", "-m", "llama-7b", "-g", "2", "--gpu-memory", "100GiB")
    assert_clean_failure(result, "79.6 GiB", "NVIDIA H100 80GB HBM3", "81559MiB")
    ok = autofit.estimate("llama-7b", "2", gpu_memory="40GiB")
    assert ok.capacity_bytes == 40 * 1024**3


def test_seq_len_above_the_models_maximum_warns_on_stderr():
    result = run("estimate", "-m", "llama-debug", "-g", "2", "--device", "cpu",
                 "--seq-len", "2048", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)  # stdout stays one JSON object
    assert "warning: --seq-len 2048 is above llama-debug's maximum of 1024" in result.stderr
    quiet = run("estimate", "-m", "llama-debug", "-g", "2", "--device", "cpu", "--seq-len", "1024")
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr
    with pytest.warns(AutofitWarning, match="maximum of 1024 positions"):
        autofit.plan("llama-debug", "2xrtx3090", seq_len=4096, space=TINY_SPACE, trials=0)


@pytest.mark.parametrize("command", ["plan", "trial"])
def test_zero_steps_is_refused(command):
    args = CPU_PLAN if command == "plan" else ["trial", "-m", "llama-debug", "-g", "2",
                                                 "--device", "cpu", "--seq-len", "64"]  # fmt: skip
    assert_clean_failure(run(*args, "--steps", "0"), "--steps must be at least 1", "got 0")


def test_an_unknown_calibration_mode_is_refused():
    assert_clean_failure(
        run(*CPU_PLAN, "--calibration", "sometimes"),
        "--calibration must be one of auto, study, off", "got 'sometimes'",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["--gpus", "2", "--steps", "0"], "--steps must be at least 1"),
     (["--gpus", "two"], "--gpus"),
     (["--gpus", "2", "--device", "tpu"], "--device must be 'cuda' or 'cpu'")],
)  # fmt: skip
def test_calibrate_refuses_bad_input_before_any_trial(args, fragment):
    assert_clean_failure(run("calibrate", "--device", "cpu", *args), fragment)


def test_trial_timeout_must_be_positive():
    with pytest.raises(AutofitError, match="must be a positive number of seconds; got 0"):
        autofit.trial("llama-debug", "2", device="cpu", seq_len=64, trial_timeout=0)


def test_a_study_name_cannot_leave_the_run_folder(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    result = run(*CPU_PLAN, "--study", "../../etc/x y")
    assert_clean_failure(result, "--study '../../etc/x y'", "letters, digits, '.', '_' and '-'",
                         "--run-dir")  # fmt: skip
    assert not (tmp_path / "a" / "etc").exists() and not (tmp_path / "etc").exists()
    assert not (work / "autofit-runs").exists()


def test_run_folder_of_a_default_study_name_stays_one_folder(tmp_path):
    from autofit.arguments import run_folder
    from autofit.hardware import resolve_hardware
    from autofit.models import resolve_model
    from autofit.space_file import load_space

    spec = resolve_model(write_config(tmp_path))  # its name is a path, with slashes
    hw = resolve_hardware("2", device="cpu")
    folder = run_folder(spec, hw, load_space(TINY_SPACE), None, None, "cpu", None, None)
    assert folder.parent == Path("autofit-runs") and "/" not in folder.name
    named = run_folder(spec, hw, load_space(TINY_SPACE), None, None, "cpu", "my-study_1.0", None)
    assert named == Path("autofit-runs") / "my-study_1.0"
    # with --run-dir the study name is only a name in the storage: anything goes
    free = run_folder(spec, hw, load_space(TINY_SPACE), None, None, "cpu", "a b/c", tmp_path)
    assert free == tmp_path


def test_a_huge_gpu_count_is_refused_without_building_pair_lists():
    result = run("plan", "-m", "llama-7b", "-g", "100000xh100-80gb", "--no-trials")
    assert_clean_failure(result, "100,000 GPUs", "at most 4,096")
    assert_clean_failure(run("estimate", "-m", "llama-debug", "-g", "5000", "--device", "cpu"),
                         "5,000 GPUs")  # fmt: skip
    from autofit.hardware import MAX_GPUS, preset_hardware

    big = preset_hardware(MAX_GPUS, "h100-80gb")
    assert big.n_gpus == MAX_GPUS and big.pairs == () and big.link == "nvlink"
    assert len(preset_hardware(8, "h100-80gb").pairs) == 28


def test_far_more_cpu_ranks_than_cores_is_refused():
    result = run("plan", "-m", "llama-debug", "-g", "64", "--device", "cpu", "--trials", "2")
    assert_clean_failure(result, "64 trial processes on 2 CPU core(s)", "--gpus 2 or fewer",
                         "--no-trials")  # fmt: skip
    trial = run("trial", "-m", "llama-debug", "-g", "5", "--device", "cpu", "--json")
    assert_json_failure(trial, "5 trial processes on 2 CPU core(s)")
    # no trials: an estimate-only plan for many CPU processes is fine
    assert run("plan", "-m", "llama-debug", "-g", "64", "--device", "cpu", "--no-trials",
               "--json").exit_code in (0, 1)  # fmt: skip


def test_a_few_more_cpu_ranks_than_cores_only_warn():
    from autofit.hardware import check_trial_hardware, resolve_hardware

    with pytest.warns(AutofitWarning, match="3 trial processes on 2 CPU core"):
        check_trial_hardware(resolve_hardware("3", device="cpu"), "cpu", "3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_trial_hardware(resolve_hardware("2", device="cpu"), "cpu", "2")


def test_what_if_preset_with_trials_is_refused_without_those_gpus(no_driver):
    result = run("plan", "-m", "llama-debug", "-g", "2xrtx3090", "--trials", "2")
    assert_clean_failure(result, "--gpus 2xrtx3090 names hardware to plan for",
                         "no NVIDIA GPU", "--no-trials", "--gpus auto")  # fmt: skip
    trial = run("trial", "-m", "llama-debug", "-g", "2xrtx3090", "--json")
    assert_json_failure(trial, "`autofit estimate` takes hardware you do not have")
    assert "--no-trials" not in trial.stdout  # trial has no --no-trials


def test_what_if_preset_is_checked_against_the_gpus_trials_use(fake_nvml):
    from autofit.hardware import check_trial_hardware, resolve_hardware

    # GPUs 0-1 are H100s: a preset of them may run trials; an RTX 3090 is GPU 2, not GPU 0
    check_trial_hardware(resolve_hardware("2xh100-80gb"), "cuda", "2xh100-80gb")
    with pytest.raises(HardwareError, match="this machine has 4 GPU"):
        check_trial_hardware(resolve_hardware("1xrtx3090"), "cuda", "1xrtx3090")
    # --device cpu with a preset is the CPU path: K processes held to the preset's memory
    check_trial_hardware(resolve_hardware("2xrtx3090", device="cpu"), "cpu", "2xrtx3090")


def test_export_with_a_mistyped_sqlite_path_creates_nothing(tmp_path):
    missing = tmp_path / "stdy.db"
    result = run("export", "--storage", f"sqlite:///{missing}", "--study", "s",
                 "--output", str(tmp_path / "plan.yaml"))  # fmt: skip
    assert_clean_failure(result, f"No SQLite database at '{missing}'", "study.db")
    assert not missing.exists()
    sqlite3.connect(tmp_path / "real.db").close()  # an existing database is opened as before
    found = run("export", "--storage", f"sqlite:///{tmp_path / 'real.db'}", "--study", "s",
                "--output", str(tmp_path / "plan.yaml"))  # fmt: skip
    assert_clean_failure(found, "No study named 's'")


# ----- 8. --json errors are one JSON object ------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["estimate", "-m", "nope", "--json"],
        ["estimate", "-m", "llama-debug", "-g", "2", "--device", "cpu", "--quant", "bogus",
         "--json"],
        ["trial", "-m", "llama-debug", "-g", "2", "--device", "cpu", "--steps", "0", "--json"],
        ["plan", "-m", "llama-debug", "-g", "2xrtx3090", "--no-trials", "--space", "nope",
         "--json"],
    ],
)  # fmt: skip
def test_errors_under_json_are_one_object_on_stdout(args):
    data = assert_json_failure(run(*args))
    assert f"autofit {args[0]} --help" in data["hint"]


def usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["plan", "-m", "llama-debug", "--trials", "abc", "--json"], "'--trials'"),
        (["estimate", "--json"], "--model"),
        (["models", "--bogus", "--json"], "--bogus"),
        (["hardware", "--json", "--presets", "extra"], "extra"),
    ],
)
def test_usage_errors_under_json_are_one_object(argv, fragment, capsys):
    code, out, err = usage(argv, capsys)
    assert code == 2 and "Traceback" not in out + err
    data = json.loads(out)
    assert fragment in data["error"] and f"autofit {argv[0]} --help" in data["hint"]


def test_usage_errors_without_json_are_one_paragraph(capsys):
    code, out, err = usage(["plan", "-m", "llama-debug", "--trials", "abc"], capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: Invalid value for '--trials'")
    assert "autofit plan --help" in lines[0]


def test_main_still_runs_commands_and_exit_codes(capsys):
    code, out, _ = usage(["models", "--json"], capsys)
    assert code == 0 and json.loads(out)["models"]
    code, out, _ = usage(["--version"], capsys)
    assert code == 0 and out.startswith("autofit ")
    code, _, _ = usage([], capsys)  # no arguments: the help, exit 2 as before
    assert code == 2


# ----- 9. bracketed text survives rich -----------------------------------------------------------
def test_bracketed_text_in_errors_is_printed(tmp_path):
    result = plan_with_space_file(tmp_path, "foo: 1\n")
    assert_clean_failure(result, "knobs: {quant: [none, nf4], lora_rank: [0, 16]}")


def test_bracketed_user_text_is_printed(tmp_path):
    folder = tmp_path / "[models]" / "[bold]x"
    folder.mkdir(parents=True)
    result = run("estimate", "-m", str(folder), "-g", "2", "--device", "cpu")
    assert_clean_failure(result, f"{folder}", "has no config.json")


# ----- the LoRA settings: a bad value is one paragraph naming what is allowed, before any trial --
LORA_COMMANDS = {
    "estimate": ["estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--lora-rank", "8"],
    "trial": ["trial", "-m", "llama-debug", "-g", "2", "--device", "cpu", "--lora-rank", "8"],
    "plan": CPU_PLAN,
}
DROPOUT_RANGE = "'lora_dropout' must be a number >= 0 and < 1"
TARGETS_ALLOWED = ["q_proj,v_proj", "all-linear"]


@pytest.mark.parametrize("command", LORA_COMMANDS)
@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--lora-dropout", "1"], [DROPOUT_RANGE, "got '1'"]),
        (["--lora-dropout", "-0.1"], [DROPOUT_RANGE, "got '-0.1'"]),
        (["--lora-dropout", "lots"], [DROPOUT_RANGE, "got 'lots'"]),
        (["--lora-targets", "q_proj;v_proj"], ["'lora_targets' cannot be 'q_proj;v_proj'",
                                               *TARGETS_ALLOWED]),
        (["--lora-targets", " , "], ["'lora_targets'", "names no module", *TARGETS_ALLOWED]),
        (["--lora-targets", "all-linear,q_proj"], ["'lora_targets'", "give it alone"]),
    ],
)  # fmt: skip
def test_bad_lora_settings_are_refused_up_front(command, flags, fragments):
    assert_clean_failure(run(*LORA_COMMANDS[command], *flags), *fragments)


EMBEDDINGS_ALLOWED = ["none", "full", "tokens:N"]


@pytest.mark.parametrize("command", LORA_COMMANDS)
@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        ("all", ["'train_embeddings' cannot be 'all'", *EMBEDDINGS_ALLOWED]),
        ("tokens:0", ["'train_embeddings' cannot be 'tokens:0'", ">= 1", *EMBEDDINGS_ALLOWED]),
        # llama-debug has 1,024 tokens: the model's vocabulary bounds N
        ("tokens:5000", ["train_embeddings=tokens:5000", "vocabulary has 1,024 tokens",
                         "N <= 1024"]),
    ],
)  # fmt: skip
def test_bad_train_embeddings_are_refused_up_front(command, value, fragments):
    result = run(*LORA_COMMANDS[command], "--train-embeddings", value)
    assert_clean_failure(result, *fragments)


@pytest.mark.parametrize("command", ["estimate", "trial"])
def test_train_embeddings_of_a_full_fine_tune_is_refused(command):
    args = [a if a != "8" else "0" for a in LORA_COMMANDS[command]]  # --lora-rank 0
    result = run(*args, "--train-embeddings", "full")
    assert_clean_failure(
        result, "train_embeddings=full", "needs lora_rank > 0", "trains the embeddings and head "
        "already", "train_embeddings=none for a full fine-tune"
    )  # fmt: skip
    data = assert_json_failure(run(*args, "--train-embeddings", "tokens:4", "--json"), "LoRA")
    assert "lora_rank > 0" in data["error"]


def test_train_embeddings_for_a_space_of_full_fine_tunes_is_refused():
    result = run(*CPU_PLAN, "--train-embeddings", "full")  # tiny_space: lora_rank [0] only
    assert_clean_failure(
        result, "train_embeddings=full", "space 'tiny_space' has only full fine-tunes",
        "lora_rank: [0]", "which train them already"
    )  # fmt: skip


@pytest.mark.parametrize("command", LORA_COMMANDS)
def test_bad_lora_settings_under_json_are_one_object(command):
    result = run(*LORA_COMMANDS[command], "--lora-targets", "q proj", "--json")
    data = assert_json_failure(result, "'lora_targets' cannot be 'q proj'", *TARGETS_ALLOWED)
    assert f"autofit {command} --help" in data["hint"]


def test_bad_lora_settings_in_a_space_file_name_the_file(tmp_path):
    result = plan_with_space_file(
        tmp_path, "knobs: {lora_rank: [8]}\nlora_targets: [q_proj, [v]]\n"
    )
    assert_clean_failure(
        result, f"'lora_targets' in {tmp_path / 'space.yaml'}", "['v'] is not a module name"
    )
    result = plan_with_space_file(tmp_path, "knobs: {lora_rank: [8]}\nlora_dropout: 1.0\n")
    assert_clean_failure(
        result, f"'lora_dropout' in {tmp_path / 'space.yaml'} must be a number >= 0 and < 1"
    )
    result = plan_with_space_file(tmp_path, "knobs: {lora_rank: [8]}\ntrain_embeddings: rows\n")
    assert_clean_failure(
        result, f"'train_embeddings' in {tmp_path / 'space.yaml'} cannot be 'rows'", "tokens:N"
    )


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--inter-node-bandwidth", "400"], ["--inter-node-bandwidth '400'", "400Gb/s = 50GB/s"]),
        (["--inter-node-bandwidth", "0Gb/s"], ["must be more than 0"]),
    ],
)
def test_bad_inter_node_bandwidth_is_refused(args, fragments):
    for command in ("plan", "estimate"):
        extra = ["--no-trials"] if command == "plan" else []
        result = run(command, "-m", "llama-debug", "-g", "2x8xh100-80gb", *extra, *args)
        assert_clean_failure(result, *fragments)


def test_a_bandwidth_on_one_node_is_named_unused_once():
    result = run("estimate", "-m", "llama-debug", "-g", "1xh100-80gb",
                 "--inter-node-bandwidth", "400Gb/s")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output.count("--inter-node-bandwidth 400Gb/s is unused") == 1, result.output


def test_estimate_checks_the_knobs_before_it_reads_the_data(tmp_path):
    # counting a dataset's tokens may take minutes: a config no data can rescue is refused first
    missing = tmp_path / "lengths.txt"
    result = run("estimate", "-m", "llama-debug", "-g", "1xh100-80gb", "--quant", "nf4",
                 "--lengths", str(missing))  # fmt: skip
    assert_clean_failure(result, "quant=nf4", "LoRA")
    assert str(missing) not in result.output


def test_zero_nodes_are_refused():
    result = run("estimate", "-m", "llama-debug", "-g", "0x8xh100-80gb")
    assert_clean_failure(result, "node count", "at least 1")


# ----- issue 35, part 2 ---------------------------------------------------------------------------
def hf_params(config_path: str, layers: int) -> int:
    """The parameters of the HF model of `config_path` with `layers` decoder layers, counted by
    torch on the meta device: the outside truth of a model's size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**json.loads(Path(config_path).read_text()), "num_hidden_layers": layers}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.timeout(120)
def test_a_model_of_a_million_layers_is_estimated_without_building_them(tmp_path):
    from autofit.arch import structure_of
    from autofit.models import resolve_model

    model = write_config(tmp_path, num_hidden_layers=10**6)
    start = time.perf_counter()
    result = run("estimate", "-m", model, "-g", "2", "--device", "cpu", "--json")
    took = time.perf_counter() - start
    print(f"benchmark: estimate of 10^6 decoder layers answered in {took:.2f} s")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["fits"] is False  # 10^6 layers on 2 CPU processes
    # the parameters counted, not built: what torch counts of one layer and of two, extended
    one, two = hf_params(model, 1), hf_params(model, 2)
    assert structure_of(resolve_model(model)).n_params == one + (10**6 - 1) * (two - one)


def test_a_model_no_hardware_could_hold_is_refused_before_its_layers_are_traced(tmp_path):
    from autofit.hardware import GPU_PRESETS, MAX_GPUS

    model = write_config(tmp_path, num_hidden_layers=10**12)
    largest = max(GPU_PRESETS.values(), key=lambda p: p.memory_bytes).name
    fragments = ["too large for any hardware", "1,000,000,000,000 decoder layers", "nf4",
                 f"{MAX_GPUS:,} GPUs", largest, "num_hidden_layers"]  # fmt: skip
    for args in (["estimate", "-m", model, "-g", "2", "--device", "cpu"],
                 [*CPU_PLAN[:2], model, *CPU_PLAN[3:]]):  # fmt: skip
        result = run(*args)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        (error,) = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert all(f in error for f in fragments), error
    with pytest.raises(ModelError, match="too large for any hardware"):
        autofit.estimate(model, "2", device="cpu")


def test_export_reads_a_study_and_writes_nothing_into_the_storage(tmp_path):
    output = tmp_path / "plan.yaml"

    def export(db: Path):  # type: ignore[no-untyped-def]
        return run("export", "--storage", f"sqlite:///{db}", "--study", "s", "-o", str(output))

    empty = tmp_path / "zero.db"
    empty.write_bytes(b"")
    assert_clean_failure(export(empty), "No study named 's'", "the file is empty")
    assert empty.read_bytes() == b""  # SQLite and Optuna made a 114,688-byte database of it
    other = tmp_path / "other.db"  # someone's SQLite database, without Optuna's tables
    with sqlite3.connect(other) as db:
        db.execute("create table notes (text)")
    before = other.read_bytes()
    assert_clean_failure(export(other), "holds no Optuna study")
    assert other.read_bytes() == before
    missing = tmp_path / "missing.db"
    assert_json_failure(run("export", "--storage", f"sqlite:///{missing}", "--study", "s",
                            "-o", str(output), "--json"), "No SQLite database")  # fmt: skip
    assert not missing.exists() and not output.exists()


def test_an_export_into_a_folder_that_does_not_exist_is_refused(tmp_path):
    target = tmp_path / "nonexistent" / "dir" / "x.yaml"
    result = run(*CPU_PLAN, "--run-dir", str(tmp_path / "run"), "--export", str(target))
    assert_clean_failure(result, f"--export {target}", f"the folder {target.parent} does not exist")
    result = run("export", "--storage", "sqlite:///study.db", "--study", "s", "-o", str(target))
    assert_clean_failure(result, f"--output {target}", f"{target.parent} does not exist")
    assert not (tmp_path / "nonexistent").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_length_file_that_is_not_a_regular_file_says_so(tmp_path, kind):
    import os

    path = Path("/dev/null")
    if kind == "fifo":
        path = tmp_path / "lengths.fifo"
        os.mkfifo(path)
    result = run("estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--lengths", str(path))
    text = assert_clean_failure(result, f"{str(path)!r}", "not a regular file")
    assert "does not exist" not in text


def test_a_json_list_of_lengths_is_read_and_a_bad_one_names_the_json_forms(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([100, 300, 300, 900]))
    result = run("estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--lengths", str(path),
                 "--seq-len", "1024", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    lengths = json.loads(result.stdout)["lengths"]
    assert (lengths["examples"], lengths["median"], lengths["max"]) == (4, 300, 900)
    path.write_text(json.dumps([100, "long"]))
    result = run("estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--lengths", str(path))
    assert_clean_failure(result, "'long' is not a token count", "JSON: a list of counts")


def test_a_length_longer_than_any_seq_len_is_refused(tmp_path):
    from autofit.config import DECLARED

    longest = DECLARED["seq_len"].maximum  # the largest --seq-len accepted, as declared
    assert longest is not None
    path = tmp_path / "lengths.txt"
    path.write_text(f"300\n{10**26}\n")
    args = ["estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--lengths", str(path)]
    assert_clean_failure(run(*args), f"{path}, line 2", f"--seq-len at most {longest:,}")
    path.write_text(json.dumps({"300": 4, str(longest + 1): 1}))
    assert_clean_failure(run(*args), f"{longest + 1:,} tokens is longer")
    path.write_text(f"300\n{longest}\n")  # the longest sequence there may be: taken
    assert run(*args).exit_code == 0


def test_input_ids_that_are_not_token_ids_say_so_not_that_they_need_a_tokenizer(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": "abc"}\n')
    result = run("estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--dataset", str(data))
    text = assert_clean_failure(result, f"{data}, line 1", "'input_ids'", "list of token ids")
    assert "tokenizer: pass --tokenizer" not in text and "needs none" not in text


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_called_empty_not_a_folder(name):
    result = run("estimate", "-m", name, "-g", "2xrtx3090")
    text = assert_clean_failure(result, "model name is empty", "preset", "config.json")
    assert "folder ''" not in text and "has no config.json" not in text
    assert_json_failure(run(*CPU_PLAN[:2], name, *CPU_PLAN[3:], "--json"), "model name is empty")


def test_a_knob_given_twice_in_a_space_file_is_refused(tmp_path):
    space = tmp_path / "space.yaml"
    result = plan_with_space_file(tmp_path, "knobs:\n  quant: [none]\n  lora_rank: [0]\n"
                                            "  quant: [nf4]\n")  # fmt: skip
    assert_clean_failure(result, f"{space}", "knob 'quant' is given twice", "lines 2 and 4")
    result = plan_with_space_file(tmp_path, "seq_len: 64\nknobs: {quant: [none]}\nseq_len: 128\n")
    assert_clean_failure(result, f"{space}", "'seq_len' is given twice", "lines 1 and 3")


def test_the_max_position_warning_of_an_estimate_is_said_once():
    from autofit.models import PRESETS

    maximum = PRESETS["llama-7b"].max_position  # 4,096 positions
    result = run("estimate", "-m", "llama-7b", "-g", "1xh100-80gb", "--seq-len", str(2 * maximum))
    assert result.exit_code == 0, result.output
    assert result.stderr.count(f"is above llama-7b's maximum of {maximum}") == 1, result.stderr


def test_launch_trl_without_trl_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # a plan for TRL's SFTTrainer where TRL is not installed: one paragraph, exit 2, before the
    # space is searched (the flag or a space file's `launch: trl` alike)
    monkeypatch.setattr("autofit.rules.trl_installed", lambda: False)
    result = run("plan", "-m", "llama-debug", "-g", "1", "--device", "cpu", "--no-trials",
                 "--launch", "trl")  # fmt: skip
    assert_clean_failure(result, "TRL is not installed here", "pip install 'autofit[trl]'")
    result = run("estimate", "-m", "llama-debug", "-g", "1", "--device", "cpu", "--launch", "trl")
    assert_clean_failure(result, "TRL is not installed here")
