"""The plan file as a pydantic model: what `plan_document` writes (`PlanFile.written`) and what
`load_plan` reads (`PlanFile.read`), so a malformed file (a value of the wrong type, no `config:`
mapping, a field the hardware section does not have) is refused whole with one paragraph naming
the file and the field, never half-read. Files written before a field existed still load: every
field but `autofit_plan` and `config` may be missing. The knobs in `config` are checked by
`autofit.config.Config.from_dict`, which names a bad knob and what it allows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from autofit.errors import AutofitError

Number = int | float
"""A count or a measurement, kept as written (an int stays an int: the file is byte-identical)."""


class HardwareRecord(BaseModel):
    """The GPUs the plan was made for (`hardware:`)."""

    model_config = ConfigDict(extra="forbid")

    description: str = ""
    n_gpus: int = 1
    nodes: int | None = None
    gpus_per_node: int | None = None
    capacity_bytes: Number | None = None
    usable_bytes: Number | None = None
    device: str | None = None


class PlanFile(BaseModel):
    """The `autofit` plan file, field by field in the order it is written."""

    model_config = ConfigDict(extra="allow")  # a newer autofit's field: kept, not refused

    autofit_plan: int
    autofit_version: str | None = None
    created: Any = None  # an ISO timestamp (YAML may read a hand-written one as a datetime)
    model: str = ""
    model_spec: dict[str, Any] | None = None
    decoder_layer: str | None = None
    hardware: HardwareRecord | None = None
    seq_len: int | None = None
    global_batch: int | None = None
    margin: Number | None = None
    config: dict[str, Any]
    label: str | None = None
    measured: bool = False
    verified: bool = False
    tokens_per_s: Number | None = None
    peak_bytes: Number | None = None
    step_time_s: Number | None = None
    estimate: dict[str, Any] | None = None
    trial: dict[str, Any] | None = None
    reason: str = ""
    lora: dict[str, Any] | None = None
    env: dict[str, str] | None = None
    study: dict[str, Any] | None = None
    trials: list[dict[str, Any]] = []

    @classmethod
    def written(cls, doc: dict[str, Any]) -> dict[str, Any]:
        """`doc` (every field, from `plan_document`) checked against the model, as the plain data
        the renderers write."""
        return cls.model_validate(doc).model_dump()

    @classmethod
    def read(cls, data: dict[str, Any], path: Path) -> PlanFile:
        """A loaded plan file checked; an `AutofitError` naming `path` and the field if it is
        malformed."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise AutofitError(plan_file_error(exc, path)) from None


def plan_file_error(exc: ValidationError, path: Path) -> str:
    """One paragraph: which fields of the plan file at `path` are wrong, and how."""
    problems = []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"])
        if err["type"] == "missing":
            problems.append(f"`{field}` is missing")
        elif err["type"] == "extra_forbidden":
            allowed = ", ".join(HardwareRecord.model_fields)
            problems.append(f"`{field}` is not a field of `hardware` (it has: {allowed})")
        else:
            problems.append(
                f"`{field}` is {err['input']!r}: {err['msg'][:1].lower()}{err['msg'][1:]}"
            )
    return (
        f"{path} is not a valid autofit plan: {'; '.join(problems)}. A plan file is what "
        "`--format autofit` writes (its `config:` holds the winner's knobs); fix the field named, "
        "or export the plan again with `autofit export`."
    )
