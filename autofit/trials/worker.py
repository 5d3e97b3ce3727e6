"""A trial's rank: `python -m autofit.trials.worker --spec SPEC.json --out OUT.json`, under
torchrun, or started by the launcher itself for a one-rank launch.

A worker first makes sure it dies with its planner (`guard`: SIGKILL when its parent, torchrun or
the planner, dies, and a watchdog that kills it at once if the planner is already gone), and only
then imports torch and the builder to run its rank (`rank.py`). The imports take seconds, more on
a loaded machine; a planner killed in that time must still take the worker with it. Other
libraries' notices are kept out of its stderr (`autofit.quiet`; shown to the user when a trial
fails, with the rank's error and traceback, which always show) unless the planner runs with
`--verbose`.
"""

from __future__ import annotations

import sys

from autofit.quiet import quiet_libraries
from autofit.trials.guard import exit_now, guard_trial_process


def main(argv: list[str] | None = None) -> None:
    guard_trial_process()
    with quiet_libraries():
        from autofit.trials.rank import main as run_rank

        run_rank(argv)
    # The results are written and the process group is gone: leave without the interpreter's
    # teardown, which takes 1-2 s with torch and transformers loaded, at every launch.
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
