"""What the user watches during a search: a progress bar over trials and one line per trial, from
the events the search reports (`autofit.search.events`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autofit.plan import Candidate, Outcome, trial_status
from autofit.report.style import OUTCOME_STYLE
from autofit.trials.budget import TrialTime
from autofit.trials.result import TrialResult
from autofit.units import all_together, device_noun, fmt_size

if TYPE_CHECKING:
    from autofit.search.candidates import Candidates, Setting


class SearchDisplay:
    """The `autofit.search.events.SearchListener` people watch: progress over real trials and a
    line per finished one; silent when `console` is None."""

    def __init__(self, console: Console | None) -> None:
        self.console = console
        self.allowed = 0.0
        self.progress: Progress | None = None
        self.task: Any = None
        self.running = ""  # the config of the trial that runs now

    def begin(self, total: int, done: int, allowed: float) -> None:
        self.allowed = allowed
        if self.console is not None:
            self.progress = Progress(
                TextColumn("[bold]trials"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=self.console,
                transient=True,
            )
            self.progress.start()
            self.task = self.progress.add_task("", total=total, completed=done)

    def end(self) -> None:
        if self.progress is not None:
            self.progress.stop()

    def intro(
        self, setting: Setting, cands: Candidates, name: str, url: str, folder: Path, done: int
    ) -> None:
        s, n = setting, setting.hardware.n_gpus
        skipped = sum(cands.counts.values())
        self.say(
            f"[bold]{escape(s.model.name)}[/] on {s.hardware.describe()}: {cands.considered:,} "
            "combinations, "
            f"{len(cands.trialable):,} may fit, {skipped:,} ruled out without a trial; headroom "
            f"line {fmt_size(s.allowed_bytes)} per {device_noun(s.device)}"
            + (f"; tokens/s: {all_together(n, s.device)}." if n > 1 else ".")
        )
        self.say(calibration_line(cands, s.calibration))
        resumed = f", resuming with {done} trial(s) done" if done else ""
        self.say(
            f"study [bold]{escape(name)}[/] in {escape(url)}{resumed}; run folder "
            f"{escape(str(folder))}"
        )

    def note(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, soft_wrap=True, highlight=False, markup=False)

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, soft_wrap=True, highlight=False)

    def started(self, cand: Candidate, timing: TrialTime) -> None:
        self.running = f"{cand.config.short()} (~{timing.expected_s:.0f} s)"
        if self.progress is not None:
            self.progress.update(self.task, description=f"running {self.running}")

    def trial_progress(self, info: dict[str, Any]) -> None:
        """What the running trial's rank 0 says it does: building, warm-up or step k of n."""
        if self.progress is None:
            return
        phase, step, steps = info.get("phase"), info.get("step", 0), info.get("steps", 0)
        doing = {"build": "building the model", "warmup": "warm-up step"}.get(
            str(phase), f"step {step}/{steps}"
        )
        self.progress.update(self.task, description=f"running {self.running}: {doing}")

    def waiting(self, device: str, holder: str) -> None:
        """Another trial on this host holds a device this one needs."""
        who = f" ({holder})" if holder else ""
        self.say(f"waiting for {device}: another trial on this host is using it{who} ...")

    def finished(self, number: int, cand: Candidate, result: TrialResult) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)
            self.progress.update(self.task, description="")
        self.say(trial_line(number, cand, result, self.allowed))

    def verifying(self, cand: Candidate, steps: int) -> None:
        self.say(f"verifying the best: {cand.config.short()} with {steps} steps ...")

    def verified(self, cand: Candidate, result: TrialResult, ok: bool) -> None:
        verdict = "[green]holds[/]" if ok else "[red]failed[/]"
        peak = fmt_size(result.peak_bytes)
        speed = f"{result.tokens_per_s:,.0f} tokens/s" if result.tokens_per_s else result.status
        self.say(f"  verification {verdict}: peak {peak}, {speed}")


def trial_line(number: int, cand: Candidate, result: TrialResult, allowed: float) -> str:
    """`#3   ok        full mb8x1 wrap=layer  peak 50.8 MiB (est 49.9 MiB) / line 53.2 MiB ...`;
    `number` is the Optuna trial number, the one the final table shows; a run that peaked above
    the headroom line reads `over line`."""
    status = trial_status(result, allowed)
    style = OUTCOME_STYLE.get(status, "red")
    est = cand.estimate
    peak = (
        f"peak {fmt_size(result.peak_bytes)} (est {fmt_size(est.peak_bytes)})"
        if result.peak_bytes
        else f"est peak {fmt_size(est.peak_bytes)}"
    )
    speed = (
        f"{result.tokens_per_s:,.0f} tokens/s (est {est.tokens_per_s:,.0f})"
        if result.measured and result.tokens_per_s
        else (result.message.splitlines()[0][:80] if result.message else "")
    )
    if result.status == Outcome.SLOW:
        speed += " (stopped: a step far past its estimate)"
    line = fmt_size(allowed)
    return (
        f"#{number:<3} [{style}]{status:<9}[/] {cand.config.short():<40} "
        f"{peak} / line {line}  {speed}"
    )


def calibration_line(cands: Candidates, mode: str) -> str:
    """What the search starts from: the napkin, this machine's stored calibration, or a resumed
    study's own."""
    cal = cands.calibration
    if mode == "off":
        return "calibration off: the napkin alone judges and orders candidates"
    if cal.source == "none":
        where = " (none stored for this machine yet)" if mode == "auto" else ""
        return f"starting from the napkin{where}; every trial calibrates the estimate"
    err = (
        f"; its measured error: memory {cal.memory_band:.1%}, speed {cal.speed_band:.1%}"
        if cal.n_trials >= 2
        else ""
    )
    if cal.source == "stored":
        return (
            f"starting from this machine's stored calibration ({cal.n_trials} measured trial(s)"
            f"{err}); --no-calibration ignores it"
        )
    return f"calibrated on {cal.n_trials} measured trial(s) so far{err}"
