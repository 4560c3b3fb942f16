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
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import tensorflow as tf
import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from recsys import tuning_parallel
from recsys.core.config import (
    RecsysConfig,
    SearchDimension,
    parse_config,
    set_dotted,
    set_values,
)
from recsys.core.errors import (
    DataError,
    OutOfMemoryError,
    RecsysError,
    StageFailedError,
    TrackingError,
)
from recsys.core.logs import configure_logging
from recsys.core.progress import bar
from recsys.core.records import read_stats
from recsys.core.redact import redact_text
from recsys.core.resolve import resolve_config
from recsys.tracking import runs as tracking
from recsys.training.trainer import train
from recsys.tuning_study import (
    BASELINE_ATTR,
    KILLED_ATTR,
    PARENT_ATTR,
    PID_ATTR,
    RETRY_ATTR,
    STATE_TAG,
    STUDY_TAG,
    WORKER_ATTR,
    Resumed,
    mark_killed_runs,
    open_storage,
    requeue_running,
    resume,
    sampler_seed,
    seconds_spent,
    study_name,
    study_storage_url,
    trials_ended,
)

log = logging.getLogger("recsys.tuning" if __name__ == "__main__" else __name__)

KIND_TAG = "recsys.kind"
ROLE_TAG = "recsys.trial_role"
_BASELINE = "baseline"
# Parent run tags: how often the search was resumed, its current trial budget, and the
# finished search's parent run a search given a larger budget continues.
RESUMES_TAG = "recsys.resumes"
BUDGET_TAG = "recsys.trials_budget"
CONTINUES_TAG = "recsys.continues"


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
    written best config keeps the base config's `training.refit`). No `dense_log` rule and no
    `training.candidates`: a trial trains with the settings it is scored for, whatever the
    log's shape (the written best config keeps the base config's candidates).
    """
    values = {
        **params,
        "training.early_stopping_metric": config.tune.metric,
        "training.refit": "off",
        "training.candidates": [],
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
    study: str = ""  # the Optuna study's name
    storage: str = ""  # where it lives (credentials removed)
    trials_before: int = 0  # trials that earlier runs of the same search ended
    trials_run: int = 0  # trials this run ended


@dataclass
class _Search:
    """One run of a search: its study, tracking and what is left of its budgets."""

    config: RecsysConfig
    data_dir: Path
    storage_url: str
    resumed: Resumed
    tracking_uri: str
    client: MlflowClient
    experiment_id: str
    parent: str
    trials: int  # the study's trial budget
    left: int  # trials this run may still start
    existing: int  # trials the study had when this run began (sampler seeds)
    seconds_left: float | None  # of the study's time budget
    # Keras callbacks for every trial's training in this process (a progress bar).
    callbacks: list[tf.keras.callbacks.Callback] = field(default_factory=list)


def tune(
    config: RecsysConfig,
    data_dir: Path,
    output: Path,
    *,
    workdir: Path,
    trials: int | None = None,
    timeout_seconds: float | None = None,
    workers: int | None = None,
    base_yaml: dict[str, Any] | None = None,
    run_date: dt.date | None = None,
    callbacks: Sequence[tf.keras.callbacks.Callback] = (),
) -> TuneResult:
    """Search `config.tune.space` on data_dir's validation split; write the winner to `output`.

    The study lives in its storage (recsys.tuning_study): the same search run again continues
    it, and the budgets (`trials`, `timeout_seconds`) count all its runs. `workers` > 1 runs
    trials in that many processes (recsys.tuning_parallel). `base_yaml` is the config file as
    written (the output keeps its layout and data section); by default the whole validated
    config is written. The test split is never read. `callbacks` are given to every trial's
    training in this process (a progress bar; not to worker processes).
    """
    stats = _stats(config, data_dir)
    tc = config.tune
    trials = trials or tc.trials
    timeout_seconds = timeout_seconds or tc.timeout_seconds
    workers = workers or tc.workers
    uri = tracking.resolve_tracking_uri(config, workdir)
    storage_url = study_storage_url(config, workdir, uri)
    storage = open_storage(storage_url)
    name = study_name(config, stats, run_date)
    resumed = resume(storage, name, optuna.samplers.TPESampler(seed=tc.seed), _pruner(config))
    study = resumed.study
    existing, before = len(study.trials), trials_ended(study)
    skipped = _queue_baseline(config, stats, study)
    left, seconds_left = _budget_left(study, trials, timeout_seconds)
    log.info("study %s in %s: %d of %d trials ended before this run; %d to run, %d at once",
             name, redact_text(storage_url), before, trials, left, min(workers, left))  # fmt: skip
    experiment = tune_experiment(config)
    try:
        client = tracking.connect(config, workdir, uri)
        with tracking.bounded_http_retries():
            experiment_id = tracking.ensure_experiment(client, experiment, uri, workdir)
            parent = _parent_run(client, experiment_id, config, stats, trials, run_date,
                                 resumed, skipped, continues=left > 0)  # fmt: skip
    except tracking.TRACKING_FAILURES as exc:
        raise _tracking_error(uri, exc) from None
    search = _Search(config, Path(data_dir), storage_url, resumed, uri, client, experiment_id,
                     parent, trials, left, existing, seconds_left, list(callbacks))  # fmt: skip
    start = time.perf_counter()
    status = RunStatus.FAILED
    try:
        # The study's trials: those of earlier runs count from the start.
        with bar("tune", trials, "trials", initial=before) as done:

            def progress(ended: int) -> None:
                done.update(ended - done.n)

            if left and workers == 1:
                _optimize_here(search, progress)
            elif left:
                _optimize_in_workers(search, storage, workers, progress)
        result = _finish(config, study, client, parent, experiment, output, base_yaml)
        result.seconds = time.perf_counter() - start
        result.baseline_skipped = skipped
        result.study, result.storage = name, redact_text(storage_url)
        result.trials_before, result.trials_run = before, trials_ended(study) - before
        status = RunStatus.FINISHED
        return result
    except tracking.TRACKING_FAILURES as exc:
        raise _tracking_error(uri, exc) from None
    finally:
        with suppress(*tracking.TRACKING_FAILURES), tracking.bounded_http_retries():
            client.set_terminated(parent, RunStatus.to_string(status))


def _queue_baseline(config: RecsysConfig, stats: dict[str, Any], study: optuna.Study) -> str | None:
    """Queue the base config's settings once per study; None, or why there is no such trial."""
    base, skipped = _baseline(config, stats)
    # A resumed study has it already (ended, or queued again if it was killed).
    if base is not None and not any(t.user_attrs.get(BASELINE_ATTR) for t in study.trials):
        study.enqueue_trial(base, user_attrs={BASELINE_ATTR: True})
        log.info("trial 0 is the baseline: the base config's settings %s", base)
    elif skipped is not None:
        log.warning("no baseline trial: %s", skipped)
    return skipped


