"""Plans: the winner among candidates, with the evidence (estimates, and trials when they ran).

- `types`: `Candidate` and `Plan`, the data;
- `outcome`: how a trial reads against the headroom line (`Outcome`);
- `prune`: which candidates the estimate rules out (`PruneReason`);
- `rank`: fastest first, ties within 0.5%, then the plainest;
- `enumerate`: every candidate of a space estimated, and the estimate-only plan;
- `explain`: the sentences users read (why the winner won, what would make something fit).
"""

from autofit.plan.enumerate import estimate_all, estimate_space, plan_estimates
from autofit.plan.explain import infeasible_advice, loss_note, tally, winner_reason
from autofit.plan.outcome import Outcome, trial_status
from autofit.plan.prune import (
    PRUNE_TOLERANCE,
    PruneReason,
    prune_reason,
    search_prune_reason,
)
from autofit.plan.rank import TIE_TOLERANCE, complexity, rank_key
from autofit.plan.types import Candidate, Plan
from autofit.request import DEFAULT_MARGIN

__all__ = [
    "DEFAULT_MARGIN",
    "PRUNE_TOLERANCE",
    "TIE_TOLERANCE",
    "Candidate",
    "Outcome",
    "Plan",
    "PruneReason",
    "complexity",
    "estimate_all",
    "estimate_space",
    "infeasible_advice",
    "plan_estimates",
    "prune_reason",
    "rank_key",
    "search_prune_reason",
    "tally",
    "trial_status",
    "loss_note",
    "winner_reason",
]
