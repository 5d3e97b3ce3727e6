"""The serialised forms of a calibration, as pydantic models: what the study's attrs, the plan's
JSON and this machine's stored file (`autofit.calibration.store`) hold. Reading one validates it
(a hand-edited or damaged file is refused whole, never half-read); the dataclasses of
`autofit.calibration.model` are what the code computes with."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from autofit.calibration.model import (
    NAPKIN_MEMORY,
    NAPKIN_SPEED,
    NAPKIN_SPEED_BAND,
    Calibration,
    Observation,
    SideCheck,
)
from autofit.estimate import MEMORY_ERROR


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ObservationRecord(_Record):
    """One measured trial's terms and measurement (`Observation`); `id` names the trial in the
    stored file (`study#number`), so the same trial saved twice is kept once."""

    id: str | None = None
    memory: tuple[float, ...]
    time: tuple[float, ...]
    micro_steps: int = 1
    peak_bytes: float | None = None
    oom: bool = False
    step_time_s: float | None = None
    label: str = ""
    context_bytes: float | None = None

    @classmethod
    def of(cls, obs: Observation, ident: str | None = None) -> ObservationRecord:
        return cls(id=ident, **{k: getattr(obs, k) for k in _OBSERVATION_FIELDS})

    def observation(self) -> Observation:
        return Observation(**{k: getattr(self, k) for k in _OBSERVATION_FIELDS})


_OBSERVATION_FIELDS = tuple(k for k in ObservationRecord.model_fields if k != "id")


class SideCheckRecord(_Record):
    """`SideCheck` without its side (the key it is stored under names it)."""

    applied: bool = True
    prior: str = "none"
    n: int = 0
    prior_error: float | None = None
    fitted_error: float | None = None
    in_sample_error: float | None = None
    reason: str = ""

    @classmethod
    def of(cls, check: SideCheck) -> SideCheckRecord:
        return cls(**{k: getattr(check, k) for k in cls.model_fields})

    def check(self, side: str) -> SideCheck:
        return SideCheck(side=side, **self.model_dump())


class CalibrationRecord(_Record):
    """A `Calibration` as JSON: factors rounded to 4 places, the constants with their unit in
    their names, and the notes the plan prints."""

    source: str = "stored"
    n_trials: int = 0
    memory: dict[str, float] = {}
    memory_constant_bytes: int = 0
    speed: dict[str, float] = {}
    speed_constant_s: float = 0.0
    memory_band: float = MEMORY_ERROR
    speed_band: float = NAPKIN_SPEED_BAND
    memory_error: float | None = None
    speed_error: float | None = None
    memory_check: SideCheckRecord | None = None
    speed_check: SideCheckRecord | None = None
    notes: list[str] = []
    context_bytes: float | None = None

    @classmethod
    def of(cls, cal: Calibration) -> CalibrationRecord:
        return cls(
            **{k: getattr(cal, k) for k in _AS_IS},
            memory={k: round(v, 4) for k, v in cal.memory.items()},
            memory_constant_bytes=int(round(cal.memory_constant)),
            speed={k: round(v, 4) for k, v in cal.speed.items()},
            speed_constant_s=cal.speed_constant,
            memory_check=SideCheckRecord.of(cal.memory_check) if cal.memory_check else None,
            speed_check=SideCheckRecord.of(cal.speed_check) if cal.speed_check else None,
            notes=cal.notes,
        )

    def dump(self) -> dict[str, Any]:
        """Plain JSON data; a side that was not fitted has no `<side>_check` key."""
        data = self.model_dump()
        for side in ("memory", "speed"):
            if data[f"{side}_check"] is None:
                del data[f"{side}_check"]
        return data

    def calibration(self) -> Calibration:
        """The calibration; a term the record lacks keeps the napkin's factor."""
        return Calibration(
            **{k: getattr(self, k) for k in _AS_IS},
            memory={k: self.memory.get(k, v) for k, v in NAPKIN_MEMORY.items()},
            memory_constant=float(self.memory_constant_bytes),
            speed={k: self.speed.get(k, v) for k, v in NAPKIN_SPEED.items()},
            speed_constant=self.speed_constant_s,
            memory_check=self.memory_check.check("memory") if self.memory_check else None,
            speed_check=self.speed_check.check("speed") if self.speed_check else None,
        )


# The fields a `CalibrationRecord` holds as the `Calibration` has them (same name, same value);
# the factors, the constants and the checks are converted each way.
_AS_IS = (
    "source", "n_trials", "memory_band", "speed_band", "memory_error", "speed_error",
    "context_bytes",
)  # fmt: skip


class StoredCalibration(_Record):
    """This machine's file: which machine, which napkin its terms came from, when, the fitted
    calibration and the observations it was fitted on."""

    machine: dict[str, Any]
    napkin: str
    updated: str = ""
    calibration: CalibrationRecord
    observations: list[ObservationRecord] = []


def calibration_to_dict(cal: Calibration) -> dict[str, Any]:
    """A calibration's JSON form (`CalibrationRecord`), as a study's attrs and a plan's JSON hold
    it."""
    return CalibrationRecord.of(cal).dump()


def calibration_from_dict(data: dict[str, Any]) -> Calibration:
    """The inverse of `calibration_to_dict`; raises pydantic's `ValidationError` on malformed
    data."""
    return CalibrationRecord.model_validate(data).calibration()
