"""What to change when nothing measured fits: the sentences of `Plan.advice`."""

from __future__ import annotations

from autofit.plan import Candidate, Outcome, infeasible_advice, trial_status
from autofit.search.candidates import Candidates, Setting
from autofit.trials.budget import LIMIT_FACTOR, LIMIT_SLACK_S
from autofit.units import fmt_size


def no_winner_advice(
    s: Setting,
    cands: Candidates,
    trial_cands: list[Candidate],
    *,
    trials: int | None = None,
    timeout: float | None = None,
    trial_timeout: float | None = None,
) -> str:
    """Nothing measured fits: say what happened and what to change. Every candidate ruled out
    before a trial: what bound and what would help (`infeasible_advice`); no trial finished: the
    search time limit; trials timed out: --trial-timeout and its value; trials failed: the first
    error; trials ran out of memory or crossed the line: the nearest one; candidates left untried:
    the budget or time that ran out."""
    if not cands.trialable and not trial_cands:
        return _infeasible(s, cands, list(cands.all.values()))
    if not trial_cands:
        return _none_finished(len(cands.trialable), timeout, trial_timeout)
    latest = list({c.config: c for c in trial_cands}.values())
    outcome = {id(c): trial_status(c.trial, s.allowed_bytes) for c in latest}
    lines = [
        _ran(latest, outcome, s.allowed_bytes),
        _timed_out(latest, trial_timeout),
        _stopped_slow(latest),
        _first_error(latest),
        _nearest_over(latest, outcome),
    ]
    memory = [c for c in latest if outcome[id(c)] in (Outcome.OOM, Outcome.OVER_LINE)]
    untried = unmeasured(cands.predicted_fit, trial_cands) or unmeasured(
        cands.trialable, trial_cands
    )
    if untried:
        lines.append(_untried(untried, len(latest), trials, timeout))
    elif memory:
        lines.append(_infeasible(s, cands, [cands.all[cfg] for cfg in cands.pruned] + memory))
    return " ".join(line for line in lines if line is not None)


def _none_finished(may_fit: int, timeout: float | None, trial_timeout: float | None) -> str:
    """No trial finished, so none of the `may_fit` candidates was measured: why, and what to do."""
    if timeout is not None:
        each = (
            f" (each may take up to --trial-timeout {trial_timeout:g} s)" if trial_timeout else ""
        )
        return (
            f"No trial ran within the search time limit (--search-timeout {timeout:g} s), so "
            f"none of the {may_fit:,} candidate(s) that may fit was measured. Raise "
            f"--search-timeout to leave time for at least one trial{each}."
        )
    return (
        f"No trial has finished yet, so none of the {may_fit:,} candidate(s) that may fit was "
        "measured: run the same command again to measure them (finished trials are kept)."
    )


def _ran(latest: list[Candidate], outcome: dict[int, Outcome], allowed_bytes: float) -> str:
    """How many trials ran, by outcome, none under the headroom line."""
    by_status: dict[str, int] = {}
    for c in latest:
        by_status[outcome[id(c)]] = by_status.get(outcome[id(c)], 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(by_status.items()))
    line = fmt_size(allowed_bytes)
    ran = f"{len(latest)} trial{'s' if len(latest) != 1 else ''} ran"
    return f"{ran} ({summary}); none finished under the {line} headroom line."


def _timed_out(latest: list[Candidate], trial_timeout: float | None) -> str | None:
    """The trials that timed out, whose limit stopped them, and how to give them longer."""
    timeouts = [c for c in latest if c.trial.status == Outcome.TIMEOUT]
    if not timeouts:
        return None
    limit = max(c.trial.wall_s for c in timeouts)
    whose = (
        f"--trial-timeout {trial_timeout:g} s"
        if trial_timeout is not None
        else f"its own limit, {LIMIT_FACTOR:g}x the time its estimate expected + "
        f"{LIMIT_SLACK_S:g} s"
    )
    return (
        f"{len(timeouts)} timed out (after up to {limit:.0f} s: {whose}): give each trial "
        f"longer with --trial-timeout (e.g. --trial-timeout {2 * limit:.0f}), or run the "
        "config alone with `autofit trial` to see where its time goes; a trial also starts "
        "a process, builds the model and warms up before its measured steps."
    )


def _stopped_slow(latest: list[Candidate]) -> str | None:
    """The trials stopped as slow, which their measured speed ranks."""
    slow = [c for c in latest if c.trial.status == Outcome.SLOW]
    if not slow:
        return None
    return (
        f"{len(slow)} stopped as slow (a measured step far past its estimate); their "
        "measured speed ranks them."
    )


def _first_error(latest: list[Candidate]) -> str | None:
    """The trials that failed, and the first one's error."""
    errors = [c for c in latest if c.trial.status == Outcome.ERROR]
    if not errors:
        return None
    first = errors[0]
    text = (first.trial.message or "").strip()
    msg = text.splitlines()[0][:200] if text else "(no message)"
    return (
        f"{len(errors)} failed with an error; the first ('{first.config.short()}'): {msg} "
        "Fix that, or run the config alone with `autofit trial` to see its whole output."
    )


def _nearest_over(latest: list[Candidate], outcome: dict[int, Outcome]) -> str | None:
    """The trial over the headroom line with the lowest peak."""
    over = [c for c in latest if outcome[id(c)] == Outcome.OVER_LINE]
    if not over:
        return None
    near = min(over, key=lambda c: c.trial.peak_bytes or 0)
    return f"Nearest measured: '{near.config.short()}' peaked at {fmt_size(near.trial.peak_bytes)}."


def _untried(untried: list[Candidate], ran: int, trials: int | None, timeout: float | None) -> str:
    """The candidates that may fit but were not tried: what ran out, what to change, and the
    fastest three of them."""
    if trials is not None and ran >= trials:
        why, change = f"the trial budget (--trials {trials}) was spent", "raise --trials"
    elif timeout is not None:
        why = f"the search time limit (--search-timeout {timeout:g} s) ran out"
        change = "raise --search-timeout"
    else:
        why, change = "the search stopped", "run the same command again"
    named = "; ".join(
        f"'{c.config.short()}' (est. {c.estimate.tokens_per_s:,.0f} tokens/s, "
        f"{fmt_size(c.estimate.peak_bytes)})"
        for c in untried[:3]
    )
    return (
        f"{len(untried):,} candidate(s) that may fit were not tried because {why}: {change} "
        f"to measure them (finished trials are kept). Untried, fastest first: {named}."
    )


def unmeasured(pool: list[Candidate], trial_cands: list[Candidate]) -> list[Candidate]:
    """Those of `pool` (the candidates the estimate says fit, `Candidates.predicted_fit`, or all
    a trial may spend time on, `trialable`) that no trial ran, in the pool's order."""
    tried = {c.config for c in trial_cands}
    return [c for c in pool if c.config not in tried]


def _infeasible(s: Setting, cands: Candidates, rejected: list[Candidate]) -> str:
    return infeasible_advice(
        s.model, s.hardware, s.space, rejected, s.seq_len, s.global_batch, s.margin, s.device,
        skipped=cands.counts, lengths=s.lengths,
    )  # fmt: skip
