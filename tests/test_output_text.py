"""Output a person can read and trust (issue 25, section 3): what the CLI prints at 80 columns,
each point held to an outside truth (the card's published memory, the estimate itself, the
README's promises), never to the printing code's own output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autofit
from autofit.calibration.model import NAPKIN_MEMORY, NAPKIN_SPEED, Calibration
from autofit.calibration.sweep import CalibrationRun
from autofit.cli import app
from autofit.data import LengthHistogram
from autofit.report import calibration_report, plan_table
from autofit.report.ranked import shown_rows
from autofit.units import fmt_size
from tests.test_report_text import rendered

runner = CliRunner()
README_JOB = ["plan", "--model", "llama-7b", "--gpus", "2xrtx3090", "--no-trials"]


TINY_SPACE = Path(__file__).parent / "search" / "tiny_space.yaml"


def cli(*args: str, columns: int = 80):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), env={"COLUMNS": str(columns)})


@pytest.fixture(scope="module")
def readme_job():  # type: ignore[no-untyped-def]
    """The README's main job, printed at 80 columns, and the same plan from the API."""
    result = cli(*README_JOB)
    assert result.exit_code == 0, result.output
    plan = autofit.plan("llama-7b", gpus="2xrtx3090", trials=0)
    return result.stdout, plan


def table_rows(text: str) -> list[list[str]]:
    """The ranked table's rows: lines that start with a row number."""
    return [line.split() for line in text.splitlines() if re.match(r"^\s+\d+\s+[\d,]+\s", line)]


def test_the_readme_job_fits_80_columns_with_rows_numbered_as_shown(readme_job):
    text, plan = readme_job
    assert max(len(line) for line in text.splitlines()) <= 80
    rows = table_rows(text)
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1)) and len(rows) == 15
    # the order the notes name: fastest first, in 0.5% steps (a later row is never more than
    # 0.5% faster than the one above it)
    speeds = [int(r[1].replace(",", "")) for r in rows]
    assert all(b <= a * 1.005 for a, b in zip(speeds, speeds[1:], strict=False))
    flat = " ".join(text.split())
    assert "Order: tokens/s in steps of 0.5% (a tie); within a step, the plainest config" in flat
    # knobs no row differs in are one line, not fifteen cells: every shown row is compiled and
    # reshards (the plan itself says so); offload differs between rows, so it is in the cells
    shown = [c.config for c, _ in shown_rows(plan, 15)]
    assert {(c.compile, c.reshard) for c in shown} == {(True, True)}
    assert {c.offload for c in shown} == {"none", "params"}
    assert "Every row: shard all, reshard yes, compile yes." in flat
    assert sum("offload=params" in row for row in rows) == sum(c.offload == "params" for c in shown)


def test_one_capacity_named_once(readme_job):
    text, _ = readme_job
    # An RTX 3090 has 24 GiB; the CUDA context (767 MiB, as autofit's H200 trials measured it)
    # and one communicator (4 channels x 9.2 MiB = 36.8 MiB of buffers and NCCL's own 48 MiB)
    # lie outside the allocator: 24,576 - 851.8 = 23,724.2 MiB = 23.17 GiB for the reserved peak.
    flat = " ".join(text.split())
    assert flat.count("usable") == 1
    assert "Memory: 23.2 GiB usable per GPU (24.0 GiB less the CUDA context and NCCL" in flat
    assert flat.count("24.0 GiB") == 1  # the card, named only where usable is derived from it
    assert "peak / " not in flat


def test_a_tie_is_said_plainly_with_the_runner_up_of_the_table(readme_job):
    text, plan = readme_job
    flat = " ".join(text.split())
    assert "next config" not in flat
    m = re.search(
        r"a tie: (\d+) other config\(s\) are estimated within 0\.5% of its tokens/s", flat
    )
    assert m, flat
    assert "the tie-break puts the plainest config first, then the lower peak" in flat
    # the runner-up is the table's row 2: the next recipe, not a variant folded into row 1
    second = shown_rows(plan, 15)[1][0].config
    assert f"the runner-up '{second.short()}'" in plan.reason
    assert second != plan.best.config


