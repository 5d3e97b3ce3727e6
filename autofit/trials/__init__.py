"""Real trials: a few training steps of one config in fresh processes, measured.

`run_trial` launches one (`launcher.py`: one rank as a plain process, several under torchrun,
every process guarded), `run_trials` several configs of one model in one launch; each rank
runs `worker.py`, which sets the model up with `autofit.builder` exactly as `autofit.apply` does
for a user.
`TrialResult` is what comes back. Importing this package does not import torch; only the worker
does.
"""

from autofit.trials.launcher import run_trial, run_trials
from autofit.trials.result import TrialResult

__all__ = ["TrialResult", "run_trial", "run_trials"]
