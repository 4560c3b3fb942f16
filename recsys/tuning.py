"""Hyper-parameter search on the validation split, tracked in MLflow (`recsys tune`).

Optuna's TPE sampler proposes the settings of `tune.space` (dotted model.* / training.*
keys); each trial trains the two-tower model on the train split with the exact validation
metric `tune.metric` computed after every epoch (`recsys.training.trainer`, which reads the
train and validation splits only). Each epoch's value is reported to Optuna, whose median
pruner stops a trial that is below the median of the earlier trials at the same epoch. A
trial's value is what the nightly would keep: the best epoch's metric when early stopping
keeps the best epoch, else the last epoch's. Every trial is an MLflow child run (per-epoch
curve, its settings, its outcome) under one parent run holding the search space and the
winner; the winner is written as a config YAML the nightly uses as it is. Trial 0 is the
base config's own settings (`tune.baseline`), so the written winner is known to beat, on the
same validation item, the config the search started from, or is that config.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
import os
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import requests
import tensorflow as tf
import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from recsys.core.config import (
    RecsysConfig,
    SearchDimension,
    parse_config,
    set_dotted,
    set_values,
)
from recsys.core.errors import DataError, OutOfMemoryError, StageFailedError, TrackingError
from recsys.core.layout import DataFile
from recsys.core.progress import bar
from recsys.core.resolve import resolve_config
from recsys.tracking import runs as tracking
from recsys.training.trainer import train

log = logging.getLogger(__name__)

KIND_TAG = "recsys.kind"
# What MLflow's client raises when its store cannot be reached or written (as recsys.tracking).
_TRACKING_FAILURES = (MlflowException, requests.RequestException, OSError)
STATE_TAG = "recsys.trial_state"
ROLE_TAG = "recsys.trial_role"
_BASELINE = "baseline"


def tune_experiment(config: RecsysConfig) -> str:
    """The MLflow experiment of a model's searches, next to (not inside) its nightly runs."""
    return f"{tracking.experiment_name(config)}-tune"


def preprocess_config(config: RecsysConfig) -> RecsysConfig:
    """The config to preprocess the tuning data with: histories long enough for every trial."""
    longest = max(config.preprocess.history_length, _largest(config, "model.history_length"))
    return set_values(config, {"preprocess.history_length": longest})


def _largest(config: RecsysConfig, key: str) -> int:
    dimension = config.tune.space.get(key)
    return 0 if dimension is None else int(max(dimension.values_to_check()))


def trial_config(config: RecsysConfig, params: dict[str, Any]) -> RecsysConfig:
    """The config one trial trains with: `params` set, early stopping on the tuned metric.

    No refit: a trial is scored on the validation split, which a refit would train on (the
    written best config keeps the base config's `training.refit`). No `dense_log` rule: a
    trial trains with the settings it is scored for, whatever the log's shape.
    """
    values = {
        **params,
        "training.early_stopping_metric": config.tune.metric,
        "training.refit": "off",
        "dense_log": None,
    }
    history = params.get("model.history_length", config.model.history_length)
    values["preprocess.history_length"] = max(config.preprocess.history_length, int(history))
    return set_values(config, values)


def baseline_params(
    config: RecsysConfig, stats: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str | None]:
    """The base config's values of the searched keys, or ({}, why they cannot be a trial).

    With the data's `stats`, `auto` model settings are resolved as training would resolve
    them (recsys.core.resolve), so `user_embedding: auto` is the baseline's true or false.
    """
    params = base_values(config, stats)
    for key, dimension in config.tune.space.items():
        if not dimension.contains(params[key]):
            shown = dimension.model_dump(exclude_none=True, exclude_defaults=True)
            value = params[key]
            return {}, f"the base config's {key}={value!r} is outside tune.space ({shown})"
    return params, None


