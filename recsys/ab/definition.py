"""An A/B experiment's definition: variants and their models, split, dates, metrics, test."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from recsys.ab.assignment import thresholds
from recsys.core.errors import ConfigError

ALPHA = (0.0, 0.5)
"""Open bounds of a test's significance level (above 0.5, "significant" means nothing)."""
POWER = (0.0, 1.0)
"""Open bounds of a test's power (1 would need infinitely many users)."""


class ExperimentDefinition(BaseModel):
    """What an experiment is; recorded as tags of its MLflow experiment (`ab-<name>`).

    `variants` maps each variant to the model it serves: an alias (`champion`, `challenger`) or
    a registered version (`3` or `v3`); the first variant is the control. `versions` holds the
    versions the aliases pointed to when the experiment was recorded, so `challenger` moving
    on the next night does not change what variant B was.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    variants: dict[str, str] = Field(default_factory=lambda: {"A": "champion", "B": "challenger"})
    split: dict[str, float] | None = None
    holdout: float = Field(0.0, ge=0, lt=1)
    salt: str = ""
    start: dt.date | None = None
    primary_metric: str | None = None
    # metric -> largest tolerated relative drop (0.01 = 1%), judged on the always-valid interval
    guardrails: dict[str, float] = Field(default_factory=dict)
    alpha: float = Field(0.05, gt=ALPHA[0], lt=ALPHA[1])
    power: float = Field(0.8, gt=POWER[0], lt=POWER[1])
    min_days: int = Field(7, ge=1)
    planned_days: int = Field(14, ge=1)
    tau_sd: float = Field(0.1, gt=0)
    model_name: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    # The log: integer timestamps' unit (auto: by magnitude, named in the report), the share of
    # impossible rows tolerated (dropped and listed), and outcomes that may be negative.
    timestamp_unit: Literal["auto", "s", "ms", "us", "ns"] = "auto"
    max_rejected_fraction: float = Field(0.01, ge=0, le=1)
    allow_negative: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> ExperimentDefinition:
        if len(self.variants) != 2:
            raise ValueError(
                f"exactly two variants (control, treatment), got {list(self.variants)}"
            )
        if self.split is not None:
            if set(self.split) != set(self.variants):
                raise ValueError(f"split {self.split} must name the variants {list(self.variants)}")
            try:
                thresholds(self.split, self.holdout)
            except ConfigError as exc:  # reported by make_definition with the file's name
                raise ValueError(str(exc)) from None
        if self.planned_days < self.min_days:
            raise ValueError(f"planned_days {self.planned_days} < min_days {self.min_days}")
        return self

    @property
    def control(self) -> str:
        """The first variant."""
        return next(iter(self.variants))

    @property
    def treatment(self) -> str:
        """The second variant."""
        return list(self.variants)[1]

    def shares(self) -> dict[str, float]:
        """Each variant's share of all traffic (equal split of what the holdout leaves)."""
        if self.split is not None:
            return dict(self.split)
        return {name: (1 - self.holdout) / len(self.variants) for name in self.variants}

    def assignment_split(self) -> dict[str, float]:
        """The split as `recsys.ab.assign` takes it (whole basis points)."""
        shares = self.shares()
        if self.split is None:
            # Equal shares of an odd number of basis points: the control takes the remainder.
            bp = round((1 - self.holdout) * 10_000)
            each = bp // len(shares)
            rest = bp - each * len(shares)
            return {n: (each + (rest if i == 0 else 0)) / 10_000 for i, n in enumerate(shares)}
        return shares


def load_definition(path: Path, **overrides: Any) -> ExperimentDefinition:
    """A definition from a YAML file (ConfigError naming the file and field when invalid)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read experiment definition {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: an experiment definition is a YAML mapping")
    return make_definition({**data, **{k: v for k, v in overrides.items() if v is not None}}, path)


def make_definition(
    data: dict[str, Any], source: Path | str = "definition"
) -> ExperimentDefinition:
    """Validate a definition; errors name the field, as ConfigError."""
    try:
        return ExperimentDefinition.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(definition)"
        raise ConfigError(f"{source}: experiment field {where}: {first['msg']}") from None
