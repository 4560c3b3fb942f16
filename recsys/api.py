"""The public Python API: recsys's documented entry points, in one namespace.

    import datetime as dt
    from pathlib import Path

    from recsys import api

    config = api.load_config("configs/default.yaml")
    workdir = api.Workdir(Path("recsys-work"))
    day = dt.date(2026, 1, 5)
    data_dir, stats = api.preprocess(config, workdir, day)
    run_dir, result = api.train(config, workdir, day)

Every name here is the object its own module defines (`_SOURCES` says which); this module only
gathers them, as `recsys <command>` does for the shell. The stages (`preprocess`, `train`,
`evaluate`, `export`, `publish`) each work alone on the previous stage's outputs;
`run_nightly` runs them all under the working directory's lock, skipping finished ones.
A stage called on its own takes no lock: hold `WorkdirLock(workdir.root)` around it when
another process may use the same working directory.

Names load on first use, so `import recsys.api` is cheap and a config loads without
TensorFlow or Beam. This module is the top layer of the import contracts (pyproject.toml):
it imports the conductor, and nothing of ours imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conductor.lock import WorkdirLock
    from conductor.nightly import NightlyResult, backfill, run_nightly
    from conductor.promotion import PublishResult
    from conductor.promotion import publish_run as publish
    from conductor.stages import ExportResult, evaluate, export, preprocess, sync, train
    from recsys.ab.assignment import assign
    from recsys.ab.planning import plan
    from recsys.ab.workflow import analyze_experiment, assign_file
    from recsys.core.config import RecsysConfig, load_config, parse_config
    from recsys.core.errors import (
        ConfigError,
        DataError,
        EmbeddingsContractError,
        ExportVerificationError,
        OutOfMemoryError,
        RecsysError,
        ServedModelError,
        StageFailedError,
        StageNotReadyError,
        StorageError,
        TrackingError,
        WorkdirLockedError,
    )
    from recsys.core.layout import Workdir, parse_date
    from recsys.core.records import (
        ExportRecord,
        MetricsRecord,
        RecordError,
        StatsRecord,
        TrainRecord,
        read_record,
    )
    from recsys.core.resolve import resolve_config
    from recsys.model import TrainedModel
    from recsys.model_evaluation import evaluate_model
    from recsys.tracking.compare import compare
    from recsys.training.result import TrainResult
    from serving_export.formats import export_embeddings
    from serving_export.manifest import load_embeddings

# Public name -> (module, name there).
_SOURCES: dict[str, tuple[str, str]] = {
    # Configuration and the working directory.
    "RecsysConfig": ("recsys.core.config", "RecsysConfig"),
    "load_config": ("recsys.core.config", "load_config"),
    "parse_config": ("recsys.core.config", "parse_config"),
    # Every setting as a run trains it (`auto` decided for given stats), and its origin.
    "resolve_config": ("recsys.core.resolve", "resolve_config"),
    "Workdir": ("recsys.core.layout", "Workdir"),
    "WorkdirLock": ("conductor.lock", "WorkdirLock"),
    "parse_date": ("recsys.core.layout", "parse_date"),
    # The five stages, each on the previous one's outputs, and what they return.
    "preprocess": ("conductor.stages", "preprocess"),
    "train": ("conductor.stages", "train"),
    "evaluate": ("conductor.stages", "evaluate"),
    "export": ("conductor.stages", "export"),
    "publish": ("conductor.promotion", "publish_run"),
    "sync": ("conductor.stages", "sync"),
    "TrainResult": ("recsys.training.result", "TrainResult"),
    "ExportResult": ("conductor.stages", "ExportResult"),
    "PublishResult": ("conductor.promotion", "PublishResult"),
    # The typed files the stages hand on (stats.json, train.json, metrics.json, export.json).
    "StatsRecord": ("recsys.core.records", "StatsRecord"),
    "TrainRecord": ("recsys.core.records", "TrainRecord"),
    "MetricsRecord": ("recsys.core.records", "MetricsRecord"),
    "ExportRecord": ("recsys.core.records", "ExportRecord"),
    "read_record": ("recsys.core.records", "read_record"),
    # The nightly: every stage, under the lock, finished stages skipped.
    "run_nightly": ("conductor.nightly", "run_nightly"),
    "backfill": ("conductor.nightly", "backfill"),
    "NightlyResult": ("conductor.nightly", "NightlyResult"),
    # Trained models and their artifacts.
    "TrainedModel": ("recsys.model", "TrainedModel"),
    "evaluate_model": ("recsys.model_evaluation", "evaluate_model"),
    "load_embeddings": ("serving_export.manifest", "load_embeddings"),
    "export_embeddings": ("serving_export.formats", "export_embeddings"),
    # Comparing runs, and online A/B tests.
    "compare": ("recsys.tracking.compare", "compare"),
    "assign": ("recsys.ab.assignment", "assign"),
    "assign_file": ("recsys.ab.workflow", "assign_file"),
    "analyze_experiment": ("recsys.ab.workflow", "analyze_experiment"),
    "plan": ("recsys.ab.planning", "plan"),
    # Errors: each carries its CLI exit code (README, "The CLI").
    "RecsysError": ("recsys.core.errors", "RecsysError"),
    "ConfigError": ("recsys.core.errors", "ConfigError"),
    "DataError": ("recsys.core.errors", "DataError"),
    "EmbeddingsContractError": ("recsys.core.errors", "EmbeddingsContractError"),
    "StageNotReadyError": ("recsys.core.errors", "StageNotReadyError"),
    "ExportVerificationError": ("recsys.core.errors", "ExportVerificationError"),
    "TrackingError": ("recsys.core.errors", "TrackingError"),
    "OutOfMemoryError": ("recsys.core.errors", "OutOfMemoryError"),
    "WorkdirLockedError": ("recsys.core.errors", "WorkdirLockedError"),
    "StorageError": ("recsys.core.errors", "StorageError"),
    "ServedModelError": ("recsys.core.errors", "ServedModelError"),
    "StageFailedError": ("recsys.core.errors", "StageFailedError"),
    "RecordError": ("recsys.core.records", "RecordError"),
}

__all__ = [
    "ConfigError",
    "DataError",
    "EmbeddingsContractError",
    "ExportRecord",
    "ExportResult",
    "ExportVerificationError",
    "MetricsRecord",
    "NightlyResult",
    "OutOfMemoryError",
    "PublishResult",
    "RecordError",
    "RecsysConfig",
    "RecsysError",
    "ServedModelError",
    "StageFailedError",
    "StageNotReadyError",
    "StatsRecord",
    "StorageError",
    "TrackingError",
    "TrainRecord",
    "TrainResult",
    "TrainedModel",
    "Workdir",
    "WorkdirLock",
    "WorkdirLockedError",
    "analyze_experiment",
    "assign",
    "assign_file",
    "backfill",
    "compare",
    "evaluate",
    "evaluate_model",
    "export",
    "export_embeddings",
    "load_config",
    "load_embeddings",
    "parse_config",
    "parse_date",
    "plan",
    "preprocess",
    "publish",
    "read_record",
    "resolve_config",
    "run_nightly",
    "sync",
    "train",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562) and keep the object here."""
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _SOURCES[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (what `__all__` lists), for dir() and completion."""
    return sorted(__all__)