def test_tokens_per_s_says_it_is_every_gpu_together(readme_job):
    text, plan = readme_job
    flat = " ".join(text.split())
    assert "tokens/s: all 2 GPUs together; peak: reserved memory per GPU." in flat
    m = re.search(r"estimated ([\d,]+) tokens/s for all 2 GPUs together \(([\d,]+) per GPU\)", flat)
    assert m, flat
    total, each = (int(g.replace(",", "")) for g in m.groups())
    assert total == round(plan.best.tokens_per_s)
    assert abs(2 * each - total) <= 1  # two GPUs share the run's tokens


def test_a_cpu_plans_notes_name_cpu_processes_not_gpus():
    # what a CPU plan's peaks and tokens/s are per and of: processes over gloo, as its hardware
    # line says ("2 CPU processes (gloo)"), not GPUs
    # the words do not depend on the space: the tests' tiny one (12 candidates, not 68,160)
    result = cli("plan", "--model", "llama-debug", "--gpus", "2", "--device", "cpu",
                 "--no-trials", "--seq-len", "64", "--gpu-memory", "1GiB",
                 "--space", str(TINY_SPACE))  # fmt: skip
    assert result.exit_code == 0, result.output
    flat = " ".join(result.stdout.split())
    assert "on 2 CPU processes (gloo)" in flat
    assert "tokens/s: all 2 CPU processes together; peak: reserved memory per CPU process." in flat
    assert "Memory: 1.0 GiB usable per CPU process; " in flat


@pytest.mark.parametrize(
    ("device", "nprocs", "whose"),
    [("cpu", 2, "for all 2 CPU processes together"), ("cuda", 1, "on 1 GPU")],
)
def test_a_calibration_sweep_line_says_whose_tokens_per_s(device, nprocs, whose):
    # `autofit calibrate` prints one line a trial: its tokens/s are the whole run's, named as
    # the plan and trial reports name them (it read "of all 2", and "of all 1" on one rank)
    from autofit.calibration.sweep import SweepTrial
    from autofit.config import Config
    from autofit.estimate import estimate
    from autofit.hardware import resolve_hardware
    from autofit.models import resolve_model
    from autofit.report import sweep_line
    from autofit.trials.result import TrialResult

    spec, cfg = resolve_model("llama-debug"), Config(seq_len=64)
    hw = (
        resolve_hardware(str(nprocs), device="cpu")
        if device == "cpu"
        else resolve_hardware("1xh100")
    )
    result = TrialResult(status="ok", config=cfg.to_dict(), model=spec.name, device=device,
                         nprocs=nprocs, peak_bytes=3 * 2**20, tokens_per_s=12_800.0)  # fmt: skip
    napkin = estimate(spec, hw, cfg, device=device)
    line = sweep_line(SweepTrial(spec.name, cfg, napkin, result))
    assert f"peak 3.0 MiB (napkin {fmt_size(napkin.peak_bytes)})  12,800 tokens/s {whose} " in line


def test_a_narrower_terminal_still_gets_the_whole_table(readme_job):
    _, plan = readme_job
    lines = rendered(lambda console: console.print(plan_table(plan)))  # 120 columns
    assert max(len(line) for line in lines) <= 120
    assert len([line for line in lines if re.match(r"^\s+\d+\s+[\d,]+\s", line)]) == 15


# ----- wrap: auto --------------------------------------------------------------------------------
def test_estimate_defaults_to_the_plain_module_on_one_gpu_and_says_so():
    one = cli("estimate", "--model", "llama-debug", "--gpus", "1xrtx3090", "--seq-len", "64")
    assert one.exit_code == 0, one.output
    flat = " ".join(one.stdout.split())
    assert "wrap=none" in flat
    assert "held as the plain module (no sharding); wrap: auto, which is none on one GPU" in flat
    two = cli("estimate", "--model", "llama-debug", "--gpus", "2xrtx3090", "--seq-len", "64")
    assert "held as FSDP2; wrap: auto, which is layer on 2 GPUs" in " ".join(two.stdout.split())
    named = cli("estimate", "--model", "llama-debug", "--gpus", "1xrtx3090", "--seq-len", "64",
                "--wrap", "layer")  # fmt: skip
    assert "held as FSDP2\n" in named.stdout and "wrap: auto" not in named.stdout


