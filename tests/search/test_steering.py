"""What the search takes for a race lost to another planner of the same study, read off the
errors Optuna itself raises."""

from __future__ import annotations

import optuna
import pytest

from autofit.search.steering import lost_race
from autofit.trials import TrialResult


def _finished_trial() -> tuple[optuna.Study, optuna.trial.Trial]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    trial = study.ask()
    study.tell(trial, 1.0)
    return study, trial


def test_telling_or_updating_a_trial_another_planner_finished_is_a_lost_race() -> None:
    study, trial = _finished_trial()
    with pytest.raises(Exception) as told:
        study.tell(trial, 2.0)
    with pytest.raises(Exception) as updated:
        study._storage.set_trial_user_attr(trial._trial_id, "k", 1)
    assert lost_race(told.value) and lost_race(updated.value)
    assert isinstance(updated.value, optuna.exceptions.UpdateFinishedTrialError)


def test_other_errors_are_not_a_lost_race() -> None:
    # Optuna's words in another error are not Optuna's error
    assert not lost_race(RuntimeError("Trial#3 has already finished and can not be updated."))
    assert not lost_race(RuntimeError("database is locked"))


def test_a_trial_report_with_a_field_the_result_lacks_is_refused() -> None:
    result = TrialResult(status="error", config={}, model="llama-debug")
    result.update({"status": "ok", "peak_bytes": 1})
    assert (result.status, result.peak_bytes) == ("ok", 1)
    with pytest.raises(ValueError, match="peak_byts"):
        result.update({"peak_byts": 2})
