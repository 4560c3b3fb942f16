"""Fit a two-tower model on the Beam job's TFRecords (docs/TRAINING.md).

Device layout, precision, checkpoints and early stopping are chosen here from
`TrainingConfig`; the model math lives in `recsys.model`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tensorflow as tf

import recsys  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from recsys import evaluation as ev
from recsys import schema
from recsys.config import EvaluationConfig, RecsysConfig, TrainingConfig
from recsys.errors import ConfigError, OutOfMemoryError
from recsys.model import ItemFeatures, TrainedModel, TwoTowerModel, read_vocab, warm_start
from recsys.training.dataset import load_split, training_dataset

log = logging.getLogger(__name__)


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


class EpochTimer(tf.keras.callbacks.Callback):
    """Seconds spent in training steps per epoch (validation and other callbacks excluded)."""

    def __init__(self) -> None:
        super().__init__()
        # Keep Keras from converting the logs to numpy after every batch (a device sync).
        self._supports_tf_logs = True
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._start = self._last = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self._last = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self.seconds.append(self._last - self._start)


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


class ValidationRecall(tf.keras.callbacks.Callback):
    """Exact validation metrics each epoch (`val_<metric>` in the logs), with early stopping.

    Ranks the whole catalog for every validation user (recsys.evaluation, training items
    removed). With `patience` > 0, stops after that many epochs without improving `metric`
    and at the end puts back the best epoch's tower weights (0: metrics only, last weights).
    """

    def __init__(
        self,
        trained: TrainedModel,
        eval_set: ev.EvalSet,
        histories: list[list[bytes]] | None,
        metric: str,
        patience: int,
    ) -> None:
        super().__init__()
        self.trained = trained
        self.eval_set = eval_set
        self.histories = histories
        self.metric = metric
        self.patience = patience
        k = int(metric.rsplit("_", 1)[1])
        self.eval_config = EvaluationConfig(ks=[k], ndcg_k=k, mrr_k=k, coverage_k=0)
        self.best = -np.inf
        self.best_epoch: int | None = None
        self.best_weights: list[list[np.ndarray]] | None = None
        self.wait = 0

    def score(self) -> float:
        """The metric of the current weights on the validation users."""
        users = self.trained.user_embeddings(self.eval_set.users, self.histories)
        scores = ev.dot_product_scores(users, self.trained.item_embeddings())
        return ev.evaluate(scores, self.eval_set, self.eval_config).metrics[self.metric]

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        value = self.score()
        if logs is not None:
            logs[f"val_{self.metric}"] = value
        if value > self.best:
            self.best, self.best_epoch, self.wait = value, epoch, 0
            self.best_weights = [
                tower.get_weights()
                for tower in (self.trained.query_tower, self.trained.candidate_tower)
            ]
            return
        self.wait += 1
        if self.patience and self.wait >= self.patience:
            log.info("early stopping: no %s gain for %d epochs", self.metric, self.wait)
            self.model.stop_training = True

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        if self.best_weights is None or not self.patience:
            return
        log.info("keeping epoch %d (val %s=%.4f)", self.best_epoch + 1, self.metric, self.best)
        for tower, weights in zip(
            (self.trained.query_tower, self.trained.candidate_tower), self.best_weights, strict=True
        ):
            tower.set_weights(weights)


class BackupEveryStepsAndEpoch(tf.keras.callbacks.BackupAndRestore):
    """BackupAndRestore that, given a step frequency, also backs up at every epoch end.

    Keras saves either every N steps or at epoch ends; a run killed between an epoch's end and
    the next N-step mark would otherwise redo up to N steps of the finished epoch.
    """

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if self.save_freq != "epoch":
            # The saved batch counter is the epoch's last batch: resume starts the next epoch.
            self._batches_count = 0
            self._backup(epoch=epoch)


def make_optimizer(config: TrainingConfig, precision: str) -> tf.keras.optimizers.Optimizer:
    """The configured optimizer; wrapped in dynamic loss scaling for float16."""
    if config.optimizer == "adagrad":
        optimizer = tf.keras.optimizers.Adagrad(config.learning_rate)
    else:
        optimizer = tf.keras.optimizers.Adam(config.learning_rate)
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


def resolve_precision(precision: str, gpus: list[tf.config.PhysicalDevice]) -> str:
    """`auto`: mixed_float16 when every GPU has compute capability >= 7.0, else float32."""
    if precision != "auto":
        return precision
    if not gpus:
        return "float32"  # bf16 brought no speed on CPU, fp16 is emulated there (GOTCHAS).
    capabilities = [
        tf.config.experimental.get_device_details(gpu).get("compute_capability", (0, 0))
        for gpu in gpus
    ]
    return "mixed_float16" if all(c >= (7, 0) for c in capabilities) else "float32"


def tf_config_workers() -> int:
    """How many workers TF_CONFIG names (0 when unset)."""
    raw = os.environ.get("TF_CONFIG", "")
    if not raw:
        return 0
    try:
        return len(json.loads(raw).get("cluster", {}).get("worker", []))
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON with a cluster spec: {exc}") from None


def make_strategy(name: str, gpus: list[tf.config.PhysicalDevice]) -> tf.distribute.Strategy:
    """The device layout: auto picks multi_worker / mirrored / one_device (docs/TRAINING.md)."""
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
    config: RecsysConfig, data_dir: Path, precision: str
) -> tuple[TrainedModel, TwoTowerModel]:
    """Towers under the precision policy; task, metrics and model in float32 (GOTCHAS)."""
    users = read_vocab(data_dir / "vocab" / "users.txt")
    items = read_vocab(data_dir / "vocab" / "items.txt")
    features = ItemFeatures()
    if config.model.item_features:
        features = ItemFeatures.from_parquet(
            data_dir / "item_features.parquet", items, config.model.max_title_tokens
        )
    tf.keras.mixed_precision.set_global_policy(precision)
    try:
        trained = TrainedModel.build(users, items, config.model, features)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    model = TwoTowerModel(trained.query_tower, trained.candidate_tower, config.model)
    model.compile(optimizer=make_optimizer(config.training, precision))
    # Every variable exists once the towers are built; BackupAndRestore needs a built model
    # to restore the optimizer's slots along with the weights.
    model.built = True
    return trained, model


def validation_callback(
    config: RecsysConfig, data_dir: Path, trained: TrainedModel
) -> ValidationRecall | None:
    """Exact validation metrics (and early stopping), or None without a validation split."""
    validation = load_split(data_dir, "validation")
    if not len(validation[schema.USER_ID]):
        return None
    eval_set = ev.build_eval_set(trained.items, validation, [load_split(data_dir, "train")])
    histories = list(validation[schema.HISTORY]) if schema.HISTORY in validation else None
    tc = config.training
    return ValidationRecall(
        trained, eval_set, histories, tc.early_stopping_metric, tc.early_stopping_patience
    )


def train(config: RecsysConfig, data_dir: Path, backup_dir: Path | None = None) -> TrainResult:
    """Train towers on data_dir's train split, validating on its validation split.

    `backup_dir` holds resumable checkpoints (tf.keras.callbacks.BackupAndRestore): a run
    killed mid-training and started again with the same folder continues where it stopped.
    """
    tc = config.training
    gpus = configure_gpus(tc.gpu_memory_growth)
    # MultiWorkerMirroredStrategy must exist before other TF ops run in the process.
    strategy = make_strategy(tc.strategy, gpus)
    precision = resolve_precision(tc.precision, gpus)
    tf.keras.utils.set_random_seed(tc.seed)
    if tc.deterministic:
        tf.config.experimental.enable_op_determinism()
    previous = None
    if tc.warm_start_from:
        previous = TrainedModel.load(Path(tc.warm_start_from))
    with strategy.scope():
        trained, model = build_model(config, data_dir, precision)
        if previous is not None:
            copied = warm_start(trained, previous)
            log.info("warm start from %s: rows taken over %s", tc.warm_start_from, copied)
    replicas = strategy.num_replicas_in_sync
    stats = json.loads((data_dir / "stats.json").read_text())
    train_ds, val_ds = _datasets(config, data_dir, trained, strategy, stats["splits"])
    timer = EpochTimer()
    callbacks: list[tf.keras.callbacks.Callback] = [timer]
    if backup_dir is not None:
        callbacks.append(
            BackupEveryStepsAndEpoch(
                str(backup_dir), save_freq=tc.checkpoint_every_steps or "epoch"
            )
        )
    validator = (
        validation_callback(config, data_dir, trained) if stats["splits"]["validation"] else None
    )
    if validator is not None:
        callbacks.append(validator)
    callbacks.append(EpochLogger(tc.epochs))  # last: it logs what the others added
    start = time.perf_counter()
    try:
        history = model.fit(
            train_ds, epochs=tc.epochs, validation_data=val_ds, callbacks=callbacks, verbose=0
        )
    except tf.errors.ResourceExhaustedError as exc:
        raise OutOfMemoryError(
            f"out of memory training with training.batch_size={tc.batch_size} on "
            f"{replicas} replica(s): lower training.batch_size (e.g. {max(tc.batch_size // 2, 1)})"
            f" or model.embedding_dim; {str(exc).splitlines()[0][:200]}"
        ) from None
    seconds = time.perf_counter() - start
    epochs_run = len(history.history.get("loss", [])) or tc.epochs
    return TrainResult(
        model=trained,
        history={k: [float(v) for v in vs] for k, vs in history.history.items()},
        examples=int(stats["splits"]["train"]) * epochs_run,
        seconds=seconds,
        strategy=_strategy_name(strategy),
        replicas=replicas,
        precision=precision,
        # Only when early stopping kept that epoch's weights (otherwise the last epoch's are).
        best_epoch=None
        if validator is None or validator.best_epoch is None or not validator.patience
        else validator.best_epoch + 1,
        epoch_seconds=timer.seconds,
    )


def _datasets(
    config: RecsysConfig,
    data_dir: Path,
    trained: TrainedModel,
    strategy: tf.distribute.Strategy,
    counts: dict[str, int],
) -> tuple[tf.data.Dataset, tf.data.Dataset | None]:
    """Train and validation (None when empty) batches with a known number of steps."""
    tc = config.training
    # Several replicas: equal per-replica batches, so every all_gather has the same shape.
    drop = strategy.num_replicas_in_sync > 1
    if drop and counts["train"] < tc.batch_size:
        raise ConfigError(
            f"training.batch_size {tc.batch_size} exceeds the {counts['train']} training "
            f"examples; with {strategy.num_replicas_in_sync} replicas no full batch is left"
        )
    train = training_dataset(
        data_dir,
        "train",
        trained,
        tc.batch_size,
        tc.shuffle_buffer,
        tc.seed,
        deterministic=tc.deterministic,
        drop_remainder=drop,
    )
    # A known number of steps: BackupAndRestore needs it to resume mid-epoch.
    train = train.apply(
        tf.data.experimental.assert_cardinality(_steps(counts["train"], tc.batch_size, drop))
    )
    val = None
    if _steps(counts["validation"], tc.batch_size, drop):
        val = training_dataset(data_dir, "validation", trained, tc.batch_size, drop_remainder=drop)
        val = val.apply(
            tf.data.experimental.assert_cardinality(
                _steps(counts["validation"], tc.batch_size, drop)
            )
        )
    if drop and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return _shard_by_data(train), None if val is None else _shard_by_data(val)
    return train, val


def _shard_by_data(ds: tf.data.Dataset) -> tf.data.Dataset:
    """Shard batches across workers (file-based sharding needs >= one file per worker)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def _strategy_name(strategy: tf.distribute.Strategy) -> str:
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "multi_worker"
    return "mirrored" if isinstance(strategy, tf.distribute.MirroredStrategy) else "one_device"


def _steps(examples: int, batch_size: int, drop_remainder: bool) -> int:
    return examples // batch_size if drop_remainder else -(-examples // batch_size)