def test_wrap_auto_estimates_exactly_what_it_resolves_to():
    for gpus, wrap in (("1xrtx3090", "none"), ("2xrtx3090", "layer")):
        auto = autofit.estimate("llama-debug", gpus, seq_len=64, lora_rank=8)
        named = autofit.estimate("llama-debug", gpus, seq_len=64, lora_rank=8, wrap=wrap)
        assert auto.to_dict() == named.to_dict() and auto.config.wrap == wrap
    data = json.loads(cli("estimate", "-m", "llama-debug", "-g", "1xrtx3090", "--json").stdout)
    assert data["config"]["wrap"] == "none"


# ----- advice checked against the estimate --------------------------------------------------------
def test_estimate_advice_names_only_changes_the_estimate_says_fit():
    # Llama-2-7B fully fine-tuned on one 24 GiB card: weights, gradients and AdamW alone are
    # 16 B x 6.74e9 = 108 GB
    result = cli("estimate", "--model", "llama-7b", "--gpus", "1xrtx3090", "--seq-len", "512")
    assert result.exit_code == 0, result.output
    flat = " ".join(result.stdout.split())
    m = re.search(r"Next step, each of which fits by the estimate: (.*?)\. `autofit plan`", flat)
    assert m, flat
    for tip in m.group(1).split("; or "):
        if tip.endswith("GPUs of this kind"):
            n = int(tip.split()[0])
            assert autofit.estimate("llama-7b", f"{n}xrtx3090", seq_len=512).within_capacity
            continue
        flags = tip.removeprefix("all of ").split()
        knobs = {f[2:].replace("-", "_"): v for f, v in zip(flags[::2], flags[1::2], strict=True)}
        knobs = {k: int(v) if v.isdigit() else v for k, v in knobs.items()}
        assert autofit.estimate("llama-7b", "1xrtx3090", seq_len=512, **knobs).within_capacity
    # the chunked loss alone does not fit, by the same estimate, and is not named
    assert not autofit.estimate(
        "llama-7b", "1xrtx3090", seq_len=512, loss="chunked"
    ).within_capacity
    assert "--loss chunked" not in flat


def test_estimate_advice_on_the_datas_lengths_is_estimated_on_them(tmp_path):
    # Llama-3.1-8B fully fine-tuned on one 22.5 GiB A10G at micro-batch 4 of seq_len 4096; the
    # data's longest example is 1024 tokens, so its longest micro-batch holds a quarter of the
    # activations of 4 x 4096: NF4 with LoRA fits on the data, not at 4 x 4096 tokens
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("256\n" * 9 + "1024\n")
    knobs = {"seq_len": 4096, "micro_batch": 4, "lora_rank": 0, "checkpointing": "full"}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]
    result = cli(
        "estimate", "-m", "llama-3.1-8b", "-g", "1xa10g", *flags, "--lengths", str(lengths)
    )
    assert result.exit_code == 0, result.output
    flat = " ".join(result.stdout.split())
    assert "Next step, each of which fits by the estimate: --quant nf4 --lora-rank 16." in flat
    data = LengthHistogram.of([256] * 9 + [1024])
    nf4 = {**knobs, "quant": "nf4", "lora_rank": 16}
    assert autofit.estimate("llama-3.1-8b", "1xa10g", lengths=data, **nf4).within_capacity
    assert not autofit.estimate("llama-3.1-8b", "1xa10g", **nf4).within_capacity


def test_at_one_mib_nothing_is_proposed_and_it_says_why():
    est = cli("estimate", "--model", "llama-debug", "--gpus", "1xrtx3090", "--gpu-memory", "1MiB")
    flat = " ".join(est.stdout.split())
    assert "does not fit" in flat
    assert "Nothing can fit" in flat and "CUDA context 767.0 MiB" in flat
    assert "nf4" not in flat and "--offload" not in flat
    plan = cli("plan", "--model", "llama-debug", "--gpus", "1xrtx3090", "--gpu-memory", "1MiB",
               "--no-trials", "--space", "qlora", "--seq-len", "64")  # fmt: skip
    assert plan.exit_code == 1
    flat = " ".join(plan.stdout.split())
    assert "No config fits. Nothing can fit" in flat and "offload" not in flat.split("fits.")[-1]


