"""A plan read back from its `autofit` YAML (`load_plan`): what a training script passes to
`autofit.apply`, and exported again in another format like the plan it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autofit.config import Config
from autofit.errors import AutofitError
from autofit.export.plan_file import PlanFile
from autofit.export.schema import ALLOC_ENV
from autofit.export.write import export_plan


@dataclass
class LoadedBest:
    config: Config
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    step_time_s: float | None = None
    measured: bool = False
    verified: bool = False


@dataclass
class LoadedPlan:
    """A plan read back from an `autofit` YAML: `.best.config` is what to `autofit.apply`."""

    best: LoadedBest
    model: str
    seq_len: int
    global_batch: int | None
    n_gpus: int
    env: dict[str, str]
    reason: str
    path: Path
    document: dict[str, Any] = field(repr=False, default_factory=dict)

    def export(self, format: str, path: str | Path) -> list[Path]:
        return export_plan(self, format, path)


def load_plan(path: str | Path) -> LoadedPlan:
    """Read an `autofit` plan YAML (from `--export PATH --format autofit`, or the side file
    `<name>.autofit.yaml` of the other formats)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise AutofitError(
            f"No plan file at {str(p)!r}. Write one with `autofit plan ... --export plan.yaml` "
            "or `autofit export --storage URL --study NAME --format autofit --output plan.yaml`."
        )
    try:
        data = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise AutofitError(f"{p}: not a readable YAML plan ({exc}).") from None
    if not isinstance(data, dict) or "autofit_plan" not in data:
        raise AutofitError(
            f"{p} is not an autofit plan (no `autofit_plan:` key). Pass the file written by "
            "`--format autofit`, or the `.autofit.yaml` file next to an accelerate/trainer export."
        )
    plan = PlanFile.read(data, p)  # a field of the wrong type, or none: one paragraph
    n_gpus = plan.hardware.n_gpus if plan.hardware is not None else 1
    # ConfigError names the bad knob; a hand-written `wrap: auto` is read as what it stands for on
    # the plan's GPUs, so the exports and `autofit.apply` never see it unresolved
    config = Config.from_dict(plan.config, where=str(p)).resolved(n_gpus)
    data["config"] = {**plan.config, "wrap": config.wrap}
    best = LoadedBest(
        config=config,
        tokens_per_s=plan.tokens_per_s,
        peak_bytes=plan.peak_bytes,  # type: ignore[arg-type]
        step_time_s=plan.step_time_s,
        measured=plan.measured,
        verified=plan.verified,
    )
    return LoadedPlan(
        best=best,
        model=plan.model,
        seq_len=plan.seq_len or config.seq_len,
        global_batch=plan.global_batch,
        n_gpus=n_gpus,
        env=dict(plan.env if plan.env is not None else ALLOC_ENV),
        reason=plan.reason,
        path=p,
        document=data,  # as written: the exports of a loaded plan are those of the plan
    )
