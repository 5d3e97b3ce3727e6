"""The plan of a study: its measured candidates ranked, the verified winner and why it won, or the
advice when nothing fits; from a search just run or from storage alone (`autofit export`)."""

from __future__ import annotations

from pathlib import Path

import optuna

from autofit.calibration import calibration_from_dict
from autofit.errors import AutofitError
from autofit.plan import Candidate, Plan, loss_note, winner_reason
from autofit.search import study as st
from autofit.search.advice import no_winner_advice, unmeasured
from autofit.search.calibrated import CALIBRATION_ATTR, summary
from autofit.search.candidates import Candidates, Setting, enumerate_candidates, rebuild_trials
from autofit.search.verify import ranked_under_line, stored_verification, under_line
from autofit.trials.result import TrialResult
from autofit.units import fmt_size


def assemble(
    setting: Setting,
    cands: Candidates,
    study: optuna.Study,
    trial_cands: list[Candidate],
    best: Candidate | None,
    storage: str,
    folder: Path | None,
    limits: tuple[int | None, float | None, float | None] = (None, None, None),
) -> Plan:
    """The plan of a study. `limits`: (--trials, --search-timeout, --trial-timeout) of the run
    that made it, named in the advice when nothing fits (None: not known, e.g. on export)."""
    s = setting
    ranked = ranked_under_line(s, trial_cands)
    if best is not None:
        ranked = [best] + [c for c in ranked if c.config != best.config]
    plan = Plan(
        request=s, best=best,
        ranked=ranked, trials=trial_cands, pruned=cands.counts, considered=cands.considered,
        storage=storage, study_name=study.study_name,
        run_dir=str(folder) if folder is not None else None,
        calibration=summary(cands, trial_cands),
        untried=unmeasured(cands.predicted_fit, trial_cands),
    )  # fmt: skip
    if best is not None:
        plan.reason = winner_reason(best, ranked[1:], s.hardware, measured=True, device=s.device)
        plan.reason += loss_note(best, s)
        check = stored_verification(study, best)
        if check:
            speed = check.get("tokens_per_s") or 0
            plan.reason += (
                f" Verified by a {check.get('steps', '?')}-step re-run: peak "
                f"{fmt_size(check.get('peak_bytes'))}, {speed:,.0f} tokens/s."
            )
    else:
        trials, timeout, trial_timeout = limits
        plan.advice = no_winner_advice(s, cands, trial_cands, trials=trials, timeout=timeout,
                                       trial_timeout=trial_timeout)  # fmt: skip
    return plan


def load_study_plan(storage: str, study: str) -> Plan:
    """The plan of an existing study, from storage alone (no trial runs; nothing written)."""
    opt_study = st.load_study(storage, study, read_only=True)
    request = st.stored_request(opt_study)
    if request is None:
        raise AutofitError(
            f"Study {study!r} in {storage} was not made by `autofit plan` (it has no autofit "
            "metadata), so there is no plan to export."
        )
    setting = Setting.from_request(request)
    cands = enumerate_candidates(setting)
    kept = opt_study.user_attrs.get(CALIBRATION_ATTR)
    if kept:  # judged as the search that made it last judged them
        cands.recalibrate(calibration_from_dict(kept))
    trial_cands = rebuild_trials(opt_study, cands)
    ranked = ranked_under_line(setting, trial_cands)
    best = None

    for cand in ranked:
        stored = stored_verification(opt_study, cand)
        if stored is not None and under_line(setting, TrialResult.from_dict(stored)):
            cand.verified = True
            best = cand
            break
    if best is None and ranked:
        best = ranked[0]  # measured but not yet verified: say so in the reason
    plan = assemble(setting, cands, opt_study, trial_cands, best, storage, None)
    if best is not None and not best.verified:
        plan.reason += " Not yet verified with a longer run: run `autofit plan` again to verify."
    return plan
