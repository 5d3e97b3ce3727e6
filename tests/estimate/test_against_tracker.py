"""The CUDA estimate against FSDPMemTracker: each case's error stays where docs/accuracy.md records
it (section 2, "Held by the test suite").

One fake-tensor trace per case (a few seconds each, no process launched, no memory allocated);
`bench/mutate_memory_terms.py` traces the same cases once and applies the same check with each
memory term scaled by 0.7 and 1.3.
"""

from __future__ import annotations

import pytest

from .tracked import CASES, Case, measure, problem


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_estimate_is_within_the_recorded_error_of_the_tracker(case: Case) -> None:
    failure = problem(case, measure(case))
    assert failure is None, failure
