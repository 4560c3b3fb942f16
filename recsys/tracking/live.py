"""Watching a night train: each epoch's metrics reach the nightly's MLflow run as it ends.

The nightly's MLflow run is identified by date, config digest and data fingerprint
(recsys.tracking.runs), all known before training starts, so training opens (or finds) that
run and logs every epoch with `step` = the 0-based epoch; publishing later completes the same
run and skips the metric keys it already holds. Keys are Keras' epoch logs (`loss`,
`val_loss`, the validation callback's `val_recall_at_50`, ...) plus `epoch_seconds` (the
epoch's wall time, validation included); a `training.refit` fit logs them prefixed `refit_`,
each of `training.candidates` beyond the config's own `candidate<i>_`.

- A resumed training continues at the epoch its checkpoint holds: an epoch is logged only
  after its checkpoint was written (the callback runs after the trainer's), so no step is
  logged twice.
- A fit that starts over on a run whose series already reaches that epoch (a retrain of an
  unpublished run: `--rerun-from train`, a lost checkpoint) supersedes it: the old run is
  deleted (restorable with `mlflow runs restore`) and a new one with the same identity is
  created, so one run never holds two trainings' points at one step. A training that starts
  again in another run folder of this workdir (a bucket workdir names one per attempt)
  supersedes the unpublished runs the earlier attempts left RUNNING the same way.
- A run that is already published is left alone (publishing would not change it either).
- The tracking store is optional while training: on the first failure a warning is logged
  once and live logging stops; publishing logs the history file as before.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tensorflow as tf
from mlflow import MlflowClient
from mlflow.entities import Metric

from recsys.core.config import RecsysConfig
from recsys.core.errors import TrackingError
from recsys.core.faults import fault_point
from recsys.tracking.runs import (
    RUN_FOLDER_TAG,
    TRACKING_FAILURES,
    bounded_http_retries,
    connect,
    ensure_experiment,
    experiment_name,
    metric_key,
    nightly_run,
    nightly_run_tags,
    owner_tags,
    redact_credentials,
    resolve_tracking_uri,
    supersede_unpublished,
)

log = logging.getLogger(__name__)

EPOCH_SECONDS = "epoch_seconds"
LOSS = "loss"


class EpochMetricsLogger(tf.keras.callbacks.Callback):
    """Logs each epoch's metrics to the nightly's MLflow run (step = epoch) as it ends.

    Give it to `recsys.training.trainer.train(callbacks=...)`; the trainer names each fit
    through `begin_fit` (`train`, `refit`). Never raises a tracking failure into training.
    """

    def __init__(
        self,
        config: RecsysConfig,
        workdir: Path,
        run_date: dt.date,
        stats: dict[str, Any],
        tracking_uri: str | None = None,
        run_folder: str | None = None,
    ) -> None:
        super().__init__()
        self._config, self._workdir, self._date, self._stats = config, workdir, run_date, stats
        # The run folder is part of the run's identity: publishing finds this run by it.
        # The owner (host, workdir, pid) lets a later attempt and `recsys repair` find it.
        self._extra = owner_tags(workdir)
        if run_folder is not None:
            self._extra[RUN_FOLDER_TAG] = run_folder
        self._uri = tracking_uri or resolve_tracking_uri(config, workdir)
        self._client: MlflowClient | None = None
        self._experiment_id = ""
        self.run_id: str | None = None
        self._opened = False
        self._prefix = ""
        self._next: str | None = None
        self._first_epoch: int | None = None
        self._epoch_start = 0.0

    def begin_fit(self, name: str) -> None:
        """The fit that starts next: `refit` (or `candidate1`, ...) metrics are logged as
        `refit_<key>` (`candidate1_<key>`)."""
        self._next = name

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        fit = self._next or "train"
        self._next = None
        # The config's own first fit logs bare keys; a refit or a candidate's fit its prefix.
        self._prefix = "" if fit == "train" else f"{fit}_"
        self._first_epoch = None
        if not self._opened:
            self._opened = True
            self._guard(self._open)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch_start = time.perf_counter()
        if self._first_epoch is None:
            self._first_epoch = epoch
            if self.run_id is not None:
                self._guard(lambda: self._supersede_if_restarted(epoch))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        seconds = time.perf_counter() - self._epoch_start
        values = {**_scalars(logs or {}), EPOCH_SECONDS: seconds}
        if self.run_id is not None:
            self._guard(lambda: self._log(epoch, values))
        fault_point("train:epoch-logged")

    # -- MLflow -----------------------------------------------------------------------------

    def _open(self) -> None:
        # One probe: a dead server must not hold training up (publishing retries later).
        client = connect(self._config, self._workdir, self._uri, attempts=1)
        self._experiment_id = ensure_experiment(
            client, experiment_name(self._config), self._uri, self._workdir
        )
        tags = nightly_run_tags(self._config, self._date, self._stats, self._extra)
        run_id, logged = nightly_run(client, self._experiment_id, tags, self._date)
        if logged:
            log.info(
                "MLflow run %s (this date, config and data) is already published: the epochs "
                "are not logged to it again",
                run_id,
            )
            return
        self._client, self.run_id = client, run_id
        log.info("logging each epoch to MLflow run %s", run_id)
        for stale in supersede_unpublished(client, self._experiment_id, tags, keep=run_id):
            log.info(
                "MLflow run %s (an unpublished training of this date, config and data in "
                "another run folder) deleted: this training replaces it",
                stale,
            )

    def _supersede_if_restarted(self, epoch: int) -> None:
        assert self._client is not None and self.run_id is not None
        history = self._client.get_metric_history(self.run_id, self._prefix + LOSS)
        if not any(m.step >= epoch for m in history):
            return  # a fresh run, or a resume after the last logged epoch
        old = self.run_id
        tags = nightly_run_tags(self._config, self._date, self._stats, self._extra)
        self._client.set_tag(old, "recsys.superseded", "true")
        self._client.delete_run(old)
        self.run_id, _ = nightly_run(self._client, self._experiment_id, tags, self._date)
        log.info(
            "training starts over at epoch %d: MLflow run %s (an earlier, unpublished training "
            "of this date, config and data) deleted, epochs go to run %s",
            epoch + 1,
            old,
            self.run_id,
        )

    def _log(self, epoch: int, values: dict[str, float]) -> None:
        assert self._client is not None and self.run_id is not None
        now = int(time.time() * 1000)
        metrics = [
            Metric(metric_key(self._prefix + key), value, now, epoch)
            for key, value in values.items()
        ]
        self._client.log_batch(self.run_id, metrics=metrics)

    def _guard(self, action: Callable[[], None]) -> None:
        """Run MLflow calls; on a failure warn (once: logging stops) and let training go on."""
        try:
            with bounded_http_retries():
                action()
        except (TrackingError, *TRACKING_FAILURES) as exc:
            reason = redact_credentials((str(exc).strip().splitlines() or [""])[0])[:300]
            log.warning(
                "could not log epoch metrics to MLflow at %s (%s: %s): training goes on "
                "without them; publishing logs the training history as usual",
                redact_credentials(self._uri),
                type(exc).__name__,
                reason,
            )
            self._client, self.run_id = None, None


def _scalars(logs: dict[str, Any]) -> dict[str, float]:
    """The numeric scalars of Keras' epoch logs, as floats."""
    values = {}
    for key, value in logs.items():
        try:
            values[key] = float(value)
        except (TypeError, ValueError):
            continue  # not a scalar metric (none of ours): nothing to plot
    return values
