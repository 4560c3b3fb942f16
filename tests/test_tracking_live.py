"""Live epoch logging (recsys.tracking.live) on real trainings: a retrain supersedes an
unpublished run's series, and a dead tracking server never fails training.

The nightly end to end (a run killed after its first epoch and resumed against a real
server) is tests/test_mlflow_model.py.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import ViewType

from recsys.core.config import RecsysConfig, TrackingConfig
from recsys.core.layout import DataFile, Workdir
from recsys.tracking.live import EpochMetricsLogger
from recsys.tracking.runs import default_tracking_uri, experiment_name
from recsys.training.trainer import train
from tests.mlflow_server import free_port
from tests.test_training_engine import with_updates

DATE = dt.date(2026, 1, 5)


def _train(config: RecsysConfig, data_dir: Path, workdir: Path) -> EpochMetricsLogger:
    stats = json.loads((data_dir / DataFile.STATS).read_text())
    logger = EpochMetricsLogger(config, workdir, DATE, stats)
    train(config, data_dir, callbacks=[logger])
    return logger


def test_a_retrain_of_an_unpublished_run_starts_a_new_series(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    """The same date, config and data trained again from epoch 0 (e.g. `--rerun-from train`
    before publishing): its epochs go to a new run; the old run's series is not mixed in."""
    config, _, data_dir = prepared
    config = with_updates(config, training={"epochs": 2})
    first = _train(config, data_dir, tmp_path)
    second = _train(config, data_dir, tmp_path)
    assert first.run_id and second.run_id and first.run_id != second.run_id
    client = MlflowClient(default_tracking_uri(tmp_path))
    experiment = client.get_experiment_by_name(experiment_name(config))
    assert experiment is not None
    active = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in active] == [second.run_id]
    deleted = client.search_runs([experiment.experiment_id], run_view_type=ViewType.DELETED_ONLY)
    assert [r.info.run_id for r in deleted] == [first.run_id]
    for key in ("loss", "val_recall_at_50", "epoch_seconds"):
        steps = [m.step for m in client.get_metric_history(second.run_id, key)]
        assert sorted(steps) == [0, 1], key


def test_an_unreachable_server_warns_once_and_training_goes_on(
    prepared: tuple[RecsysConfig, Workdir, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config, _, data_dir = prepared
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tracking = TrackingConfig(uri=dead, retries=3, backoff_seconds=5)
    config = with_updates(config, training={"epochs": 2}).model_copy(update={"tracking": tracking})
    with caplog.at_level(logging.WARNING, logger="recsys.tracking.live"):
        logger = _train(config, data_dir, tmp_path)
    warnings = [r for r in caplog.records if r.name == "recsys.tracking.live"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert dead in warnings[0].getMessage() and "training goes on" in warnings[0].getMessage()
    assert logger.run_id is None
