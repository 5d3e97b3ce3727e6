"""How long a search should take, said before its first trial: the trials it will get to, each
timed from its estimate (`autofit.trials.budget`), and the verification after them.

The candidates are taken in the order a search starts with (the estimate's fastest that fit,
then the rest it may try); the calibrated search may stop sooner, when nothing untried is
expected to gain, and a trial stopped as slow or out of memory takes less than it was given.
"""

from __future__ import annotations

from dataclasses import dataclass

from autofit.search.candidates import Candidates
from autofit.search.verify import verify_steps


@dataclass(frozen=True)
class SearchTime:
    """The trials a search expects to run (`n`, of the `asked` left in its budget) and their
    seconds, the verification's seconds, and whether the search time limit (`limit_s`) is
    what keeps it to `n`."""

    n: int
    asked: int
    trials_s: float
    verify_s: float
    limit_s: float | None

    @property
    def total_s(self) -> float:
        return self.trials_s + self.verify_s

    @property
    def cut(self) -> bool:
        return self.n < self.asked

    def sentence(self) -> str:
        """`Expected: about 9 min, 12 trials of about 42 s each and a verification of the best
        (48 s); the search time limit (--search-timeout 900 s) leaves time for 12 of the 20
        trials the budget allows.`"""
        if self.n == 0:
            return "No trial to run: every candidate that may fit is measured."
        each = self.trials_s / self.n
        trials = f"{self.n} trials of about {each:.0f} s each" if self.n > 1 else "1 trial"
        text = (
            f"Expected: about {_minutes(self.total_s)}, {trials} and a verification of the best "
            f"({self.verify_s:.0f} s)"
        )
        if self.cut and self.limit_s is not None:
            text += (
                f"; the search time limit (--search-timeout {self.limit_s:g} s) leaves time for "
                f"{self.n} of the {self.asked} trials the budget allows"
            )
        return text + "."


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def expected_search(
    cands: Candidates, trials: int, steps: int, timeout: float | None, done: int = 0
) -> SearchTime:
    """What a search of `trials` trials (`done` of them finished) of `steps` measured steps
    should take, at most `timeout` seconds of trials (no trial starts after it)."""
    asked = max(trials - done, 0)
    fit = {c.config for c in cands.predicted_fit}
    order = cands.predicted_fit + [c for c in cands.trialable if c.config not in fit]
    spent, n = 0.0, 0
    for cand in order[:asked]:
        if timeout is not None and spent >= timeout:
            break
        spent += cands.trial_time(cand, steps).expected_s
        n += 1
    verify = cands.trial_time(order[0], verify_steps(steps)).expected_s if order else 0.0
    return SearchTime(n=n, asked=min(asked, len(order)), trials_s=spent, verify_s=verify,
                      limit_s=timeout)  # fmt: skip