def base_values(config: RecsysConfig, stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """The base config's values of the searched keys; `auto` resolved only given `stats`."""
    trained = config if stats is None else resolve_config(config, stats).config
    values = trained.flat()
    return {key: values[key] for key in config.tune.space}


def suggest(trial: optuna.Trial, space: dict[str, SearchDimension]) -> dict[str, Any]:
    """One trial's settings, sampled from the search space."""
    params: dict[str, Any] = {}
    for key, d in space.items():
        if d.choices is not None:
            params[key] = trial.suggest_categorical(key, d.choices)
        elif d.is_int:
            low, high = d.bounds
            step = int(d.step or 1)
            params[key] = trial.suggest_int(key, int(low), int(high), step=step, log=d.log)
        else:
            low, high = d.bounds
            params[key] = trial.suggest_float(key, low, high, step=d.step, log=d.log)
    return params


class _Reporter(tf.keras.callbacks.Callback):
    """After each epoch: the validation metric to Optuna and to the trial's MLflow run.

    Runs after the trainer's validation callback, which put `val_<metric>` in the logs.
    A trial the pruner rejects stops training at the end of that epoch; so does a trial
    still running at the search's `deadline` (time.monotonic()), which keeps its epochs so far.
    """

    def __init__(
        self,
        trial: optuna.Trial,
        client: MlflowClient,
        run_id: str,
        metric: str,
        deadline: float | None = None,
    ) -> None:
        super().__init__()
        self.trial, self.client, self.run_id, self.key = trial, client, run_id, f"val_{metric}"
        self.deadline = deadline
        self.values: list[float] = []
        self.pruned = False
        self.timed_out = False

    @property
    def state(self) -> str:
        """How the trial ended: pruned, timed_out (at the search's deadline) or complete."""
        return "pruned" if self.pruned else "timed_out" if self.timed_out else "complete"

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        logs = logs or {}
        if self.key not in logs:
            raise StageFailedError(f"training reported no {self.key}: is the validation empty?")
        value = float(logs[self.key])
        self.values.append(value)
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, epoch) for k, v in logs.items() if k in _CURVES]
        metrics.append(Metric(self.key, value, now, epoch))
        with tracking.bounded_http_retries():
            self.client.log_batch(self.run_id, metrics=metrics)
        self.trial.report(value, epoch)
        if self.trial.should_prune():
            log.info("trial %d pruned after epoch %d (%s=%.4f)", self.trial.number,
                     epoch + 1, self.key, value)  # fmt: skip
            self.pruned = True
            self.model.stop_training = True
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            log.info("trial %d stopped after epoch %d: the search's timeout has passed",
                     self.trial.number, epoch + 1)  # fmt: skip
            self.timed_out = True
            self.model.stop_training = True


_CURVES = ("loss",)


@dataclass
class TuneResult:
    """The outcome of a search."""

    parent_run_id: str
    experiment: str
    best_params: dict[str, Any]
    best_value: float
    best_trial: int
    output: Path
    states: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    # The base config's own trial: its value (None: not run or not complete), or why skipped.
    baseline_value: float | None = None
    baseline_skipped: str | None = None
    best_is_baseline: bool = False  # no sampled trial beat the base config's own settings


def tune(
    config: RecsysConfig,
    data_dir: Path,
    output: Path,
    *,
    workdir: Path,
    trials: int | None = None,
    timeout_seconds: float | None = None,
    base_yaml: dict[str, Any] | None = None,
    run_date: dt.date | None = None,
    callbacks: Sequence[tf.keras.callbacks.Callback] = (),
) -> TuneResult:
    """Search `config.tune.space` on data_dir's validation split; write the winner to `output`.

    `base_yaml` is the config file as written (the output keeps its layout and data section);
    by default the whole validated config is written. The test split is never read.
    `callbacks` are given to every trial's training (a progress bar).
    """
    stats = json.loads((Path(data_dir) / DataFile.STATS).read_text())
    if not int(stats.get("splits", {}).get("validation", 0)):
        raise DataError(
            f"{data_dir} has no validation examples: tuning needs users with at least "
            f"preprocess.min_user_interactions ({config.preprocess.min_user_interactions}) events"
        )
    tc = config.tune
    trials = trials or tc.trials
    timeout_seconds = timeout_seconds or tc.timeout_seconds
    uri = tracking.resolve_tracking_uri(config, workdir)
    experiment = tune_experiment(config)
    try:
        client = tracking.connect(config, workdir, uri)
        with tracking.bounded_http_retries():
            experiment_id = tracking.ensure_experiment(client, experiment, uri, workdir)
            parent = _start_parent(client, experiment_id, config, stats, trials, run_date)
    except _TRACKING_FAILURES as exc:
        raise _tracking_error(uri, exc) from None
    study = optuna.create_study(
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=tc.seed),
        pruner=_pruner(config),
    )
    # Optuna's timeout only keeps new trials from starting; the deadline also ends the running
    # trial after its current epoch, so a search overruns its budget by one epoch at most.
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    objective = _Objective(
        config, Path(data_dir), client, experiment_id, parent, deadline, list(callbacks)
    )
    start = time.perf_counter()
    status = RunStatus.FAILED
    try:
        skipped = _enqueue_baseline(config, stats, study, client, parent)
        # An out-of-memory trial (too big a batch) fails alone; the search goes on.
        with bar("tune", trials, "trials") as done:

            def finished(_study: optuna.Study, _trial: optuna.trial.FrozenTrial) -> None:
                done.update()

            study.optimize(
                objective, n_trials=trials, timeout=timeout_seconds, catch=(OutOfMemoryError,),
                callbacks=[finished],
            )  # fmt: skip
        result = _finish(config, study, client, parent, experiment, output, base_yaml)
        result.seconds = time.perf_counter() - start
        result.baseline_skipped = skipped
        status = RunStatus.FINISHED
        return result
    except _TRACKING_FAILURES as exc:
        raise _tracking_error(uri, exc) from None
    finally:
        with suppress(*_TRACKING_FAILURES), tracking.bounded_http_retries():
            client.set_terminated(parent, RunStatus.to_string(status))


