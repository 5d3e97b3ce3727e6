"""The search: an Optuna study over the space that spends real trials only where the estimate
says a candidate may fit and may be fast, and declares a verified winner.

`search(...)` runs (or resumes) it and returns a `Plan`; `load_study_plan(storage, study)` rebuilds
the plan of an existing study without running anything (`autofit export`).
"""

from autofit.search.assemble import load_study_plan
from autofit.search.driver import search

__all__ = ["load_study_plan", "search"]
