"""`training.candidates`: a few settings tried beside the config's own, kept by validation.

One rule for every log does not exist: a log whose order carries the signal wants the
sequential query tower, a log of mostly collaborative signal wants more of the per-user
terms. Each candidate (dotted model.* / training.* settings over the run's config) trains a
first fit on the train split; the one with the highest `training.early_stopping_metric` on
the validation split (the kept epoch's value, the same exact evaluator and sample for all) is
the run's model and goes on to the refit. The test split is read by none of them. Ties keep
the earlier candidate, the config's own first.

The candidates train one after the other, so each later one races the earlier ones' curves:
from epoch `training.candidates_prune_after` on, a candidate whose best validation score so far
is below the best an earlier candidate had reached by the same epoch stops (`CandidatePruner`,
the rule of a median pruner with the median replaced by the maximum). This bounds what a
candidate that is clearly behind costs, at the price of the few that would have caught up late.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from recsys.core.auto import DeviceFacts
from recsys.core.config import ModelConfig, RecsysConfig, set_values
from recsys.core.records import CandidateRecord
from recsys.core.resolve import Resolved, resolve_config


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


def chosen(trials: Sequence[CandidateRecord]) -> int:
    """Index of the trial with the highest validation score (the first on ties; 0 if none)."""
    best = 0
    for trial in trials:
        score, top = trial.validation, trials[best].validation
        if score is not None and (top is None or score > top):
            best = trial.index
    return best


def pruning_bar(trials: Sequence[CandidateRecord]) -> list[float]:
    """Per epoch, the best validation score any of `trials` had reached by then.

    A trial that ended earlier holds its last best; epochs no trial scored are nan, and a
    comparison with nan never prunes.
    """
    curves = [_best_so_far(trial.curve) for trial in trials]
    length = max((len(curve) for curve in curves), default=0)
    bar = np.full(length, np.nan)
    for curve in curves:
        if curve:
            padded = np.asarray(curve + [curve[-1]] * (length - len(curve)))
            bar = np.fmax(bar, padded)
    return [float(value) for value in bar]


def _best_so_far(curve: Sequence[float | None]) -> list[float]:
    values = np.asarray([np.nan if v is None else v for v in curve], dtype=float)
    return [float(v) for v in np.fmax.accumulate(values)] if values.size else []


def bar_at(bar: Sequence[float], epoch: int) -> float:
    """The bar at (1-based) `epoch`, its last value holding past its end (nan when empty)."""
    return bar[min(epoch, len(bar)) - 1] if bar else math.nan


def trails(best: float, bar: Sequence[float], epoch: int, after: int, epochs: int) -> bool:
    """Whether a fit whose best score by (1-based) `epoch` of `epochs` is `best` stops there.

    It stops from epoch `after` on (0: never) when `best` is below `bar` at that epoch, the
    bar's last value holding past its end; never at its last epoch (nothing left to save) and
    never against nan (an epoch nobody scored).
    """
    if not after or epoch < after or epoch >= epochs:
        return False
    return best < bar_at(bar, epoch)  # False while either is nan


class CandidatePruner(tf.keras.callbacks.Callback):
    """Stops a candidate's fit once it trails the earlier candidates (`pruning_bar`, `trails`).

    After each epoch from `after` on, the fit stops if its best `val_<metric>` so far is
    below `bar` at that epoch: the best an earlier candidate had reached by the same epoch.
    That earlier candidate then already scores above it, so it could not be kept; what it
    would have reached with the rest of its epochs is what pruning gives up. Place it after
    the callback that writes `val_<metric>` into the epoch's logs. A fit resumed after an
    interruption is not pruned: the scores of its epochs before the resume are unknown here,
    so its best so far would be understated.
    """

    def __init__(self, metric: str, bar: Sequence[float], after: int) -> None:
        super().__init__()
        self.key = f"val_{metric}"
        self.bar = list(bar)
        self.after = after
        self.best = math.nan
        self.pruned_after: int | None = None  # the 1-based epoch the fit stopped after
        self.first_epoch: int | None = None  # > 0: a resumed fit

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if self.first_epoch is None:
            self.first_epoch = epoch
        if self.first_epoch:
            return
        value = (logs or {}).get(self.key)
        if value is not None and math.isfinite(value):
            self.best = value if math.isnan(self.best) else max(self.best, value)
        epochs = self.params.get("epochs", math.inf)
        if trails(self.best, self.bar, epoch + 1, self.after, epochs):
            self.pruned_after = epoch + 1
            self.model.stop_training = True
