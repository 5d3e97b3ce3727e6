"""What a search reports while it runs, for whoever shows it: the engine calls a `SearchListener`
and never prints, so the search does not depend on its presentation (the CLI and `autofit.plan`
pass `autofit.report.live.SearchDisplay`; tests and library callers may pass nothing)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from autofit.trials.budget import TrialTime
from autofit.trials.result import TrialResult

if TYPE_CHECKING:
    from autofit.plan import Candidate
    from autofit.search.candidates import Candidates, Setting


class SearchListener(Protocol):
    """The events of a search, in the order they come. `note` texts are plain sentences (no
    markup)."""

    def intro(
        self, setting: Setting, cands: Candidates, name: str, url: str, folder: Path, done: int
    ) -> None:
        """The search starts: what it plans for, the study, `done` trials already finished."""

    def note(self, text: str) -> None:
        """A sentence worth telling (a re-run, a wait, why the search stops, a stored file)."""

    def begin(self, total: int, done: int, allowed: float) -> None:
        """Real trials start: `total` in the budget, `done` finished, `allowed` the headroom line
        in bytes."""

    def end(self) -> None:
        """No more trials or verifications follow."""

    def started(self, cand: Candidate, timing: TrialTime) -> None:
        """A trial starts; `timing`: what it should take (`autofit.trials.budget`)."""

    def trial_progress(self, info: dict[str, Any]) -> None:
        """What the running trial's rank 0 says it does (phase, step, steps)."""

    def waiting(self, device: str, holder: str) -> None:
        """Another trial on this host holds a device this one needs."""

    def finished(self, number: int, cand: Candidate, result: TrialResult) -> None: ...

    def verifying(self, cand: Candidate, steps: int) -> None: ...

    def verified(self, cand: Candidate, result: TrialResult, ok: bool) -> None: ...


class Silent:
    """The listener of a search nobody watches."""

    def intro(
        self, setting: Setting, cands: Candidates, name: str, url: str, folder: Path, done: int
    ) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def begin(self, total: int, done: int, allowed: float) -> None:
        pass

    def end(self) -> None:
        pass

    def started(self, cand: Candidate, timing: TrialTime) -> None:
        pass

    def trial_progress(self, info: dict[str, Any]) -> None:
        pass

    def waiting(self, device: str, holder: str) -> None:
        pass

    def finished(self, number: int, cand: Candidate, result: TrialResult) -> None:
        pass

    def verifying(self, cand: Candidate, steps: int) -> None:
        pass

    def verified(self, cand: Candidate, result: TrialResult, ok: bool) -> None:
        pass


@contextlib.contextmanager
def shown(listener: SearchListener, total: int, done: int, allowed: float) -> Iterator[None]:
    """The listener's `begin` and `end` around the trials, whatever ends them."""
    listener.begin(total, done, allowed)
    try:
        yield
    finally:
        listener.end()