def _tracking_error(uri: str, exc: Exception) -> TrackingError:
    reason = tracking.redact_credentials((str(exc).strip().splitlines() or [""])[0])[:300]
    return TrackingError(
        f"could not record the search in MLflow at {tracking.redact_credentials(uri)} "
        f"({type(exc).__name__}: {reason}); check the server (mlflow/README.md) or set "
        "tracking.uri / MLFLOW_TRACKING_URI"
    )


def _enqueue_baseline(
    config: RecsysConfig,
    stats: dict[str, Any],
    study: optuna.Study,
    client: MlflowClient,
    parent: str,
) -> str | None:
    """Make trial 0 the base config's settings; None, or why there is no such trial."""
    reason: str | None
    if not config.tune.baseline:
        reason = "tune.baseline is false"
    else:
        params, reason = baseline_params(config, stats)
    if reason is None:
        study.enqueue_trial(params, user_attrs={_BASELINE: True})
        log.info("trial 0 is the baseline: the base config's settings %s", params)
    else:
        log.warning("no baseline trial: %s", reason)
    with tracking.bounded_http_retries():
        client.log_param(parent, "baseline", "trial 0" if reason is None else reason[:500])
    return reason


def _pruner(config: RecsysConfig) -> optuna.pruners.BasePruner:
    if config.tune.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(
        n_startup_trials=config.tune.startup_trials, n_warmup_steps=config.tune.warmup_epochs
    )


def _start_parent(
    client: MlflowClient,
    experiment_id: str,
    config: RecsysConfig,
    stats: dict[str, Any],
    trials: int,
    run_date: dt.date | None,
) -> str:
    stamp = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
    tags = {
        MLFLOW_RUN_NAME: f"tune-{run_date or stamp}",
        KIND_TAG: "tune",
        "model_name": config.model_name,
        "base_config_digest": config.digest(),
        "data_fingerprint": str(stats.get("fingerprint", "")),
        "git_commit": tracking.git_commit(),
    }
    run_id = client.create_run(experiment_id, tags=tags).info.run_id
    tc = config.tune
    params = [Param(f"space.{k}", json.dumps(v.model_dump(exclude_none=True)))
              for k, v in tc.space.items()]  # fmt: skip
    params += [
        Param("metric", tc.metric),
        Param("trials", str(trials)),
        Param("pruner", tc.pruner),
        Param("seed", str(tc.seed)),
    ]
    client.log_batch(run_id, params=params)
    return run_id


class _Objective:
    """One Optuna trial: train with the sampled settings, tracked as an MLflow child run."""

    def __init__(
        self,
        config: RecsysConfig,
        data_dir: Path,
        client: MlflowClient,
        experiment_id: str,
        parent: str,
        deadline: float | None = None,
        callbacks: list[tf.keras.callbacks.Callback] | None = None,
    ) -> None:
        self.config, self.data_dir = config, data_dir
        self.client, self.experiment_id, self.parent = client, experiment_id, parent
        self.deadline = deadline
        self.callbacks = callbacks or []

    def __call__(self, trial: optuna.Trial) -> float:
        params = suggest(trial, self.config.tune.space)
        settings = trial_config(self.config, params)
        with tracking.bounded_http_retries():
            run_id = self.client.create_run(
                self.experiment_id,
                tags={
                    MLFLOW_PARENT_RUN_ID: self.parent,
                    MLFLOW_RUN_NAME: f"trial-{trial.number}",
                    KIND_TAG: "tune-trial",
                    ROLE_TAG: _BASELINE if trial.user_attrs.get(_BASELINE) else "sampled",
                    "optuna.trial": str(trial.number),
                },
            ).info.run_id
            self.client.log_batch(
                run_id, params=[Param(k, json.dumps(v)) for k, v in params.items()]
            )
        trial.set_user_attr("mlflow_run_id", run_id)
        reporter = _Reporter(trial, self.client, run_id, self.config.tune.metric, self.deadline)
        log.info("trial %d: %s", trial.number, params)
        state, status = "failed", RunStatus.FAILED
        try:
            result = train(settings, self.data_dir, callbacks=[reporter, *self.callbacks])
            value = _trial_value(settings, reporter.values)
            with tracking.bounded_http_retries():
                self.client.log_metric(run_id, f"validation_{self.config.tune.metric}", value)
                self.client.log_metric(
                    run_id, "examples_per_second", result.steady_examples_per_second
                )
            state, status = reporter.state, RunStatus.FINISHED
        finally:
            with tracking.bounded_http_retries():
                self.client.set_tag(run_id, STATE_TAG, state)
                self.client.set_terminated(run_id, RunStatus.to_string(status))
            # Each trial builds new towers: free the previous trials' graphs.
            tf.keras.backend.clear_session()
        if reporter.pruned:
            raise optuna.TrialPruned()
        return value


