"""What a person reads (issue 8, points 7 and 10): sizes in the unit their magnitude needs, one
trial numbering in lines, table and plot, `over line` for a run above the headroom line, counts
that add up to the combinations considered, the CPU hardware name, a launch command that names
no missing file and no CUDA setting on CPU, knob flags with allowed values and defaults, the two
timeouts named apart, and advice that says what really happened. No real trials: the search runs
with fakes that return `TrialResult`s."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from autofit import report
from autofit.cli import app
from autofit.config import Config
from autofit.estimate import estimate
from autofit.export import example_script, launch_command, launch_note
from autofit.hardware import resolve_hardware
from autofit.models import resolve_model
from autofit.plan import Candidate, plan_estimates, trial_status
from autofit.report.live import SearchDisplay, trial_line
from autofit.report.plot import trials_figure
from autofit.request import PlanRequest
from autofit.search import search
from autofit.search.advice import no_winner_advice
from autofit.search.candidates import Setting, enumerate_candidates
from autofit.space_file import load_space, parse_space
from autofit.trials import TrialResult
from autofit.units import GB, GiB, MiB, fmt_bytes, fmt_size, size_unit

from .search.conftest import TINY_SPACE, FakeTrials, tiny_search_kwargs, wide_space

runner = CliRunner()


# ----- sizes --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "text"),
    [
        (30 * MiB, "30.0 MiB"),
        (GiB // 2, "512.0 MiB"),
        (24 * GiB, "24.0 GiB"),
        (int(21.7 * MiB), "21.7 MiB"),
        (1536, "1.5 KiB"),
        (512, "512 B"),
        (0, "0 B"),
        (5 * 1024**4 // 2, "2.5 TiB"),
        (1023.97 * MiB, "1.0 GiB"),  # rounds up into the next unit, never "1024.0 MiB"
        (None, "-"),
    ],
)
def test_sizes_print_in_the_unit_their_magnitude_needs(n, text):
    assert fmt_size(n) == text


def test_the_old_size_helpers_print_through_the_same_function():
    assert fmt_bytes(30 * MiB) == "30.0 MiB"  # was "0.0 GiB"
    assert fmt_bytes(80 * GB, "GB") == "80.0 GB"  # an explicit unit still wins
    assert size_unit(56 * MiB) == ("MiB", MiB)


def test_a_small_cpu_trial_reports_its_peak_in_mib(tmp_path):
    result = TrialResult(status="ok", config=Config().to_dict(), model="llama-debug",
                         device="cpu", nprocs=1, peak_bytes=int(21.7 * MiB),
                         peak_allocated_bytes=20 * MiB, build_peak_bytes=13 * MiB,
                         tokens_per_s=900.0, step_time_s=0.07, losses=[7.0, 6.0],
                         capacity_bytes=64 * GiB)  # fmt: skip
    console = Console(record=True, width=200)
    report.trial_report(console, result)
    text = console.export_text()
    assert "peak 21.7 MiB reserved (20.0 MiB allocated)" in text
    assert "build peak 13.0 MiB" in text
    assert "0.0 GiB" not in text


# ----- hardware name ------------------------------------------------------------------------------
def test_cpu_hardware_reads_as_cpu_processes_without_a_gpu_link():
    assert resolve_hardware("2", device="cpu").describe() == "2 CPU processes (gloo)"
    assert resolve_hardware("1", device="cpu").describe() == "1 CPU process (gloo)"
    assert resolve_hardware("2xrtx3090").describe() == "2x NVIDIA GeForce RTX 3090 (pcie)"


# ----- search fixtures ----------------------------------------------------------------------------
def tiny_kwargs(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    """llama-debug on 2 CPU processes held to 56 MiB, the 12-candidate tiny space."""
    return tiny_search_kwargs(tmp_path, **changes)


def tiny_setting(kw: dict[str, Any]) -> Setting:
    return Setting(kw["model"], kw["hardware"], kw["space"], kw["seq_len"], None, 0.05, "cpu")


def failing(status: str, message: str, wall_s: float = 0.0) -> Any:
    """A trial runner whose every trial ends with `status` (no processes)."""

    def run_trial(model: Any, config: Config, **_: Any) -> TrialResult:
        return TrialResult(status=status, config=config.to_dict(), model=model.name,
                           device="cpu", nprocs=2, message=message, wall_s=wall_s)  # fmt: skip

    return run_trial


def over_line_for_unsharded(fake: FakeTrials) -> Any:
    """The fake runner, with unsharded (wrap=none) runs finishing at 55 MiB: over the 53.2 MiB
    headroom line, under the 56 MiB capacity."""

    def run_trial(*args: Any, **kwargs: Any) -> TrialResult:
        result = fake(*args, **kwargs)
        if result.status == "ok" and args[1].wrap == "none":
            result.peak_bytes = 55 * MiB
        return result

    return run_trial


# ----- counts add up ------------------------------------------------------------------------------
def test_an_estimate_plans_counts_add_up_to_the_combinations_considered():
    # 2 quant x 2 lora ranks x 2 micro-batches = 8 combinations; nf4 with rank 0 breaks a rule
    # (2 of them); the other 6 fit a 2-process CPU run of llama-debug with 8 GiB each.
    space = parse_space({"seq_len": 64, "knobs": {"quant": ["none", "nf4"], "lora_rank": [0, 8],
                         "micro_batch": [1, 2]}}, "counts", name="counts")  # fmt: skip
    hw = resolve_hardware("2", device="cpu", gpu_memory=8 * GiB)
    plan = plan_estimates(PlanRequest.of(resolve_model("llama-debug"), hw, space, device="cpu"))
    rows = {what: n for what, n, _ in plan.tally()}
    assert plan.considered == 8
    assert rows == {
        "fit (estimated)": 6,
        "ruled out by the estimate": 0,
        "invalid (break a rule of the space or --global-batch)": 2,
    }
    lines = report.pruned_lines(plan)
    assert lines[0] == "8 combinations considered:"
    assert any(re.fullmatch(r"\s+2\s+quant needs LoRA", line) for line in lines)


def test_a_big_estimate_plans_counts_add_up_too():
    plan = plan_estimates(PlanRequest.of(resolve_model("llama-7b"), resolve_hardware("2xrtx3090"),
                          load_space("default")))  # fmt: skip
    tally = plan.tally()
    assert sum(n for _, n, _ in tally) == plan.considered == 155_520  # 25,920 x 3 losses x 2
    for _, n, reasons in tally:  # each row is the sum of its reasons
        assert not reasons or n == sum(k for _, k in reasons)
    assert plan.to_dict()["tally"]["fit (estimated)"] == len(plan.ranked)


def test_a_search_plans_counts_add_up_to_the_combinations_considered(tmp_path):
    fake = FakeTrials()
    kw = tiny_kwargs(tmp_path, space=wide_space(), trials=6, calibration="off")
    plan = search(run_trial=over_line_for_unsharded(fake), **kw)
    rows = {what: n for what, n, _ in plan.tally()}
    assert plan.considered == 64  # 2 x 4 x 2 x 2 x 2 knob values, no rule broken
    assert sum(rows.values()) == 64
    measured = len({c.config for c in plan.trials})
    assert measured == 6
    assert (
        rows["fit (measured under the headroom line)"]
        + rows.get("ran, but peaked over the headroom line", 0)
        == measured
    )
    cands = enumerate_candidates(tiny_setting(kw))
    assert rows["not tried (may fit; the trial budget or the search time ran out)"] == (
        len(cands.trialable) - measured
    )
    assert rows["ruled out by the estimate"] == len(cands.pruned)
    text = "\n".join(report.pruned_lines(plan))
    assert "64 combinations considered:" in text and " pruned:" not in text


# ----- one trial numbering, `over line` -----------------------------------------------------------
def test_progress_lines_table_and_plot_number_trials_alike_and_say_over_line(tmp_path):
    fake = FakeTrials()
    console = Console(record=True, width=250)
    kw = tiny_kwargs(tmp_path, space=wide_space(), trials=6, calibration="off")
    plan = search(run_trial=over_line_for_unsharded(fake), listener=SearchDisplay(console), **kw)
    progress = console.export_text()
    line_numbers = [int(m) for m in re.findall(r"^#(\d+)\s", progress, flags=re.M)]
    numbers = [c.number for c in plan.trials]
    assert line_numbers == numbers and None not in numbers

    table = Console(record=True, width=250)
    table.print(report.trials_table(plan))
    row = r"^\s*(\d+)\s+(ok|over line|oom|timeout|error)\s"
    rows = [line for line in table.export_text().splitlines() if re.match(row, line)]
    assert [int(row.split()[0]) for row in rows] == numbers

    over = [c for c in plan.trials if c.config.wrap == "none"]
    assert over, "the fake must put an unsharded run over the line"
    over_numbers = {c.number for c in over}
    for line in progress.splitlines():
        m = re.match(r"#(\d+)\s+(ok|over line)\s", line)
        if m:
            assert (m.group(2) == "over line") is (int(m.group(1)) in over_numbers), line
    for row in rows:
        assert ("over line" in row) is (int(row.split()[0]) in over_numbers), row

    fig = trials_figure(plan, plan.allowed_bytes)
    peaks, speeds = fig.axes
    legend = [t.get_text() for t in peaks.get_legend().get_texts()]
    assert "measured peak over the headroom line" in legend
    assert "measured peak (under the line)" in legend
    ticks = [t.get_text() for t in speeds.get_xticklabels()]
    assert [int(t.split()[0].lstrip("#")) for t in ticks] == numbers


def test_trial_status_and_line_for_a_run_above_the_headroom_line():
    model = resolve_model("llama-debug")
    hw = resolve_hardware("2", device="cpu", gpu_memory=56 * MiB)
    cfg = Config(micro_batch=2, seq_len=64)
    cand = Candidate(cfg, estimate(model, hw, cfg, device="cpu"))
    line = 53 * MiB
    above = TrialResult(status="ok", config=cfg.to_dict(), model="llama-debug",
                        peak_bytes=55 * MiB, tokens_per_s=1000.0)  # fmt: skip
    under = TrialResult(status="ok", config=cfg.to_dict(), model="llama-debug",
                        peak_bytes=50 * MiB, tokens_per_s=1000.0)  # fmt: skip
    assert trial_status(above, line) == "over line"
    assert trial_status(under, line) == "ok"
    assert trial_status(TrialResult(status="oom", config={}, model="x"), line) == "oom"
    text = trial_line(7, cand, above, line)
    assert text.startswith("#7 ") and "over line" in text and "peak 55.0 MiB" in text
    assert "line 53.0 MiB" in text


# ----- advice: what really happened ---------------------------------------------------------------
def test_timed_out_trials_name_trial_timeout_and_its_value(tmp_path):
    kw = tiny_kwargs(tmp_path)
    cands = enumerate_candidates(tiny_setting(kw))
    trials = [
        Candidate(
            c.config,
            c.estimate,
            TrialResult(
                status="timeout",
                config=c.config.to_dict(),
                model="llama-debug",
                message="The trial ran past its limit of 45 s and was killed.",
                wall_s=45.3,
            ),
            number=i,
        )  # fmt: skip
        for i, c in enumerate(cands.trialable)
    ]
    advice = no_winner_advice(cands.setting, cands, trials, trials=20, trial_timeout=45)
    assert "timed out (after up to 45 s: --trial-timeout 45 s)" in advice
    assert "longer with --trial-timeout (e.g. --trial-timeout 91)" in advice
    assert "--global-batch" not in advice
    # without --trial-timeout each trial had its own limit from its estimate: said so
    advice = no_winner_advice(cands.setting, cands, trials)
    assert "its own limit, 3x the time its estimate expected + 30 s" in advice
    assert "--trial-timeout (e.g. --trial-timeout 91)" in advice


def test_failed_trials_quote_the_first_errors_first_line(tmp_path):
    kw = tiny_kwargs(tmp_path)
    cands = enumerate_candidates(tiny_setting(kw))
    messages = ["rank 1: ValueError: bad shape\nTraceback (most recent call last):\n  ...",
                "rank 0: RuntimeError: second"]  # fmt: skip
    trials = [
        Candidate(c.config, c.estimate,
                  TrialResult(status="error", config=c.config.to_dict(), model="x", message=m))
        for c, m in zip(cands.trialable, messages, strict=False)
    ]  # fmt: skip
    advice = no_winner_advice(cands.setting, cands, trials, trials=2)
    assert "rank 1: ValueError: bad shape" in advice
    assert "Traceback" not in advice and "second" not in advice
    assert "--global-batch" not in advice
    assert "raise --trials" in advice  # 4 candidates were left untried by the budget of 2


def test_a_search_of_timeouts_says_so(tmp_path):
    kw = tiny_kwargs(tmp_path, trials=2, trial_timeout=30)
    msg = "The trial ran past its limit of 30 s and was killed."
    plan = search(run_trial=failing("timeout", msg, 30.1), **kw)
    assert plan.best is None
    assert plan.advice.startswith("2 trials ran (2 timeout)")
    assert "--trial-timeout 60" in plan.advice and "--global-batch" not in plan.advice


def test_no_time_for_a_trial_names_the_search_timeout(tmp_path):
    fake = FakeTrials()
    plan = search(run_trial=fake, **tiny_kwargs(tmp_path, timeout=0))
    assert fake.calls == [] and plan.best is None
    assert "No trial ran within the search time limit (--search-timeout 0 s)" in plan.advice
    assert "Raise --search-timeout" in plan.advice
    assert "--global-batch" not in plan.advice


def test_all_pruned_by_the_estimate_names_the_bound_not_the_global_batch(tmp_path):
    fake = FakeTrials()
    hw = resolve_hardware("2", device="cpu", gpu_memory=8 * MiB)
    plan = search(run_trial=fake, **tiny_kwargs(tmp_path, hardware=hw, gpu_memory=8 * MiB))
    assert fake.calls == [] and plan.best is None
    assert "Nearest" in plan.advice and "bound by CPU process memory" in plan.advice
    assert "--global-batch" not in plan.advice
    rows = {what: n for what, n, _ in plan.tally()}
    assert rows["ruled out by the estimate"] == plan.considered == 12


def test_the_global_batch_hint_only_when_the_global_batch_rules_out_everything():
    model, hw = resolve_model("llama-7b"), resolve_hardware("2xrtx3090")
    plan = plan_estimates(PlanRequest.of(model, hw, load_space("qlora"), global_batch=7))
    assert plan.best is None
    assert plan.advice.startswith("--global-batch 7 rules out every candidate")
    assert "--global-batch 32" in plan.advice  # a multiple of every micro_batch (1..16) x 2 GPUs
    # a space whose combinations all break a rule, no global batch: the rule, not the batch
    space = parse_space({"knobs": {"quant": ["nf4"], "lora_rank": [0]}}, "bad", name="bad")
    plan = plan_estimates(PlanRequest.of(model, hw, space))
    assert plan.best is None
    assert "quant needs LoRA" in plan.advice and "--global-batch" not in plan.advice


# ----- launch command -----------------------------------------------------------------------------
def test_a_cpu_plans_launch_command_sets_no_cuda_variable_and_names_real_files(tmp_path):
    hw = resolve_hardware("2", device="cpu", gpu_memory=64 * MiB)
    plan = plan_estimates(
        PlanRequest.of(resolve_model("llama-debug"), hw, load_space(TINY_SPACE), device="cpu")
    )
    (path,) = plan.export("autofit", tmp_path / "plan.yaml")
    cmd = launch_command(plan, "autofit", path)
    assert "CUDA" not in cmd and "train.py --plan" not in cmd.replace("<your_train.py>", "")
    assert cmd.startswith("torchrun --nproc-per-node 2 <your_train.py> --plan ")
    note = launch_note(plan, "autofit", path)
    assert "CUDA" not in note and "--device cuda" not in note
    script = example_script("autofit")
    assert script is not None and script.is_file() and script.name == "train_with_plan.py"
    assert "train_with_plan.py" in note and f"--plan {path}" in note
    assert "expandable_segments" not in path.read_text()  # the plan's header says nothing of it


def test_a_gpu_plans_launch_command_keeps_the_allocator_setting(tmp_path):
    plan = plan_estimates(PlanRequest.of(resolve_model("llama-7b"), resolve_hardware("2xrtx3090"),
                          load_space("qlora")))  # fmt: skip
    cmd = launch_command(plan, "autofit", tmp_path / "plan.yaml")
    assert cmd.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun")
    assert "<your_train.py>" in cmd
    assert "--device cuda" in launch_note(plan, "autofit", tmp_path / "plan.yaml")
    note = launch_note(plan, "accelerate", tmp_path / "acc.yaml")
    assert "accelerate_train.py" in note and "acc.autofit.yaml" in note


def test_a_format_named_in_capitals_launches_as_its_export_was_written(tmp_path):
    # `--format Accelerate` writes an Accelerate config (the format's case does not matter), so
    # its launch line is `accelerate launch`, not torchrun pointing --plan at that config
    plan = plan_estimates(PlanRequest.of(resolve_model("llama-7b"), resolve_hardware("2xrtx3090"),
                          load_space("qlora")))  # fmt: skip
    acc = tmp_path / "acc.yaml"
    cmd = launch_command(plan, " Accelerate", acc)
    assert "accelerate launch --config_file " + str(acc) in cmd and "torchrun" not in cmd
    assert cmd == launch_command(plan, "accelerate", acc)
    assert launch_note(plan, "Accelerate", acc) == launch_note(plan, "accelerate", acc)


def test_the_cli_prints_the_launch_command_and_what_the_script_is(tmp_path):
    out = tmp_path / "plan.yaml"
    result = runner.invoke(app, ["plan", "-m", "llama-debug", "-g", "2", "--device", "cpu",
                                 "--gpu-memory", "64MiB", "--seq-len", "64", "--no-trials",
                                 "--space", str(TINY_SPACE), "--export", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "launch: torchrun --nproc-per-node 2 <your_train.py> --plan" in result.output
    assert "<your_train.py> is your training script" in result.output
    assert "CUDA" not in result.output
    assert "2 CPU processes (gloo)" in result.output and "(pcie)" not in result.output


def test_the_cli_prints_each_nodes_and_the_slurm_launch_of_a_two_node_plan(tmp_path):
    space = tmp_path / "hsdp.yaml"
    space.write_text("seq_len: 64\nknobs: {micro_batch: [2], wrap: [layer], shard: [node]}\n")
    out = tmp_path / "plan.yaml"
    args = ["plan", "-m", "llama-debug", "-g", "2x8xh100-80gb", "--seq-len", "64", "--no-trials"]
    result = runner.invoke(app, [*args, "--space", str(space), "--export", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "launch (on each of the 2 nodes; MASTER_ADDR: node 0's address" in text
    assert "torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d" in text
    assert "launch (under SLURM, from the batch script: one task per node): " in text
    assert "srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 torchrun" in text


# ----- --help and the two timeouts ----------------------------------------------------------------
def test_knob_flags_list_their_allowed_values_and_defaults():
    result = runner.invoke(app, ["estimate", "--help"], env={"COLUMNS": "400"})
    text = " ".join(result.output.split())
    assert "Allowed: none, int8, nf4. Default: none." in text
    assert "Allowed: auto, layer, every-2, every-4, model, none. Default: auto." in text
    assert "Allowed: true, false. Default: true." in text
    assert "Allowed: a whole number from 0 to 4,096. Default: 0." in text  # --lora-rank
    assert "Allowed: adamw, adamw8bit, adamw4bit. Default: adamw." in text


def test_plan_and_trial_name_their_timeouts_apart():
    plan_help = runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "400"}).output
    trial_help = runner.invoke(app, ["trial", "--help"], env={"COLUMNS": "400"}).output
    assert "--search-timeout" in plan_help and "--trial-timeout" in plan_help
    assert "--trial-timeout" in trial_help
    assert not re.search(r"--timeout\b", plan_help) and not re.search(r"--timeout\b", trial_help)


def test_the_old_timeout_flags_still_work(monkeypatch):
    import autofit

    seen: dict[str, Any] = {}

    def fake_trial(*args: Any, trial_timeout: float, **kwargs: Any) -> TrialResult:
        seen["timeout"] = trial_timeout
        return TrialResult(status="ok", config=Config().to_dict(), model="llama-debug",
                           peak_bytes=MiB, tokens_per_s=1.0, step_time_s=1.0)  # fmt: skip

    monkeypatch.setattr(autofit, "trial", fake_trial)
    args = ["trial", "-m", "llama-debug", "-g", "1", "--device", "cpu"]
    assert runner.invoke(app, [*args, "--trial-timeout", "12"]).exit_code == 0
    assert seen["timeout"] == 12
    result = runner.invoke(app, [*args, "--timeout", "34"])
    assert result.exit_code == 0 and seen["timeout"] == 34
    assert "--timeout is now --trial-timeout" in result.output

    def fake_plan(*args: Any, timeout: float | None, **kwargs: Any) -> Any:
        seen["search"] = timeout
        hw = resolve_hardware("2xrtx3090")
        return plan_estimates(PlanRequest.of(resolve_model("llama-7b"), hw, load_space("qlora")))

    monkeypatch.setattr(autofit, "plan", fake_plan)
    base = ["plan", "-m", "llama-7b", "-g", "2xrtx3090", "--trials", "1"]
    assert runner.invoke(app, [*base, "--search-timeout", "5"]).exit_code == 0
    assert seen["search"] == 5
    result = runner.invoke(app, [*base, "--timeout", "7"])
    assert result.exit_code == 0 and seen["search"] == 7
    assert "--timeout is now --search-timeout" in result.output


# ----- issue 35, part 2: the width, whole names, one device noun, one knob, no waiting trial -----
@pytest.mark.parametrize("columns", ["0", "-5", "abc", "100000000"])
def test_a_width_no_terminal_has_prints_at_80_columns(columns):
    result = runner.invoke(app, ["models"], env={"COLUMNS": columns})
    assert result.exit_code == 0 and "Model presets" in result.output, result.output
    assert max(len(line) for line in result.output.splitlines()) == 80
    bad = runner.invoke(app, ["estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--quant", "x"],
                        env={"COLUMNS": columns})  # fmt: skip
    assert bad.exit_code == 2 and "Knob 'quant' cannot be 'x'" in bad.output, bad.output


@pytest.mark.slow
def test_columns_0_in_a_new_process_still_prints(tmp_path):
    """rich reads COLUMNS when a console is made: at import, in a process started with it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "0"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "autofit.cli", *args], env=env, text=True,
                              capture_output=True, timeout=120, cwd=tmp_path)  # fmt: skip

    models = cli("models")
    assert models.returncode == 0 and "Model presets" in models.stdout, models
    assert max(len(line) for line in models.stdout.splitlines()) == 80
    bad = cli("estimate", "-m", "llama-debug", "-g", "2xrtx3090", "--quant", "x")
    assert bad.returncode == 2 and "Knob 'quant' cannot be 'x'" in bad.stderr, bad


