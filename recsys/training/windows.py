"""One-pass training input: user sequences cut into fixed-length windows of positions.

A fit trains on the positions of some splits (the first fit: train; a refit: train +
validation (+ test)). For a user whose kept positions are t_0 .. t_{m-1} (protocol order),
position i is one example: the query is the encoder's output after t_0 .. t_{i-1} (nothing
for i = 0), the target is t_i. The encoder sees `length` (N) positions at a time, so the
sequence is cut into windows ending at m, m - S, m - 2S, ... (S = `stride` <= N), each
covering the targets [max(0, e - N), e):

    inputs  (slot j)  t_{b+j-1}   (PAD for t_{-1}: the first target has no history)
    targets (slot j)  t_{b+j}     (PAD where the window only gives context)

right-aligned in N slots (PAD first), as serving aligns a history. Each target is trained in
exactly one window: the newest S targets of each window, all targets of the oldest one, so
every trained target sees at least N - S + 1 items of history where the user has them
(S = N: non-overlapping windows, every position seen once, the cheapest; S < N: more
history per target for N / S times the encoder work). `last_only` keeps the newest window of
each user (the SASRec recipe: older positions are never trained).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf

from recsys.core.layout import DataFile
from recsys.core.schema import SPLITS
from recsys.data_io import Sequences, load_sequences
from recsys.model import HISTORY_INDEX, PAD, TARGET_INDEX, USER_INDEX, read_vocab, string_lookup
from recsys.training.dataset import permuted_batches


@dataclass
class TrainingSequences:
    """A data folder's sequence records in model indices, read once per training run."""

    sequences: Sequences  # items: model item indices (OOV ids in the first buckets)
    user_index: np.ndarray  # [users] int64 model user index of each sequence
    # Positions a fit may train (None: all of its splits'); the rest are history only.
    trainable: np.ndarray | None = None

    def incremental(self, since: int, replay_fraction: float, seed: int) -> int:
        """Train only positions after `since` (seconds) and a uniform replay sample of the
        older ones; returns how many positions are new."""
        stamps = self.sequences.timestamps
        if stamps is None:
            raise ValueError("incremental training needs the sequences' timestamps")
        new = stamps > since
        replay = np.random.default_rng(seed).random(len(stamps)) < replay_fraction
        self.trainable = new | replay
        return int(new.sum())

    @classmethod
    def load(cls, data_dir: Path, oov_buckets: int, timestamps: bool = False) -> TrainingSequences:
        """Read the records, looking ids up in the data folder's vocabularies."""
        users = read_vocab(data_dir / DataFile.USER_VOCAB)
        items = read_vocab(data_dir / DataFile.ITEM_VOCAB)
        sequences = load_sequences(data_dir, string_lookup(items, oov_buckets), timestamps)
        lookup = string_lookup(users, oov_buckets)
        ids = np.asarray(sequences.users, dtype=object)
        user_index = lookup(tf.constant(ids, tf.string)).numpy() if len(ids) else ids
        return cls(sequences, np.asarray(user_index, dtype=np.int64))


def split_positions(sequences: Sequences, splits: Sequence[str]) -> np.ndarray:
    """A bool per position: whether it belongs to one of `splits`."""
    codes = np.array([SPLITS.index(name) for name in splits], dtype=np.int8)
    return np.isin(sequences.splits, codes)


@dataclass
class Windows:
    """Fixed-length training windows: [W] users, [W, N] inputs and targets (PAD = -1)."""

    users: np.ndarray  # int64 model user index per window
    inputs: np.ndarray  # int32 item index per slot, right-aligned
    targets: np.ndarray  # int32 item to predict per slot; PAD where nothing is trained

    @property
    def count(self) -> int:
        """Number of windows."""
        return len(self.users)

    @property
    def positions(self) -> int:
        """Trained positions (examples) over all windows."""
        return int(np.count_nonzero(self.targets >= 0))

    def shard(self, index: int, count: int) -> Windows:
        """Every `count`-th window from `index`: one worker's share."""
        pick = slice(index, None, count)
        return Windows(self.users[pick], self.inputs[pick], self.targets[pick])


