"""What one fit reads: its training and validation batches, and the size of an epoch.

Two inputs (`training.input`):

- `sequences` (default): windows of each user's sequence record, every position trained in
  one causal pass (recsys/training/windows.py); the windows are built once in memory.
- `rows`: one example per interaction row with its stored history (the per-prefix path),
  streamed from the TFRecords or held in memory (`training.cache`).

A plan is made before the model is built (the learning-rate schedule needs the epoch's
steps) and gives its datasets once the towers exist (the rows path looks ids up with them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tensorflow as tf

from recsys.core.auto import AUTO_CACHE_BYTES
from recsys.core.config import RecsysConfig, TrainingConfig
from recsys.core.errors import ConfigError
from recsys.model import TrainedModel
from recsys.training.dataset import in_memory_bytes, in_memory_dataset, training_dataset
from recsys.training.parameter_servers import is_parameter_server, per_worker_dataset
from recsys.training.windows import (
    TrainingSequences,
    Windows,
    make_windows,
    split_positions,
    window_dataset,
    window_steps,
    windows_per_batch,
)

log = logging.getLogger(__name__)

Datasets = tuple[
    tf.data.Dataset | tf.keras.utils.experimental.DatasetCreator, tf.data.Dataset | None
]


@dataclass
class FitPlan:
    """One fit's input: `steps` batches and `examples` examples per pass over its data."""

    config: RecsysConfig
    splits: tuple[str, ...]
    steps: int
    examples: int
    drop_remainder: bool
    data_dir: Path
    windows: Windows | None = None  # sequences: the training windows
    validation_windows: Windows | None = None
    batch_windows: int = 0
    validation_batch_windows: int = 0
    counts: dict[str, int] | None = None  # rows: examples per split read ("train": total)
    cached: bool = False

    @property
    def budget_examples(self) -> int:
        """Examples one epoch trains under `training.max_steps_per_epoch`."""
        cap = self.config.training.max_steps_per_epoch
        if cap and cap < self.steps:
            return round(self.examples * cap / self.steps)
        return self.examples

    def datasets(self, trained: TrainedModel, strategy: tf.distribute.Strategy) -> Datasets:
        """Train and validation (None: none) batches with a known number of steps."""
        if self.windows is not None:
            return self._window_datasets(strategy)
        return self._row_datasets(trained, strategy)

    def _window_datasets(self, strategy: tf.distribute.Strategy) -> Datasets:
        tc, windows = self.config.training, self.windows
        assert windows is not None
        if is_parameter_server(strategy):
            return per_worker_dataset(
                lambda: window_dataset(windows, self.batch_windows, True, None)
            ), None
        drop = self.drop_remainder
        train = window_dataset(windows, self.batch_windows, True, tc.seed, drop)
        train = train.apply(tf.data.experimental.assert_cardinality(self.steps))
        val = None
        held, per_batch = self.validation_windows, self.validation_batch_windows
        if held is not None and window_steps(held.count, per_batch, drop):
            val = window_dataset(held, per_batch, False, drop_remainder=drop)
            steps = window_steps(held.count, per_batch, drop)
            val = val.apply(tf.data.experimental.assert_cardinality(steps))
        return _sharded(train, val, strategy, drop)

    def _row_datasets(self, trained: TrainedModel, strategy: tf.distribute.Strategy) -> Datasets:
        tc, counts, splits = self.config.training, self.counts or {}, self.splits
        self.cached = use_cache(tc.cache, counts, trained, strategy)
        if is_parameter_server(strategy):
            # Each worker streams its own shuffled copy; validation runs on the coordinator
            # (exact recall, ValidationRecall), not as a Keras validation pass.
            return per_worker_dataset(
                lambda: training_dataset(
                    self.data_dir,
                    splits,
                    trained,
                    tc.batch_size,
                    tc.shuffle_buffer,
                    deterministic=False,
                )
            ), None
        drop = self.drop_remainder
        if self.cached:
            train = in_memory_dataset(
                self.data_dir, splits, trained, tc.batch_size, True, tc.seed, drop_remainder=drop
            )
        else:
            train = training_dataset(
                self.data_dir,
                splits,
                trained,
                tc.batch_size,
                tc.shuffle_buffer,
                tc.seed,
                deterministic=tc.deterministic,
                drop_remainder=drop,
            )
        # A known number of steps: BackupAndRestore needs it to resume mid-epoch.
        train = train.apply(tf.data.experimental.assert_cardinality(self.steps))
        val = None
        held = counts.get("validation", 0)
        if held and steps_of(held, tc.batch_size, drop):
            read = in_memory_dataset if self.cached else training_dataset
            val = read(self.data_dir, "validation", trained, tc.batch_size, drop_remainder=drop)
            steps = steps_of(held, tc.batch_size, drop)
            val = val.apply(tf.data.experimental.assert_cardinality(steps))
        return _sharded(train, val, strategy, drop)


