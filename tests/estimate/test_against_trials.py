"""The estimate against real CPU trials: each case's error stays where docs/accuracy.md records it.

One trial per case (about 9 s each); `bench/mutate_memory_terms.py` runs the same cases once and
applies the same check with each memory term scaled by 0.7 and 1.3.
"""

from __future__ import annotations

import pytest

from .measured import CASES, Case, measure, problem

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_estimate_is_within_the_recorded_error_of_a_real_trial(case: Case) -> None:
    failure = problem(case, measure(case))
    assert failure is None, failure
