"""Fit a two-tower model on the Beam job's TFRecords."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import tensorflow as tf

import recsys  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from recsys.config import RecsysConfig, TrainingConfig
from recsys.model import TrainedModel, TwoTowerModel, read_vocab
from recsys.training.dataset import training_dataset

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a training run produced."""

    model: TrainedModel
    history: dict[str, list[float]]
    examples: int
    seconds: float

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0


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


def make_optimizer(config: TrainingConfig) -> tf.keras.optimizers.Optimizer:
    """The configured optimizer."""
    if config.optimizer == "adagrad":
        return tf.keras.optimizers.Adagrad(config.learning_rate)
    return tf.keras.optimizers.Adam(config.learning_rate)


def train(config: RecsysConfig, data_dir: Path) -> TrainResult:
    """Train towers on data_dir's train split, tracking loss on its validation split."""
    tf.keras.utils.set_random_seed(config.training.seed)
    users = read_vocab(data_dir / "vocab" / "users.txt")
    items = read_vocab(data_dir / "vocab" / "items.txt")
    trained = TrainedModel.build(users, items, config.model)
    model = TwoTowerModel(trained.query_tower, trained.candidate_tower, config.model)
    model.compile(optimizer=make_optimizer(config.training))
    tc = config.training
    train_ds = training_dataset(
        data_dir, "train", trained, tc.batch_size, tc.shuffle_buffer, tc.seed
    )
    val_ds = training_dataset(data_dir, "validation", trained, tc.batch_size)
    stats = json.loads((data_dir / "stats.json").read_text())
    start = time.perf_counter()
    history = model.fit(
        train_ds,
        epochs=tc.epochs,
        validation_data=val_ds if stats["splits"]["validation"] else None,
        callbacks=[EpochLogger(tc.epochs)],
        verbose=0,
    )
    seconds = time.perf_counter() - start
    return TrainResult(
        model=trained,
        history={k: [float(v) for v in vs] for k, vs in history.history.items()},
        examples=int(stats["splits"]["train"]) * tc.epochs,
        seconds=seconds,
    )