def make_windows(
    sequences: Sequences,
    user_index: np.ndarray,
    splits: Sequence[str],
    length: int,
    stride: int,
    last_only: bool = False,
    targets: np.ndarray | None = None,
) -> Windows:
    """The windows of every user's positions in `splits` (see the module docstring).

    `sequences.items` hold model item indices; `user_index` is the model index of each of
    `sequences.users`. With `targets` (a bool per position of `sequences`), only those
    positions are trained; the others are history only (e.g. the validation loss: every split
    up to validation as history, its positions as targets; an incremental night: the new
    days' positions and a replay sample). Vectorised over users and windows: no Python loop
    per user.
    """
    if not 1 <= stride <= length:
        raise ValueError(f"window stride {stride} must be between 1 and the length {length}")
    keep = split_positions(sequences, splits)
    items = sequences.items[keep].astype(np.int32)
    trainable = None if targets is None else np.asarray(targets, bool)[keep]
    counts = np.bincount(sequences.user_of_position()[keep], minlength=len(sequences.users))
    offsets = np.concatenate([[0], np.cumsum(counts)])[:-1]
    users = np.flatnonzero(counts)
    m = counts[users]
    per_user = 1 if last_only else 1 + -(-np.maximum(m - length, 0) // stride)
    per_user = np.broadcast_to(per_user, m.shape)
    user = np.repeat(users, per_user)
    # Window k of a user (0 = newest) ends at e = m - kS.
    k = np.arange(per_user.sum()) - np.repeat(np.cumsum(per_user) - per_user, per_user)
    end = counts[user] - k * stride
    begin = np.maximum(end - length, 0)
    if last_only:
        trained_from = begin
    else:  # the newest `stride` targets of each window; all of the oldest window's
        trained_from = np.where(k == np.repeat(per_user, per_user) - 1, begin, end - stride)
    slot = np.arange(length)[None, :]
    local = begin[:, None] + slot - (length - (end - begin))[:, None]
    base = offsets[user][:, None]
    has_target = local >= begin[:, None]
    where = np.clip(base + local, 0, max(len(items) - 1, 0))
    is_target = has_target & (local >= trained_from[:, None])
    if trainable is not None and len(items):
        is_target &= trainable[where]
    targets = np.where(is_target, items[where] if len(items) else PAD, PAD)
    has_input = has_target & (local >= 1)
    inputs = np.where(
        has_input,
        items[np.clip(base + local - 1, 0, max(len(items) - 1, 0))] if len(items) else PAD,
        PAD,
    )
    useful = (targets >= 0).any(axis=1)  # windows that are all history train nothing
    return Windows(
        np.asarray(user_index, dtype=np.int64)[user[useful]],
        inputs[useful].astype(np.int32),
        targets[useful].astype(np.int32),
    )


def windows_per_batch(windows: Windows, examples_per_batch: int, replicas: int = 1) -> int:
    """Windows per step so that a step trains about `examples_per_batch` positions on
    average (`training.batch_size` keeps its meaning of examples per step); a multiple of
    the replica count."""
    per_window = windows.positions / max(windows.count, 1)
    count = max(1, round(examples_per_batch / max(per_window, 1e-9)))
    return max(replicas, count // replicas * replicas)


def window_dataset(
    windows: Windows,
    batch_windows: int,
    shuffle: bool = True,
    seed: int | None = None,
    drop_remainder: bool = False,
) -> tf.data.Dataset:
    """Batches {user_index, history_index, target_index} of whole windows held in memory,
    in a new random order every epoch (or in order without `shuffle`)."""
    # int32 constants (half the memory); batches are cast to the towers' int64 indices.
    tensors = {
        USER_INDEX: tf.constant(windows.users),
        HISTORY_INDEX: tf.constant(windows.inputs),
        TARGET_INDEX: tf.constant(windows.targets),
    }
    n = windows.count
    if shuffle:
        ds = permuted_batches(n, batch_windows, seed, drop_remainder)
    else:
        ds = tf.data.Dataset.range(n).batch(batch_windows, drop_remainder=drop_remainder)
    ds = ds.map(
        lambda rows: {name: tf.cast(tf.gather(t, rows), tf.int64) for name, t in tensors.items()},
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    return ds.prefetch(tf.data.AUTOTUNE)


def window_steps(count: int, batch_windows: int, drop_remainder: bool) -> int:
    """Steps of one pass over `count` windows."""
    return count // batch_windows if drop_remainder else -(-count // batch_windows)
