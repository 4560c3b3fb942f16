"""`training.candidates`: a few settings tried beside the config's own, kept by validation.

One rule for every log does not exist: a log whose order carries the signal wants the
sequential query tower, a log of mostly collaborative signal wants more of the per-user
terms. Each candidate (dotted model.* / training.* settings over the run's config) trains a
first fit on the train split; the one with the highest `training.early_stopping_metric` on
the validation split (the kept epoch's value, the same exact evaluator and sample for all) is
the run's model and goes on to the refit. The test split is read by none of them. Ties keep
the earlier candidate, the config's own first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from recsys.core.auto import DeviceFacts
from recsys.core.config import ModelConfig, RecsysConfig, set_values
from recsys.core.resolve import Resolved, resolve_config


@dataclass(frozen=True)
class CandidateTrial:
    """One candidate's first fit: its settings, validation score and cost."""

    index: int  # 0: the config's own settings
    settings: dict[str, bool | int | float | str]  # the candidate's dotted keys ({}: the config)
    metric: str
    validation: float  # the kept epoch's value (nan: no validation score)
    best_epoch: int | None
    epochs: int
    seconds: float

    def record(self) -> dict[str, Any]:
        """Plain data (train.json, result.json); nan becomes None."""
        data = asdict(self)
        data["validation"] = self.validation if math.isfinite(self.validation) else None
        return data


def candidate_configs(
    written: RecsysConfig,
    own: Resolved,
    stats: Mapping[str, Any],
    device: DeviceFacts,
) -> list[Resolved]:
    """The resolved config of each candidate, the config's own (`own`) first.

    `written` is the config before the data and device rules; each candidate's settings are
    set over it as overrides, so they win over `auto` and dense_log as a --set would.
    """
    options = [own]
    for settings in written.training.candidates:
        options.append(resolve_config(set_values(written, settings), stats, device))
    return options


def same_training(a: Resolved, b: Resolved) -> bool:
    """Whether two resolved configs train the same model (a candidate that changes nothing)."""
    return _model(a) == _model(b) and a.config.training == b.config.training


def _model(resolved: Resolved) -> ModelConfig:
    model = resolved.config.model
    # The mean-pooling tower is the history's mean already: history_mean changes nothing.
    if model.query_encoder == "mean":
        return model.model_copy(update={"history_mean": False})
    return model


def chosen(trials: list[CandidateTrial]) -> int:
    """Index of the trial with the highest validation score (the first on ties; 0 if none)."""
    best = 0
    for trial in trials:
        if math.isfinite(trial.validation) and (
            not math.isfinite(trials[best].validation) or trial.validation > trials[best].validation
        ):
            best = trial.index
    return best


def describe(settings: Mapping[str, Any]) -> str:
    """`key=value, ...` of a candidate's settings, or "the config's own settings"."""
    if not settings:
        return "the config's own settings"
    return ", ".join(f"{key}={value}" for key, value in sorted(settings.items()))