def test_trial_and_calibrate_never_advise_no_trials(no_driver):
    trial = cli("trial", "--model", "llama-debug", "--gpus", "2xrtx3090")
    assert trial.exit_code == 2 and "--no-trials" not in trial.output
    assert "`autofit estimate` takes hardware you do not have" in " ".join(trial.output.split())
    auto = cli("calibrate", "--gpus", "auto")
    assert auto.exit_code == 2 and "--no-trials" not in auto.output
    many = cli("trial", "--model", "llama-debug", "--gpus", "512", "--device", "cpu")
    assert many.exit_code == 2 and "--no-trials" not in many.output


def test_calibrate_refuses_a_what_if_preset_before_running_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CALIBRATION_DIR", str(tmp_path))
    for args in (["--gpus", "2xrtx3090"], ["--gpus", "2xrtx3090", "--device", "cpu"]):
        result = cli("calibrate", *args)
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        text = " ".join(result.output.split())
        assert text.startswith("error: --gpus 2xrtx3090 names what-if hardware (a preset)")
        assert "Traceback" not in text and "Calibrating" not in text
        assert len(" ".join(lines)) == len(text)  # one paragraph (rich wraps it, nothing more)
    data = json.loads(cli("calibrate", "--gpus", "2xrtx3090", "--device", "cpu", "--json").stdout)
    assert "what-if hardware" in data["error"]
    assert not list(tmp_path.iterdir())  # nothing stored


def test_calibrate_lists_only_what_the_calibration_moved():
    memory = dict(NAPKIN_MEMORY)
    moved = sorted(memory)[0]
    memory[moved] = 1.25
    cal = Calibration(memory=memory, speed=dict(NAPKIN_SPEED), source="stored", n_trials=6)
    machine = {"gpus": "2x cpu", "link": "gloo", "torch": "2.13", "torchao": "0.1"}
    run = CalibrationRun(machine=machine, calibration=cal, path="/cache/calibration.json")
    text = " ".join(rendered(lambda console: calibration_report(console, run)))
    assert f"moved from the napkin: memory {moved} x1.25; speed nothing" in text
    for name in [*NAPKIN_MEMORY, *NAPKIN_SPEED]:
        if name != moved:
            assert f"{name} x" not in text and f"{name} +" not in text


@pytest.mark.slow
def test_a_trial_on_one_process_runs_the_plain_module_by_default():
    """`autofit trial` with no --wrap on one rank measures the plain module (what one-GPU
    recipes run), not FSDP2 on a one-rank mesh, and says it chose it."""
    result = cli("trial", "-m", "llama-debug", "-g", "1", "--device", "cpu", "--seq-len", "32",
                 "--steps", "1", "--lora-rank", "8")  # fmt: skip
    assert result.exit_code == 0, result.output
    flat = " ".join(result.stdout.split())
    assert "trial ok: llama-debug on 1 x cpu, the plain module (no sharding); wrap: auto" in flat
    assert "which is none on one CPU process" in flat
    assert re.search(r"[\d,]+ tokens/s on 1 CPU process; step", flat), flat


def test_a_plan_file_that_says_wrap_auto_is_read_as_what_it_stands_for(tmp_path):
    from autofit.export import load_plan

    space = tmp_path / "space.yaml"
    space.write_text("knobs: {micro_batch: [1], wrap: [layer]}\n")
    plan = autofit.plan("llama-debug", "2", device="cpu", seq_len=64, trials=0, space=space)
    path = tmp_path / "plan.yaml"
    plan.export("autofit", path)
    path.write_text(path.read_text().replace("wrap: layer", "wrap: auto"))
    loaded = load_plan(path)
    assert loaded.best.config.wrap == "layer"  # FSDP2 on its 2 processes
    written = loaded.export("accelerate", tmp_path / "accelerate.yaml")
    assert "distributed_type: FSDP" in written[0].read_text()