def _budget_left(
    study: optuna.Study, trials: int, timeout_seconds: float | None
) -> tuple[int, float | None]:
    """Trials this run may start, and seconds it has: the study's budgets less what it used."""
    left = max(trials - trials_ended(study), 0)
    if timeout_seconds is None:
        return left, None
    spent = seconds_spent(study)
    log.info("time budget: %.0f s of %.0f s used by earlier trials", spent, timeout_seconds)
    seconds = timeout_seconds - spent
    return (left if seconds > 0 else 0), seconds


def _stats(config: RecsysConfig, data_dir: Path) -> dict[str, Any]:
    stats = read_stats(Path(data_dir)).as_dict()
    if not int(stats.get("splits", {}).get("validation", 0)):
        raise DataError(
            f"{data_dir} has no validation examples: tuning needs users with at least "
            f"preprocess.min_user_interactions ({config.preprocess.min_user_interactions}) events"
        )
    return stats


def _optimize_here(search: _Search, progress: Callable[[int], None]) -> None:
    """The trials in this process, one after the other."""
    study, tc = search.resumed.study, search.config.tune
    study.sampler = optuna.samplers.TPESampler(seed=sampler_seed(tc.seed, search.existing, 0))
    # Optuna's timeout only keeps new trials from starting; the deadline also ends the running
    # trial after its current epoch, so a search overruns its budget by one epoch at most.
    seconds = search.seconds_left
    deadline = None if seconds is None else time.monotonic() + seconds

    def ended(finished: optuna.Study, _: optuna.trial.FrozenTrial) -> None:
        progress(trials_ended(finished))

    # An out-of-memory trial (too big a batch) fails alone; the search goes on.
    study.optimize(
        _Objective(search, deadline), n_trials=search.left, timeout=seconds,
        catch=(OutOfMemoryError,), callbacks=[ended],
    )  # fmt: skip