def plan_fit(
    config: RecsysConfig,
    data_dir: Path,
    stats: dict,
    strategy: tf.distribute.Strategy,
    splits: Sequence[str] = ("train",),
    sequences: TrainingSequences | None = None,
    validate: bool = True,
) -> FitPlan:
    """The plan of a fit on `splits` (validation batches only with `validate`)."""
    tc = config.training
    replicas = strategy.num_replicas_in_sync
    # Several replicas: equal per-replica batches, so every all_gather has the same shape.
    drop = replicas > 1 and not is_parameter_server(strategy)
    splits = tuple(splits)
    if sequences is not None:
        return _plan_sequences(config, data_dir, sequences, splits, replicas, drop, validate)
    counts = {"train": sum(int(stats["splits"][name]) for name in splits)}
    if validate:
        counts["validation"] = int(stats["splits"]["validation"])
    if drop and counts["train"] < tc.batch_size:
        raise ConfigError(
            f"training.batch_size {tc.batch_size} exceeds the {counts['train']} training "
            f"examples; with {replicas} replicas no full batch is left"
        )
    steps = steps_of(counts["train"], tc.batch_size, drop)
    return FitPlan(config, splits, steps, counts["train"], drop, data_dir, counts=counts)


def _plan_sequences(
    config: RecsysConfig,
    data_dir: Path,
    sequences: TrainingSequences,
    splits: tuple[str, ...],
    replicas: int,
    drop: bool,
    validate: bool,
) -> FitPlan:
    tc = config.training
    length = window_length(config)
    stride = tc.window_stride or length
    if stride > length:
        raise ConfigError(
            f"training.window_stride {stride} is longer than the window (model.history_length "
            f"{length}): positions between windows would never be trained"
        )
    windows = make_windows(
        sequences.sequences,
        sequences.user_index,
        splits,
        length,
        stride,
        tc.windows == "last",
        sequences.trainable,
    )
    if not windows.count:
        raise ConfigError(f"no training positions in the {' + '.join(splits)} splits of {data_dir}")
    batch_windows = windows_per_batch(windows, tc.batch_size, replicas)
    if drop and windows.count < batch_windows:
        raise ConfigError(
            f"training.batch_size {tc.batch_size} needs {batch_windows} windows per step but "
            f"the data has {windows.count}; with {replicas} replicas no full batch is left"
        )
    held = None
    if validate:
        # The validation loss: each validation position with its history, one window each.
        held = make_windows(
            sequences.sequences,
            sequences.user_index,
            ("train", "validation"),
            length,
            length,
            last_only=True,
            targets=split_positions(sequences.sequences, ("validation",)),
        )
    held = held if held is not None and held.count else None
    steps = window_steps(windows.count, batch_windows, drop)
    log.info(
        "training input: %d windows of %d positions (stride %d), %d positions; %d windows "
        "(~%d positions) per step",
        windows.count,
        length,
        stride,
        windows.positions,
        batch_windows,
        round(windows.positions * batch_windows / windows.count),
    )
    return FitPlan(
        config,
        splits,
        steps,
        windows.positions,
        drop,
        data_dir,
        windows=windows,
        validation_windows=held,
        batch_windows=batch_windows,
        # About batch_size validation positions per batch, as many as a training step's.
        validation_batch_windows=0
        if held is None
        else windows_per_batch(held, tc.batch_size, replicas),
        cached=True,
    )


def window_length(config: RecsysConfig) -> int:
    """Positions per training window: the query tower's history length (16 without one:
    the window then only groups a user's positions into one batch row)."""
    return config.model.history_length or 16


def use_cache(
    setting: str, counts: dict[str, int], trained: TrainedModel, strategy: tf.distribute.Strategy
) -> bool:
    """`training.cache`: auto keeps the splits in memory when they are small and one worker
    trains (several workers each read their shard of the files)."""
    if setting != "auto":
        return setting == "memory"
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or is_parameter_server(
        strategy
    ):
        return False
    size = in_memory_bytes(counts["train"] + counts.get("validation", 0), trained)
    return size <= AUTO_CACHE_BYTES


def capped_steps(tc: TrainingConfig, ds: tf.data.Dataset) -> int | None:
    """Steps per pass under the step budget (None: the whole dataset)."""
    cap = tc.max_steps_per_epoch or None
    steps = int(ds.cardinality())
    return cap if cap is not None and 0 < cap < steps else None


def steps_of(examples: int, batch_size: int, drop_remainder: bool) -> int:
    """Batches of `batch_size` in `examples`."""
    return examples // batch_size if drop_remainder else -(-examples // batch_size)


def _sharded(
    train: tf.data.Dataset,
    val: tf.data.Dataset | None,
    strategy: tf.distribute.Strategy,
    drop: bool,
) -> Datasets:
    """Under several workers, every worker takes every N-th batch (file-based sharding
    needs at least one file per worker)."""
    if not (drop and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)):
        return train, val
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return train.with_options(options), None if val is None else val.with_options(options)