def _trial_value(settings: RecsysConfig, values: list[float]) -> float:
    """What the nightly keeps: the best epoch under early stopping, else the last one."""
    if not values:
        raise StageFailedError("a trial finished without one validation value")
    return max(values) if settings.training.early_stopping_patience else values[-1]


def _finish(
    config: RecsysConfig,
    study: optuna.Study,
    client: MlflowClient,
    parent: str,
    experiment: str,
    output: Path,
    base_yaml: dict[str, Any] | None,
) -> TuneResult:
    states = {
        s.name.lower(): sum(t.state == s for t in study.trials)
        for s in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                  optuna.trial.TrialState.FAIL)
    }  # fmt: skip
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        raise StageFailedError(
            f"no tuning trial completed ({states}); see the MLflow parent run {parent} "
            "in experiment " + experiment
        )
    best = study.best_trial
    baseline = next((t.value for t in complete if t.user_attrs.get(_BASELINE)), None)
    best_is_base = bool(best.user_attrs.get(_BASELINE))
    # The baseline won: its settings as the written file has them (`auto` stays auto).
    best_params = base_values(config) if best_is_base else best.params
    metric = config.tune.metric
    header = (
        f"Written by `recsys tune` at {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC: best of "
        f"{len(study.trials)} trials on the validation split (trial {best.number}, "
        f"{metric} = {best.value:.4f}; {_against_baseline(best, baseline)}); MLflow "
        f"experiment {experiment}, parent run {parent}. Use it as it is: recsys nightly "
        "--config <this file>"
    )
    # The baseline won: the base settings as written (an `auto` stays auto), not as resolved.
    write_config(config, {} if best_is_base else best.params, output, base_yaml, header)
    now = int(time.time() * 1000)
    metrics = [Metric(f"best_validation_{metric}", study.best_value, now, 0)]
    metrics += [Metric(f"trials_{k}", float(v), now, 0) for k, v in states.items()]
    if baseline is not None:
        metrics.append(Metric(f"baseline_validation_{metric}", baseline, now, 0))
    with tracking.bounded_http_retries():
        client.log_batch(
            parent,
            metrics=metrics,
            params=[Param(f"best.{k}", json.dumps(v)) for k, v in best_params.items()],
        )
        client.set_tag(parent, "best_trial_run_id", best.user_attrs.get("mlflow_run_id", ""))
        tracking.log_file_redacted(client, parent, output)
    return TuneResult(
        parent, experiment, best_params, study.best_value, best.number, output, states,
        baseline_value=baseline, best_is_baseline=best_is_base,
    )  # fmt: skip


def _against_baseline(best: optuna.trial.FrozenTrial, baseline: float | None) -> str:
    if baseline is None:
        return "no baseline trial completed"
    if best.user_attrs.get(_BASELINE):
        return "the base config's own settings: no sampled trial beat them"
    return f"the base config's own settings scored {baseline:.4f}"


def write_config(
    config: RecsysConfig,
    params: dict[str, Any],
    output: Path,
    base_yaml: dict[str, Any] | None = None,
    header: str = "",
) -> Path:
    """The base config with the winning settings, validated, written atomically to `output`.

    Also set: early stopping on the tuned metric (what the trials were judged by), histories
    preprocessed at least as long as the model reads, and no `dense_log` rule.
    """
    settings = trial_config(config, params)
    raw = copy.deepcopy(base_yaml) if base_yaml is not None else config.model_dump(mode="json")
    values = {
        **params,
        "training.early_stopping_metric": settings.training.early_stopping_metric,
        "preprocess.history_length": settings.preprocess.history_length,
        # The winner was measured as written: a shape rule must not replace its settings.
        "dense_log": None,
    }
    for key, value in values.items():
        set_dotted(raw, key, value)
    parse_config(raw, source=str(output))  # what is written must load
    text = "".join(f"# {line}\n" for line in _wrap(header)) + yaml.safe_dump(raw, sort_keys=False)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, output)  # a nightly reading the file never sees half of it
    return output


def _wrap(text: str, width: int = 96) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return [*lines, line] if line else lines