def whole(name: str, text: str) -> bool:
    """`name` appears in `text` as itself, not cut (`llama…`) nor as part of a longer name."""
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.…-])", text) is not None


def test_at_80_columns_every_name_a_user_types_is_printed_whole():
    import typer

    from autofit.hardware import GPU_PRESETS
    from autofit.models import PRESETS

    env = {"COLUMNS": "80"}
    models = runner.invoke(app, ["models"], env=env).output
    presets = runner.invoke(app, ["hardware", "--presets"], env=env).output
    assert [n for n in PRESETS if not whole(n, models)] == []
    assert [n for n in GPU_PRESETS if not whole(n, presets)] == []
    for command in typer.main.get_command(app).commands.values():  # type: ignore[attr-defined]
        text = runner.invoke(app, [command.name, "--help"], env=env).output
        shown = [p for p in command.params if not getattr(p, "hidden", False)]
        names = [o for p in shown for o in (*p.opts, *p.secondary_opts)]
        assert [n for n in names if not whole(n, text)] == [], (command.name, text)
        assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in models + presets
    assert max(len(line) for line in (models + presets).splitlines()) <= 80


def test_a_cpu_run_says_per_cpu_process_never_per_gpu(tmp_path):
    args = ["-m", "llama-debug", "-g", "2", "--device", "cpu", "--seq-len", "64"]
    estimated = runner.invoke(app, ["estimate", *args]).output
    planned = runner.invoke(app, ["plan", *args, "--no-trials", "--space", str(TINY_SPACE)]).output
    result = TrialResult(status="ok", config=Config().to_dict(), model="llama-debug",
                         device="cpu", nprocs=2, peak_bytes=21 * MiB, peak_allocated_bytes=20 * MiB,
                         build_peak_bytes=MiB, tokens_per_s=900.0, step_time_s=0.07)  # fmt: skip
    console = Console(record=True, width=200)
    report.trial_report(console, result)
    for text in (estimated, planned, console.export_text()):
        flat = " ".join(text.split())
        assert "per CPU process" in flat and "GPU" not in flat.replace("--gpu", ""), flat


def test_a_bad_knob_in_a_space_file_names_the_knob_once(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  quant: [nf5]\n")
    result = runner.invoke(app, ["plan", "-m", "llama-debug", "-g", "2xrtx3090", "--no-trials",
                                 "--space", str(space)])  # fmt: skip
    assert result.exit_code == 2
    assert f"Knob 'quant' in {space} cannot be 'nf5'" in result.output, result.output
    assert result.output.lower().count("knob 'quant'") == 1


@pytest.mark.parametrize(
    ("changes", "space"),
    [({"trials": 2}, None), ({"trials": 2}, wide_space()),
     ({"trials": 20, "calibration": "off", "timeout": 0}, wide_space())],
)  # fmt: skip
def test_a_finished_search_leaves_no_trial_waiting_in_its_study(tmp_path, changes, space):
    import optuna

    kw = tiny_kwargs(tmp_path, **changes, **({"space": space} if space else {}))
    plan = search(run_trial=FakeTrials(), **kw)
    storage = f"sqlite:///{tmp_path / 'run' / 'study.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs.get("enqueued") for t in waiting] == []
    if changes["trials"] == 2:
        assert plan.best is not None
