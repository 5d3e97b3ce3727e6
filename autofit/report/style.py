"""How a trial's outcome is coloured wherever it is printed (progress lines, tables, reports)."""

from __future__ import annotations

from autofit.plan import Outcome

OUTCOME_STYLE = {
    Outcome.OK: "green",
    Outcome.SLOW: "yellow",
    Outcome.OVER_LINE: "dark_orange",
    Outcome.OOM: "yellow",
    Outcome.TIMEOUT: "magenta",
    Outcome.ERROR: "red",
}


def styled(outcome: str) -> str:
    """`outcome` in its colour, as rich markup (an unknown status reads as an error)."""
    return f"[{OUTCOME_STYLE.get(outcome, 'red')}]{outcome}[/]"
