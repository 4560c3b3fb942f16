"""What a training run produced, and the first fit kept on disk while `training.refit` runs.

Under `training.refit` a run is two fits. The first (early-stopped, scored by the evaluate
stage under `refit: all`) is written to the backup folder when it ends, so a run killed
during the refit resumes there: the first fit is read back instead of trained again, and the
refit continues from its own checkpoints (trainer.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsys.core.layout import TEMP_PREFIXES
from recsys.model import TrainedModel

FIRST_FIT = "first_fit"
"""The backup folder's copy of a finished first fit (its model and `result.json`)."""
_RESULT = "result.json"
_MODEL = "model"


@dataclass
class TrainResult:
    """What a training run produced."""

    model: TrainedModel
    history: dict[str, list[float]]
    examples: int
    seconds: float
    strategy: str = "one_device"
    replicas: int = 1
    precision: str = "float32"
    best_epoch: int | None = None
    epoch_seconds: list[float] = field(default_factory=list)
    # Whether this process is the one that writes the run's artefacts (multi-worker: the chief).
    chief: bool = True
    jit_compile: bool = False
    cached: bool = False
    # training.input: sequences (one causal pass per window; examples = trained positions)
    # or rows (one example per interaction row).
    input: str = "rows"
    # training.refit: the kept model is a second fit on `refit_splits` for this many epochs
    # (the first fit's `best_epoch`, or training.epochs without early stopping); history and
    # examples are the first fit's.
    refit_epochs: int | None = None
    refit_examples: int = 0
    refit_seconds: float = 0.0
    refit_splits: tuple[str, ...] = ()
    # training.refit all: the first fit, which never saw the test split, is the model the
    # evaluate stage and the gate score (the kept `model` trained on the test split).
    evaluation_model: TrainedModel | None = None
    # The config's `dense_log` settings this run trained with (empty: the log was not dense).
    dense_log_settings: dict[str, bool | int | float | str] = field(default_factory=dict)
    # Every setting this run trained with and its origin (recsys.core.resolve.Setting.record).
    resolved: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The first fit's validation score on training.early_stopping_metric (the kept epoch's;
    # None without a validation split).
    validation_score: float | None = None
    # training.candidates: each first fit tried (recsys.core.records.CandidateRecord as plain
    # data, the config's own first) and the index of the one kept.
    candidates: list[dict[str, Any]] = field(default_factory=list)
    chosen_candidate: int | None = None
    # training.candidates_prune_after: the epoch after which this fit stopped, trailing an
    # earlier candidate (None: it ran its whole first fit).
    pruned_after: int | None = None

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady_examples_per_second(self) -> float:
        """Training-loop throughput after the first epoch (which includes graph tracing)."""
        later = self.epoch_seconds[1:] or self.epoch_seconds
        if not later or not self.epoch_seconds:
            return self.examples_per_second
        per_epoch = self.examples / len(self.epoch_seconds)
        return per_epoch * len(later) / sum(later)


def save_first_fit(result: TrainResult, backup_dir: Path) -> None:
    """Keep a finished first fit under `backup_dir` (written aside, then renamed: all or none)."""
    fields = {
        f.name: getattr(result, f.name)
        for f in dataclasses.fields(result)
        if f.name not in ("model", "evaluation_model")
    }
    final = backup_dir / FIRST_FIT
    staging = backup_dir / f"{TEMP_PREFIXES[0]}{FIRST_FIT}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    result.model.save(staging / _MODEL)
    (staging / _RESULT).write_text(json.dumps(fields, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)


def load_first_fit(backup_dir: Path) -> TrainResult | None:
    """The first fit `save_first_fit` kept under `backup_dir`, or None."""
    folder = backup_dir / FIRST_FIT
    if not (folder / _RESULT).is_file():
        return None
    fields = json.loads((folder / _RESULT).read_text())
    fields["refit_splits"] = tuple(fields.get("refit_splits", ()))
    return TrainResult(model=TrainedModel.load(folder / _MODEL), **fields)
