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

import argparse
import json
import sys
from pathlib import Path

from autofit.quiet import quiet_libraries
from autofit.trials.guard import exit_now, guard_trial_process
from autofit.values import QuantBackend


def main(argv: list[str] | None = None) -> None:
    guard_trial_process()
    _skip_unused_bitsandbytes(sys.argv[1:] if argv is None else argv)
    with quiet_libraries():
        from autofit.trials.rank import main as run_rank

        run_rank(argv)
    # The results are written and the process group is gone: leave without the interpreter's
    # teardown, which takes 1-2 s with torch and transformers loaded, at every launch.
    exit_now(0)


def _skip_unused_bitsandbytes(argv: list[str]) -> None:
    """Keep bitsandbytes out of a rank whose configs do not quantize with it.

    peft imports bitsandbytes whenever it is installed (`peft.helpers`: `try: import
    bitsandbytes`), about 1 s of every rank's start on the suite's machine, and on a GPU it loads
    that library's CUDA kernels beside the job's. A rank that runs no `quant_backend:
    bitsandbytes` config marks it absent in this process only (`sys.modules[name] = None`, which
    makes the import raise ImportError, as where it is not installed), so peft goes on without
    it, as it does on a machine without bitsandbytes. The planner's own process is untouched.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--spec")
    known, _ = parser.parse_known_args(argv)
    try:
        configs = json.loads(Path(known.spec).read_text())["configs"]
    except (TypeError, OSError, ValueError, KeyError):
        return  # the rank itself reports a spec it cannot read
    if not any(c.get("quant_backend") == QuantBackend.BITSANDBYTES for c in configs):
        sys.modules.setdefault("bitsandbytes", None)  # type: ignore[assignment]


if __name__ == "__main__":
    main(sys.argv[1:])
