"""Fit a two-tower model on the Beam job's TFRecords (docs/TRAINING.md).

Device layout, precision, checkpoints and early stopping are chosen here from
`TrainingConfig`; the model math lives in `recsys.model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tensorflow as tf

from recsys.core.auto import DeviceFacts
from recsys.core.config import RecsysConfig, TrainingConfig, set_values
from recsys.core.errors import ConfigError, OutOfMemoryError, StorageError, storage_errno
from recsys.core.layout import DataFile
from recsys.core.records import CandidateRecord, read_stats, settings_text
from recsys.core.resolve import Resolved, resolve_config
from recsys.model import (
    ItemFeatures,
    TrainedModel,
    TwoTowerModel,
    UserFeatures,
    read_vocab,
    warm_start,
)
from recsys.training.candidates import (
    CandidatePruner,
    bar_at,
    candidate_configs,
    chosen,
    pruning_bar,
    same_training,
)
from recsys.training.dataset import item_log_probabilities
from recsys.training.fit_input import FitPlan, capped_steps, plan_fit, use_cache
from recsys.training.keras_backup_adapter import BackupEveryStepsAndEpoch
from recsys.training.lazy_adam import LazyAdam
from recsys.training.memory import check_memory
from recsys.training.parameter_servers import is_parameter_server, parameter_server_strategy
from recsys.training.result import TrainResult, load_first_fit, save_first_fit
from recsys.training.validation import ValidationRecall, validation_callback
from recsys.training.windows import TrainingSequences, split_positions

__all__ = [
    "IncrementalStart",
    "TrainResult",
    "ValidationRecall",
    "build_model",
    "is_chief",
    "make_strategy",
    "train",
    "use_cache",
    "validation_callback",
    "write_dir",
]

log = logging.getLogger(__name__)


class EpochTimer(tf.keras.callbacks.Callback):
    """Seconds spent in training steps per epoch (validation and other callbacks excluded),
    and the examples each epoch trained (one-pass windows hold a varying number)."""

    def __init__(self) -> None:
        super().__init__()
        # Keep Keras from converting the logs to numpy after every batch (a device sync).
        self._supports_tf_logs = True
        self.seconds: list[float] = []
        self.examples: list[int] = []
        self._trained: int | None = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._start = self._last = time.perf_counter()
        self._trained = None

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self._last = time.perf_counter()

    def on_test_begin(self, logs: dict[str, float] | None = None) -> None:
        # The validation pass resets the model's metrics right after this: count them first.
        if self._trained is None:
            self._trained = self._count()

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self.seconds.append(self._last - self._start)
        self.examples.append(self._count() if self._trained is None else self._trained)

    def _count(self) -> int:
        """Examples the loss tracker weighed since the epoch began (summed over replicas)."""
        tracker = getattr(self.model, "loss_tracker", None)
        return 0 if tracker is None else round(float(tracker.count.numpy()))


class EpochLogger(tf.keras.callbacks.Callback):
    """One plain log line per epoch (cron-friendly; Keras' progress bar is not)."""

    def __init__(self, epochs: int) -> None:
        super().__init__()
        self.epochs = epochs
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        values = " ".join(f"{k}={v:.4f}" for k, v in (logs or {}).items())
        elapsed = time.perf_counter() - self.start
        log.info("epoch %d/%d %s (%.1fs)", epoch + 1, self.epochs, values, elapsed)


def learning_rate(
    config: TrainingConfig, steps_per_epoch: int
) -> float | tf.keras.optimizers.schedules.LearningRateSchedule:
    """`training.learning_rate` under its schedule, over `epochs` epochs of this many steps."""
    if config.learning_rate_schedule == "cosine":
        # lr(step) = learning_rate * (1 + cos(pi * min(step, S) / S)) / 2, S = epochs * steps.
        return tf.keras.optimizers.schedules.CosineDecay(
            config.learning_rate, decay_steps=max(config.epochs * steps_per_epoch, 1)
        )
    return config.learning_rate


def make_optimizer(
    config: TrainingConfig, precision: str, steps_per_epoch: int = 1
) -> tf.keras.optimizers.Optimizer:
    """The configured optimizer; wrapped in dynamic loss scaling for float16."""
    rate = learning_rate(config, steps_per_epoch)
    if config.optimizer == "adagrad":
        optimizer = tf.keras.optimizers.Adagrad(rate)
    elif config.optimizer == "lazy_adam":
        optimizer = LazyAdam(rate)
    else:
        optimizer = tf.keras.optimizers.Adam(rate)
    if precision == "mixed_float16":
        return tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    return optimizer


def configure_gpus(memory_growth: bool) -> list[tf.config.PhysicalDevice]:
    """Visible GPUs; memory growth on so one job does not grab the whole card."""
    gpus = tf.config.list_physical_devices("GPU")
    if memory_growth:
        for gpu in gpus:
            try:
                tf.config.experimental.set_memory_growth(gpu, True)
            except RuntimeError:  # TF already initialised the GPU in this process: keep going.
                log.warning("GPU memory growth not set: %s already initialised", gpu.name)
    return gpus


def device_facts(
    strategy: tf.distribute.Strategy, gpus: list[tf.config.PhysicalDevice]
) -> DeviceFacts:
    """What the device `auto` rules (recsys.core.auto) look at, as found in this process."""
    details = [tf.config.experimental.get_device_details(gpu) for gpu in gpus]
    capabilities = [d.get("compute_capability", (0, 0)) for d in details]
    return DeviceFacts(
        strategy=_strategy_name(strategy),
        replicas=strategy.num_replicas_in_sync,
        gpu_capabilities=tuple((int(c[0]), int(c[1])) for c in capabilities),
        tf_config_workers=tf_config_workers(),
    )


def tf_config_workers() -> int:
    """How many workers TF_CONFIG names (0 when unset)."""
    raw = os.environ.get("TF_CONFIG", "")
    if not raw:
        return 0
    try:
        return len(json.loads(raw).get("cluster", {}).get("worker", []))
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON with a cluster spec: {exc}") from None


def is_chief(strategy: tf.distribute.Strategy | None = None) -> bool:
    """Whether this process writes the run's artefacts (TF_CONFIG's chief, else worker 0).

    Single-process layouts (no TF_CONFIG, one_device, mirrored) are always the chief. Under
    MultiWorkerMirroredStrategy every worker trains the same model; only the chief (or worker
    0 when the cluster names no chief) writes final files, the others write to a temp dir.
    """
    if strategy is not None and not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return True
    raw = os.environ.get("TF_CONFIG", "")
    try:
        spec = json.loads(raw) if raw else {}
        task = spec.get("task") or {}
        cluster = spec.get("cluster") or {}
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON with a cluster spec: {exc}") from None
    task_type, index = task.get("type"), int(task.get("index", 0))
    if not task_type or task_type == "chief":
        return True
    return task_type == "worker" and index == 0 and "chief" not in cluster


def write_dir(path: Path, chief: bool) -> Path:
    """Where this process writes what belongs in `path`: `path` itself on the chief, else a
    fresh temp dir for the caller to delete (all workers save; only the chief's copy stays)."""
    return path if chief else Path(tempfile.mkdtemp(prefix=f"{path.name}-workertemp-"))


def make_strategy(
    name: str, gpus: list[tf.config.PhysicalDevice], min_shard_bytes: int = 256 << 10
) -> tf.distribute.Strategy:
    """The device layout: auto picks multi_worker / mirrored / one_device; parameter_server
    only when asked (docs/TRAINING.md)."""
    if name == "parameter_server":  # on a worker or ps task this serves and never returns
        return parameter_server_strategy(min_shard_bytes)
    workers = tf_config_workers()
    if name == "auto":
        name = "multi_worker" if workers > 1 else "mirrored" if len(gpus) > 1 else "one_device"
    if name == "multi_worker":
        if workers < 1:
            raise ConfigError(
                "training.strategy multi_worker needs TF_CONFIG naming the cluster's workers"
            )
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "mirrored":
        if gpus:
            return tf.distribute.MirroredStrategy()
        # No GPU: replicate over the logical CPU devices (tests configure several).
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        return tf.distribute.MirroredStrategy(devices=cpus)
    # The default strategy places everything on the first GPU (or the CPU), like
    # OneDeviceStrategy, which BackupAndRestore does not support.
    return tf.distribute.get_strategy()


def build_model(
    config: RecsysConfig,
    data_dir: Path,
    precision: str,
    jit_compile: bool = False,
    steps_per_epoch: int = 1,
) -> tuple[TrainedModel, TwoTowerModel]:
    """Towers under the precision policy; task, metrics and model in float32 (TFRS's task
    fails on mixed float16/bfloat16 inputs, docs/TRAINING.md).

    `steps_per_epoch` (the fit's batches per epoch) sets the learning-rate schedule's length.
    """
    users = read_vocab(data_dir / DataFile.USER_VOCAB)
    items = read_vocab(data_dir / DataFile.ITEM_VOCAB)
    features = ItemFeatures()
    if config.model.item_features:
        features = ItemFeatures.from_parquet(
            data_dir / DataFile.ITEM_FEATURES, items, config.model.max_title_tokens
        )
    user_features = UserFeatures()
    if config.model.user_features:
        user_features = UserFeatures.from_parquet(data_dir / DataFile.USER_FEATURES, users)
    model_config = config.model  # `auto` settings resolved by train()
    tf.keras.mixed_precision.set_global_policy(precision)
    try:
        trained = TrainedModel.build(users, items, model_config, features, user_features)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    model = TwoTowerModel(
        trained.query_tower,
        trained.candidate_tower,
        model_config,
        item_log_probabilities(data_dir, trained),
    )
    model.compile(
        optimizer=make_optimizer(config.training, precision, steps_per_epoch),
        jit_compile=jit_compile,
        steps_per_execution=config.training.steps_per_execution,
    )
    # Every variable exists once the towers are built; BackupAndRestore needs a built model
    # to restore the optimizer's slots along with the weights.
    model.built = True
    return trained, model


def use_jit(training: TrainingConfig) -> bool:
    """`training.jit_compile` as resolved (recsys.core.auto.jit_compile says why auto is off
    on CPU and for sequence input); `on` with sequence input is a config error."""
    if training.jit_compile == "on" and training.input == "sequences":
        raise ConfigError(
            "training.jit_compile on needs training.input rows: one-pass sequence training "
            "selects its trained positions at run time, which XLA cannot compile"
        )
    return training.jit_compile == "on"


@dataclass(frozen=True)
class IncrementalStart:
    """Where an incremental night starts: the serving model and the newest second it saw."""

    model_dir: Path
    since: int  # positions with a later timestamp are the new ones


def train(
    config: RecsysConfig,
    data_dir: Path,
    backup_dir: Path | None = None,
    callbacks: list[tf.keras.callbacks.Callback] | None = None,
    start: IncrementalStart | None = None,
) -> TrainResult:
    """Train towers on data_dir's train split, validating on its validation split.

    `backup_dir` holds resumable checkpoints (tf.keras.callbacks.BackupAndRestore) and the
    early-stopping state: a run killed mid-training and started again with the same folder
    continues where it stopped, with the best epoch so far. Under `training.refit` it also
    keeps the finished first fit, so a run killed during the refit resumes the refit. Under
    several workers only the chief writes there (`TrainResult.chief`). With
    `training.mode: incremental` and a `start`, the fits begin from that model's weights and
    train the positions newer than `start.since` plus a replay sample.
    """
    tc = config.training
    start = start if tc.mode == "incremental" else None
    if tc.mode == "incremental" and tc.input != "sequences":
        raise ConfigError("training.mode incremental needs training.input sequences")
    if tc.mode == "incremental" and start is None:
        log.info("incremental training: no previous model to start from, training in full")
    gpus = configure_gpus(tc.gpu_memory_growth)
    # MultiWorkerMirroredStrategy must exist before other TF ops run in the process.
    strategy = make_strategy(tc.strategy, gpus, tc.ps_min_shard_bytes)
    stats = read_stats(data_dir).as_dict()
    facts = device_facts(strategy, gpus)
    resolved = resolve_config(config, stats, facts)
    for note in resolved.notes:
        log.info("resolved setting: %s", note)
    options = [resolved]
    continues = start is not None or bool(config.training.warm_start_from)
    if config.training.candidates and stats["splits"]["validation"] and not continues:
        options = candidate_configs(config, resolved, stats, facts)
    elif config.training.candidates:
        why = "the run continues one model" if continues else "no validation split to choose on"
        log.info("training.candidates: skipped (%s); the config's own settings train", why)
    config, tc = resolved.config, resolved.config.training
    tf.keras.utils.set_random_seed(tc.seed)
    if tc.deterministic:
        tf.config.experimental.enable_op_determinism()
    previous = None
    if start is not None:
        previous = TrainedModel.load(start.model_dir)
    elif tc.warm_start_from:
        previous = TrainedModel.load(Path(tc.warm_start_from))
    check_memory(config, stats["users"], stats["items"], stats["splits"]["train"])
    sequences = None
    if tc.input == "sequences":
        sequences = TrainingSequences.load(data_dir, config.model.oov_buckets, start is not None)
        if start is not None:
            new = sequences.incremental(start.since, tc.replay_fraction, tc.seed)
            log.info(
                "incremental training from %s: %d positions after %d, replay %.0f%% of older",
                start.model_dir,
                new,
                start.since,
                100 * tc.replay_fraction,
            )
    setup = _Setup(
        strategy=strategy,
        precision=tc.precision,
        jit=use_jit(tc),
        stats=stats,
        previous=previous,
        sequences=sequences,
    )
    extra = callbacks or []
    refit = bool(tc.refit_splits and stats["splits"]["validation"])
    # Only a single process may skip its first fit: a cluster's workers must run the same fits.
    single = _strategy_name(strategy) in ("one_device", "mirrored")
    if len(options) > 1:
        resolved, result = _choose(options, data_dir, setup, backup_dir, extra, single)
        config = resolved.config
    else:
        keep = backup_dir if refit and single and backup_dir is not None else None
        result = _kept_or_first_fit(config, data_dir, setup, backup_dir, extra, keep)
    if refit:
        refit_backup = None if backup_dir is None else backup_dir / REFIT_BACKUP
        result = _refit(config, data_dir, setup, result, extra, refit_backup)
    result.dense_log_settings = resolved.dense_log_settings
    result.resolved = resolved.records()
    return result


def _kept_or_first_fit(
    config: RecsysConfig,
    data_dir: Path,
    setup: _Setup,
    backup_dir: Path | None,
    extra: list[tf.keras.callbacks.Callback],
    keep: Path | None,
    name: str = "train",
) -> TrainResult:
    """The first fit kept under `keep` by an interrupted run, else a new one (kept there)."""
    result = load_first_fit(keep) if keep is not None else None
    if result is not None:
        log.info("training: the first fit ended before the interruption (kept in %s)", keep)
        return result
    result = _first_fit(config, data_dir, setup, backup_dir, extra, name)
    if keep is not None:
        save_first_fit(result, keep)
    return result


def _choose(
    options: list[Resolved],
    data_dir: Path,
    setup: _Setup,
    backup_dir: Path | None,
    extra: list[tf.keras.callbacks.Callback],
    single: bool,
) -> tuple[Resolved, TrainResult]:
    """training.candidates: each option's first fit (the config's own first), the best on
    validation kept. A single process keeps every finished fit in the backup folder, so an
    interrupted run trains none of them again."""
    written = options[0].config.training.candidates
    after = options[0].config.training.candidates_prune_after
    trials: list[CandidateRecord] = []
    best: TrainResult | None = None
    for index, option in enumerate(options):
        settings = written[index - 1] if index else {}
        twin = next((i for i in range(index) if same_training(options[i], option)), None)
        if twin is not None:
            # Nothing to train: the settings are those of an earlier candidate (e.g. the
            # config already sets them); it scores what that one scored.
            log.info("training candidate %d: the same as candidate %d", index + 1, twin + 1)
            same = {"index": index, "settings": settings, "seconds": 0.0}
            trials.append(trials[twin].model_copy(update=same))
            continue
        folder = None if backup_dir is None else backup_dir / f"candidate-{index}"
        log.info(
            "training candidate %d of %d: %s", index + 1, len(options), settings_text(settings)
        )
        tf.keras.utils.set_random_seed(option.config.training.seed)
        keep = folder if single else None
        name = "train" if index == 0 else f"candidate{index}"
        metric = option.config.training.early_stopping_metric
        bar = pruning_bar(trials)
        pruner = CandidatePruner(metric, bar, after) if index and after else None
        callbacks = extra if pruner is None else [pruner, *extra]
        result = _kept_or_first_fit(option.config, data_dir, setup, folder, callbacks, keep, name)
        trial = _trial(index, settings, metric, result)
        score = math.nan if trial.validation is None else trial.validation
        if trial.pruned_after is None:
            log.info("training candidate %d: validation %s %.4f", index + 1, metric, score)
        else:
            log.info(
                "training candidate %d: pruned after epoch %d (validation %s %.4f, below the "
                "%.4f an earlier candidate had by then)",
                index + 1,
                trial.pruned_after,
                metric,
                score,
                bar_at(bar, trial.pruned_after),
            )
        trials.append(trial)
        if chosen(trials) == index:
            best = result
    winner = chosen(trials)
    log.info(
        "training.candidates: kept %d (%s)", winner + 1, settings_text(trials[winner].settings)
    )
    assert best is not None
    best.candidates = [trial.model_dump() for trial in trials]
    best.chosen_candidate = winner
    return options[winner], best


def _trial(
    index: int, settings: dict[str, Any], metric: str, result: TrainResult
) -> CandidateRecord:
    """The record of one candidate's first fit."""
    curve: list[float | None] = list(result.history.get(f"val_{metric}", []))
    return CandidateRecord(
        index=index,
        settings=dict(settings),
        metric=metric,
        validation=result.validation_score,
        best_epoch=result.best_epoch,
        epochs=len(result.epoch_seconds) or len(result.history.get("loss", [])),
        seconds=result.seconds,
        curve=curve,
        pruned_after=result.pruned_after,
    )


def announce_fit(callbacks: list[tf.keras.callbacks.Callback], fit: str) -> None:
    """Tell the callbacks that have a `begin_fit(name)` which fit starts: `train` or `refit`.

    A progress line cannot count the fits it sees: a run resumed during its refit skips the
    first fit, so its first `on_train_begin` is the refit's.
    """
    for callback in callbacks:
        begin = getattr(callback, "begin_fit", None)
        if callable(begin):
            begin(fit)


REFIT_BACKUP = "refit"
"""The refit's BackupAndRestore folder inside the training backup folder."""


@dataclass(frozen=True)
class _Setup:
    """What both fits of a run share: the device layout and the data's statistics."""

    strategy: tf.distribute.Strategy
    precision: str
    jit: bool
    stats: dict[str, Any]
    previous: TrainedModel | None  # training.warm_start_from's model
    sequences: TrainingSequences | None = None  # training.input sequences: read once


def _first_fit(
    config: RecsysConfig,
    data_dir: Path,
    setup: _Setup,
    backup_dir: Path | None,
    extra: list[tf.keras.callbacks.Callback],
    name: str = "train",
) -> TrainResult:
    """The early-stopped fit on the train split (the whole run without `training.refit`);
    `name` is the fit's name for the callbacks (announce_fit)."""
    tc, strategy, stats = config.training, setup.strategy, setup.stats
    replicas = strategy.num_replicas_in_sync
    chief = is_chief(strategy)
    plan = plan_fit(config, data_dir, stats, strategy, ("train",), setup.sequences)
    with strategy.scope():
        trained, model = build_model(
            config, data_dir, setup.precision, setup.jit, _schedule_steps(plan)
        )
        if setup.previous is not None:
            copied = warm_start(trained, setup.previous)
            log.info("warm start: rows taken over %s", copied)
    train_ds, val_ds = plan.datasets(trained, strategy)
    timer = EpochTimer()
    callbacks: list[tf.keras.callbacks.Callback] = [timer]
    validator = None
    if stats["splits"]["validation"]:
        state_dir = None if backup_dir is None else backup_dir / "early_stopping"
        validator = validation_callback(
            config, data_dir, trained, state_dir, chief, setup.sequences
        )
    # The validator saves its state before the epoch's backup: a kill between the two redoes
    # the epoch rather than losing its validation result.
    if validator is not None:
        callbacks.append(validator)
    if backup_dir is not None:
        callbacks.append(
            BackupEveryStepsAndEpoch(
                str(backup_dir), save_freq=tc.checkpoint_every_steps or "epoch"
            )
        )
    callbacks.append(EpochLogger(tc.epochs))  # last: it logs what the others added
    callbacks += extra
    announce_fit(extra, name)
    start = time.perf_counter()
    with _fit_errors(tc, replicas, backup_dir):
        history = model.fit(
            train_ds,
            epochs=tc.epochs,
            steps_per_epoch=_fit_steps(plan, strategy, train_ds),
            validation_data=val_ds,
            validation_steps=None if val_ds is None else capped_steps(tc, val_ds),
            callbacks=callbacks,
            verbose=0,
        )
    seconds = time.perf_counter() - start
    epochs_run = len(history.history.get("loss", [])) or tc.epochs
    # Only when early stopping kept that epoch's weights (otherwise the last epoch's are).
    best_epoch = (
        None
        if validator is None or validator.best_epoch is None or not validator.patience
        else validator.best_epoch + 1
    )
    watched = history.history.get(f"val_{tc.early_stopping_metric}") or [math.nan]
    score = None if validator is None else validator.best if best_epoch else float(watched[-1])
    return TrainResult(
        model=trained,
        history={k: [float(v) for v in vs] for k, vs in history.history.items()},
        examples=sum(timer.examples) if timer.examples else plan.budget_examples * epochs_run,
        seconds=seconds,
        strategy=_strategy_name(strategy),
        replicas=replicas,
        precision=setup.precision,
        best_epoch=best_epoch,
        epoch_seconds=timer.seconds,
        chief=chief,
        jit_compile=setup.jit,
        cached=plan.cached,
        input=tc.input,
        validation_score=score,
        pruned_after=next((c.pruned_after for c in extra if isinstance(c, CandidatePruner)), None),
    )


def _schedule_steps(plan: FitPlan) -> int:
    """Steps one epoch of this plan runs (the learning-rate schedule's unit)."""
    cap = plan.config.training.max_steps_per_epoch
    return min(plan.steps, cap) if cap else plan.steps


def _fit_steps(
    plan: FitPlan, strategy: tf.distribute.Strategy, train_ds: tf.data.Dataset
) -> int | None:
    """`steps_per_epoch` for Keras: the coordinator counts an epoch's steps under parameter
    servers (workers repeat their pipelines); else the step budget, if any."""
    if is_parameter_server(strategy):
        return plan.steps
    return capped_steps(plan.config.training, train_ds)


@contextlib.contextmanager
def _fit_errors(tc: TrainingConfig, replicas: int, backup_dir: Path | None) -> Iterator[None]:
    """TensorFlow's out-of-memory and full-disk errors as the project's actionable errors."""
    try:
        yield
    except tf.errors.ResourceExhaustedError as exc:
        # TensorFlow reports a full disk (a checkpoint write) with the same error type.
        code = storage_errno(exc)
        if code is not None:
            # The errno's own words first: TensorFlow's text starts with a long op name
            # (SaveV2 ...) and a path, which would push them out of a one-line message.
            raise StorageError(
                f"training: {os.strerror(code)} writing a checkpoint under {backup_dir} "
                f"(TensorFlow: {_op_message(exc)}); the data and the checkpoints written so far "
                "are kept: free space there and rerun the same command (training resumes from "
                "its last checkpoint)"
            ) from None
        raise OutOfMemoryError(
            f"out of memory training with training.batch_size={tc.batch_size} on "
            f"{replicas} replica(s): lower training.batch_size (e.g. {max(tc.batch_size // 2, 1)})"
            f" or model.embedding_dim; {str(exc).splitlines()[0][:200]}"
        ) from None


def _op_message(exc: Exception, limit: int = 200) -> str:
    """TensorFlow's first error line without its `{{function_node ...}}` prefix, shortened."""
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    line = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", line)
    return line if len(line) <= limit else "..." + line[-limit:]


def _refit(
    config: RecsysConfig,
    data_dir: Path,
    setup: _Setup,
    first: TrainResult,
    callbacks: list[tf.keras.callbacks.Callback],
    backup_dir: Path | None,
) -> TrainResult:
    """A fresh model trained on `training.refit_splits` for the epochs the first fit chose.

    `callbacks` are the caller's (a progress line), given to both fits; `backup_dir` holds
    the refit's own checkpoints, so a killed refit resumes from its last epoch.
    """
    tc, strategy = config.training, setup.strategy
    splits = tc.refit_splits
    # Without early stopping every configured epoch ran (a resumed fit's history and timer
    # hold only the epochs after the resume, so they cannot count them).
    epochs = first.best_epoch or tc.epochs
    sequences, start_from = setup.sequences, setup.previous
    if tc.refit == "continue":
        if sequences is None:
            raise ConfigError("training.refit continue needs training.input sequences")
        # The first fit trains on, from its own weights, on the held-back positions only.
        held_back = split_positions(sequences.sequences, ("validation", "test"))
        sequences = dataclasses.replace(sequences, trainable=held_back)
        epochs, start_from = tc.refit_continue_epochs, first.model
        # A fresh optimizer on trained weights: a tenth of the rate, held constant.
        config = set_values(
            config,
            {
                "training.learning_rate_schedule": "constant",
                "training.learning_rate": tc.learning_rate / 10,
            },
        )
        log.info(
            "refit: the first fit continues %d epoch(s) on the validation + test positions", epochs
        )
    else:
        log.info("refit: %d epoch(s) on the %s splits together", epochs, " + ".join(splits))
    tf.keras.utils.set_random_seed(tc.seed)
    plan = plan_fit(config, data_dir, setup.stats, strategy, splits, sequences, False)
    with strategy.scope():
        trained, model = build_model(
            config, data_dir, first.precision, first.jit_compile, _schedule_steps(plan)
        )
        if start_from is not None:
            warm_start(trained, start_from)
    train_ds, _ = plan.datasets(trained, strategy)
    timer = EpochTimer()
    own: list[tf.keras.callbacks.Callback] = [timer]
    if backup_dir is not None:
        save_freq = tc.checkpoint_every_steps or "epoch"
        own.append(BackupEveryStepsAndEpoch(str(backup_dir), save_freq=save_freq))
    announce_fit(callbacks, "refit")
    start = time.perf_counter()
    with _fit_errors(tc, first.replicas, backup_dir):
        model.fit(
            train_ds,
            epochs=epochs,
            steps_per_epoch=_fit_steps(plan, strategy, train_ds),
            callbacks=[*own, EpochLogger(epochs), *callbacks],
            verbose=0,
        )
    return dataclasses.replace(
        first,
        model=trained,
        refit_epochs=epochs,
        refit_examples=sum(timer.examples) if timer.examples else plan.budget_examples * epochs,
        refit_seconds=time.perf_counter() - start,
        refit_splits=splits,
        evaluation_model=first.model if "test" in splits else None,
    )


def _strategy_name(strategy: tf.distribute.Strategy) -> str:
    if is_parameter_server(strategy):
        return "parameter_server"
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "multi_worker"
    return "mirrored" if isinstance(strategy, tf.distribute.MirroredStrategy) else "one_device"
