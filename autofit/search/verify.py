"""Declare a winner only after it survives a second, longer run under the headroom line.

Short trials can miss a late peak (an allocator that grows, a slow first optimizer step), so the
best measured candidate is re-run with more steps; if that run fails or crosses the line, the next
best is verified instead. Results are kept in the study (user attr `verify:<config hash>`), so
resumed and parallel workers reuse them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import optuna

from autofit.plan import Candidate, rank_key
from autofit.search import study as st
from autofit.search.candidates import Setting
from autofit.trials.result import TrialResult

MAX_VERIFY = 3  # candidates to try before giving up on verification


def verify_steps(steps: int) -> int:
    return max(2 * steps, steps + 2)


def under_line(setting: Setting, result: TrialResult) -> bool:
    """A trial that ran and whose measured peak stayed at or below the headroom line."""
    return (
        result is not None
        and result.measured
        and result.peak_bytes is not None
        and result.peak_bytes <= setting.allowed_bytes
    )


def ranked_under_line(setting: Setting, trials: list[Candidate]) -> list[Candidate]:
    """Candidates whose trial ran and stayed under the headroom line, fastest first."""
    return sorted((c for c in trials if under_line(setting, c.trial)), key=rank_key)


def stored_verification(study: optuna.Study, cand: Candidate) -> dict[str, Any] | None:
    return study.user_attrs.get(st.verify_key(cand.config))


def verify_winner(
    study: optuna.Study,
    setting: Setting,
    ranked: list[Candidate],
    run: Callable[[Candidate], TrialResult],
    steps: int,
    on_verified: Callable[[Candidate, TrialResult, bool], None] | None = None,
    hold: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Candidate | None:
    """The first of `ranked` whose longer re-run still stays under the line; None when none does.

    `hold()` is held while a verification is looked up and run (the host's device lock), so of
    two planners on one host that reach the same winner only the first verifies it."""

    for cand in ranked[:MAX_VERIFY]:
        stored = stored_verification(study, cand)
        if stored is None:
            with hold():
                stored = stored_verification(study, cand)  # done while this planner waited?
                if stored is None:
                    result = run(cand)
                    record = {**result.to_dict(), "steps": steps}
                    study.set_user_attr(st.verify_key(cand.config), record)
        if stored is not None:
            result = TrialResult.from_dict(stored)
        ok = under_line(setting, result)
        if on_verified and stored is None:
            on_verified(cand, result, ok)
        if ok:
            cand.verified = True
            return cand
    return None
