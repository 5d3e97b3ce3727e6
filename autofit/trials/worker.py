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


def main(argv: list[str] | None = None) -> None:
    guard_trial_process()
    _skip_unused_libraries(sys.argv[1:] if argv is None else argv)
    with quiet_libraries():
        from autofit.trials.rank import main as run_rank

        run_rank(argv)
    # The results are written and the process group is gone: leave without the interpreter's
    # teardown, which takes 1-2 s with torch and transformers loaded, at every launch.
    exit_now(0)


OPTIONAL_LIBRARIES = ("bitsandbytes", "torchao")
"""Libraries a rank imports only where one of its configs uses them
(`recipe.optional_libraries`)."""


def _skip_unused_libraries(argv: list[str]) -> None:
    """Keep bitsandbytes and torchao out of a rank whose configs do not use them.

    peft imports bitsandbytes whenever it is installed (`peft.helpers`: `try: import
    bitsandbytes`), about 1 s of every rank's start on the suite's machine, and on a GPU it loads
    that library's CUDA kernels beside the job's; transformers imports torchao whenever it is
    installed (`transformers.quantizers.auto` -> `quantizer_torchao`), 0.27 s, and on a GPU its
    MX and CUTLASS kernels. A library that no config of the rank uses
    (`recipe.optional_libraries`) is marked absent in this process only (`sys.modules[name] =
    None`, which makes the import raise ImportError and `importlib.util.find_spec` answer None,
    as where it is not installed), so peft and transformers go on without it, as they do on a
    machine without it. The planner's own process is untouched.
    """
    for name in _unused_libraries(argv):
        sys.modules.setdefault(name, None)  # type: ignore[assignment]


def _unused_libraries(argv: list[str]) -> list[str]:
    """The `OPTIONAL_LIBRARIES` no config of the rank's spec uses; none where the spec cannot
    be read (the rank itself reports that)."""
    from autofit.config import Config  # after `guard_trial_process`, as every other import
    from autofit.errors import ConfigError
    from autofit.recipe import optional_libraries

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--spec")
    known, _ = parser.parse_known_args(argv)
    try:
        configs = json.loads(Path(known.spec).read_text())["configs"]
        used = set().union(*(optional_libraries(Config.from_dict(c)) for c in configs))
    except (TypeError, OSError, ValueError, KeyError, ConfigError):
        return []
    return [name for name in OPTIONAL_LIBRARIES if name not in used]


if __name__ == "__main__":
    main(sys.argv[1:])
