"""The estimate against real CPU trials: each case's error stays where docs/accuracy.md records it.

One trial per case, the cases of one model and rank count in one launch (`measure_all`);
`bench/mutate_memory_terms.py` runs the same cases once and applies the same check with each
memory term scaled by 0.7 and 1.3.
"""

from __future__ import annotations

import pytest

from autofit.trials import TrialResult

from .measured import CASES, Case, measure_all, problem

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def measured() -> dict[str, TrialResult]:
    return measure_all(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_estimate_is_within_the_recorded_error_of_a_real_trial(
    measured: dict[str, TrialResult], case: Case
) -> None:
    failure = problem(case, measured[case.name])
    assert failure is None, failure
