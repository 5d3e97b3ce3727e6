"""Real trials: the model at real size with random weights, the candidate applied as a user's run
would, a few FSDP2 training steps in a subprocess, measured peaks and speed.

`run_trial` launches one; `apply` runs the same builder on a user's model.

Importing this package rebinds the attribute `autofit.trial` from the public function
`autofit.trial(...)` to this module, so the module itself is callable and does what the function
does: `autofit.trial("llama-debug", "2", device="cpu")` works either way.
"""

import sys
import types
from typing import Any

from autofit.trial.apply import apply
from autofit.trial.launcher import run_trial
from autofit.trial.result import TrialResult

__all__ = ["TrialResult", "apply", "run_trial"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> TrialResult:
        from autofit import _run_trial_api

        return _run_trial_api(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