def _optimize_in_workers(
    search: _Search,
    storage: optuna.storages.BaseStorage,
    workers: int,
    progress: Callable[[int], None],
) -> None:
    """The trials in `workers` processes at once; each runs its share of what is left."""
    study = search.resumed.study
    deadline = None if search.seconds_left is None else time.time() + search.seconds_left
    shares = [search.left // workers + (i < search.left % workers) for i in range(workers)]
    seed = search.config.tune.seed
    specs = [
        {
            "worker": i, "trials": share, "seed": sampler_seed(seed, search.existing, i),
            "config": search.config.model_dump(mode="json"), "data_dir": str(search.data_dir),
            "study": study.study_name, "uid": search.resumed.uid, "deadline": deadline,
            "tracking_uri": search.tracking_uri, "experiment_id": search.experiment_id,
            "parent": search.parent,
        }
        for i, share in enumerate(shares) if share
    ]  # fmt: skip
    exits = tuning_parallel.run_workers(search.storage_url, study.study_name, specs, progress)
    # A worker that died left its trial RUNNING: failed and queued for the next run.
    requeue_running(study, storage)
    with tracking.bounded_http_retries():
        mark_killed_runs(search.client, search.experiment_id, search.resumed.uid, search.parent)
    error = tuning_parallel.worker_error(exits)
    if error is not None:
        raise error


def run_worker(spec: dict[str, Any]) -> None:
    """One process of a parallel search: its share of the trials, on the proxied study."""
    config = parse_config(spec["config"], source="the tuning worker's settings")
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    # Its share of the cores (the parent pinned it there); 0 leaves TensorFlow's default.
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.GrpcStorageProxy(host=tuning_parallel.HOST, port=spec["port"])
    study = optuna.load_study(
        study_name=spec["study"], storage=storage, pruner=_pruner(config),
        sampler=optuna.samplers.TPESampler(seed=spec["seed"]),
    )  # fmt: skip
    wall = spec["deadline"]
    seconds = None if wall is None else max(wall - time.time(), 0.0)
    resumed = Resumed(study, spec["uid"], new=False, killed=[])
    search = _Search(config, Path(spec["data_dir"]), "", resumed, spec["tracking_uri"],
                     MlflowClient(spec["tracking_uri"]), spec["experiment_id"], spec["parent"],
                     spec["trials"], spec["trials"], 0, seconds)  # fmt: skip
    deadline = None if seconds is None else time.monotonic() + seconds
    log.info("worker %d: %d trial(s) on %d core(s)", spec["worker"], spec["trials"], threads)
    study.optimize(
        _Objective(search, deadline, worker=spec["worker"]), n_trials=spec["trials"],
        timeout=seconds, catch=(OutOfMemoryError,),
    )  # fmt: skip


def _tracking_error(uri: str, exc: Exception) -> TrackingError:
    reason = tracking.redact_credentials((str(exc).strip().splitlines() or [""])[0])[:300]
    return TrackingError(
        f"could not record the search in MLflow at {tracking.redact_credentials(uri)} "
        f"({type(exc).__name__}: {reason}); check the server (mlflow/README.md) or set "
        "tracking.uri / MLFLOW_TRACKING_URI"
    )


def _baseline(
    config: RecsysConfig, stats: dict[str, Any]
) -> tuple[dict[str, Any] | None, str | None]:
    """The base config's settings as trial 0, or None and why there is no such trial."""
    if not config.tune.baseline:
        return None, "tune.baseline is false"
    params, reason = baseline_params(config, stats)
    return (params, None) if reason is None else (None, reason)


def _pruner(config: RecsysConfig) -> optuna.pruners.BasePruner:
    if config.tune.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(
        n_startup_trials=config.tune.startup_trials, n_warmup_steps=config.tune.warmup_epochs
    )


def _parent_run(
    client: MlflowClient,
    experiment_id: str,
    config: RecsysConfig,
    stats: dict[str, Any],
    trials: int,
    run_date: dt.date | None,
    resumed: Resumed,
    skipped: str | None,
    continues: bool,
) -> str:
    """The search's parent run: the study's own, resumed, unless it finished and trials remain.

    Runs the study's dead processes left RUNNING are marked KILLED first. A finished search
    given a larger budget gets a new parent run (tag `recsys.continues`): the first one's
    `best.*` params stay what that run chose.
    """
    previous = resumed.study.user_attrs.get(PARENT_ATTR)
    mark_killed_runs(client, experiment_id, resumed.uid, keep=previous)
    old = _active_run(client, previous)
    if old is not None and (old.info.status != "FINISHED" or not continues):
        client.update_run(old.info.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        resumes = int(old.data.tags.get(RESUMES_TAG, "0")) + 1
        client.set_tag(old.info.run_id, RESUMES_TAG, str(resumes))
        client.set_tag(old.info.run_id, BUDGET_TAG, str(trials))
        log.info("resuming the search's MLflow parent run %s (resume %d)", previous, resumes)
        return old.info.run_id
    note = "trial 0" if skipped is None else skipped[:500]
    if old is not None:
        note = old.data.params.get("baseline", note)
    tags = _parent_tags(config, stats, trials, run_date, resumed.uid)
    if old is not None:
        tags[CONTINUES_TAG] = old.info.run_id
    run_id = client.create_run(experiment_id, tags=tags).info.run_id
    client.log_batch(run_id, params=_parent_params(config, trials, note))
    resumed.study.set_user_attr(PARENT_ATTR, run_id)
    return run_id


def _active_run(client: MlflowClient, run_id: str | None) -> Any:
    """The run, or None when there is none (never created, deleted, another tracking store)."""
    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return run if run.info.lifecycle_stage == "active" else None


def _parent_tags(
    config: RecsysConfig, stats: dict[str, Any], trials: int, run_date: dt.date | None, uid: str
) -> dict[str, str]:
    stamp = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
    return {
        MLFLOW_RUN_NAME: f"tune-{run_date or stamp}",
        KIND_TAG: "tune",
        STUDY_TAG: uid,
        BUDGET_TAG: str(trials),
        "model_name": config.model_name,
        "base_config_digest": config.digest(),
        "data_fingerprint": str(stats.get("fingerprint", "")),
        "git_commit": tracking.git_commit(),
    }


def _parent_params(config: RecsysConfig, trials: int, baseline: str) -> list[Param]:
    tc = config.tune
    params = [Param(f"space.{k}", json.dumps(v.model_dump(exclude_none=True)))
              for k, v in tc.space.items()]  # fmt: skip
    return [
        *params,
        Param("metric", tc.metric),
        Param("trials", str(trials)),
        Param("pruner", tc.pruner),
        Param("seed", str(tc.seed)),
        Param("baseline", baseline),
    ]


class _Objective:
    """One Optuna trial: train with the sampled settings, tracked as an MLflow child run."""

    def __init__(self, search: _Search, deadline: float | None = None, worker: int = 0) -> None:
        self.config, self.data_dir = search.config, search.data_dir
        self.client, self.experiment_id = search.client, search.experiment_id
        self.parent, self.uid = search.parent, search.resumed.uid
        self.deadline, self.worker = deadline, worker
        self.callbacks = search.callbacks

    def __call__(self, trial: optuna.Trial) -> float:
        # First: a process that dies from here on leaves a trial its resume can attribute.
        trial.set_user_attr(PID_ATTR, os.getpid())
        trial.set_user_attr(WORKER_ATTR, self.worker)
        params = suggest(trial, self.config.tune.space)
        settings = trial_config(self.config, params)
        tags = {
            MLFLOW_PARENT_RUN_ID: self.parent,
            MLFLOW_RUN_NAME: f"trial-{trial.number}",
            KIND_TAG: "tune-trial",
            ROLE_TAG: _BASELINE if trial.user_attrs.get(BASELINE_ATTR) else "sampled",
            STUDY_TAG: self.uid,
            "optuna.trial": str(trial.number),
            "recsys.worker": str(self.worker),
            "recsys.pid": str(os.getpid()),
        }
        if trial.user_attrs.get(RETRY_ATTR) is not None:
            tags["recsys.retry_of"] = str(trial.user_attrs[RETRY_ATTR])
        with tracking.bounded_http_retries():
            run_id = self.client.create_run(self.experiment_id, tags=tags).info.run_id
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
    trials = study.get_trials(deepcopy=False)
    # Trials killed with their process are rerun: counted apart, not as failures.
    states = {
        s.name.lower(): sum(t.state == s and not t.user_attrs.get(KILLED_ATTR) for t in trials)
        for s in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                  optuna.trial.TrialState.FAIL)
    }  # fmt: skip
    states["killed"] = sum(bool(t.user_attrs.get(KILLED_ATTR)) for t in trials)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        raise StageFailedError(
            f"no tuning trial completed ({states}); see the MLflow parent run {parent} "
            "in experiment " + experiment
        )
    best = study.best_trial
    baseline = next((t.value for t in complete if t.user_attrs.get(BASELINE_ATTR)), None)
    best_is_base = bool(best.user_attrs.get(BASELINE_ATTR))
    # The baseline won: its settings as the written file has them (`auto` stays auto).
    best_params = base_values(config) if best_is_base else best.params
    metric = config.tune.metric
    header = (
        f"Written by `recsys tune` at {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC: best of "
        f"{trials_ended(study)} trials on the validation split (trial {best.number}, "
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
    if best.user_attrs.get(BASELINE_ATTR):
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


def _worker_main() -> int:
    """`python -m recsys.tuning worker`: settings as JSON on stdin (recsys.tuning_parallel)."""
    spec = json.load(sys.stdin)
    configure_logging(tag=f"worker {spec['worker']}")
    try:
        run_worker(spec)
    except RecsysError as exc:
        error: RecsysError = exc
    except tracking.TRACKING_FAILURES as exc:
        error = _tracking_error(spec["tracking_uri"], exc)
    else:
        return 0
    print(f"recsys: error: tuning worker {spec['worker']}: {redact_text(str(error))}",
          file=sys.stderr)  # fmt: skip
    return error.exit_code


if __name__ == "__main__":
    if sys.argv[1:] != ["worker"]:
        sys.exit("usage: python -m recsys.tuning worker  (settings as JSON on stdin)")
    sys.exit(_worker_main())
