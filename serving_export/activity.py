"""What the data says about each user and item, for the embeddings files' extra columns.

One pass over a data folder's per-user sequence records gives each user's latest history (the
query a request would carry tonight, so users.parquet holds the vector serving would
compute), interaction count and last-seen time, and each item's popularity and last-seen time.

Item ids become vocabulary positions inside tf.data, so every position is held as integers
only (int64 item and time: 17 bytes a position), never as a Python string: at 30M rows the
string arrays were the export stage's memory wall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys.core.layout import DataFile
from recsys.data_io import Sequences, load_sequences, vocabulary_lookup
from recsys.evaluation import concat_ranges, id_positions

# Parquet has no seconds unit (pyarrow would coerce to ms on write): ms from the start.
TIMESTAMP_TYPE = pa.timestamp("ms", tz="UTC")

_READ_BATCH = 4096
"""Sequence records (users) per read batch."""


@dataclass
class Activity:
    """Per-id columns aligned with the users and items they were computed for."""

    histories: list[list[str]] | None
    user_columns: dict[str, pa.Array] = field(default_factory=dict)
    item_columns: dict[str, pa.Array] = field(default_factory=dict)


def read_activity(
    data_dir: Path, users: Sequence[str], items: Sequence[str], history_length: int
) -> Activity:
    """Histories (last `history_length` items by (timestamp, item id)), counts, last seen.

    Users: `interactions` (all splits) and `last_seen`. Items: `popularity` (training
    interactions, the count the model's logQ correction used) and `last_seen`. Ids absent
    from the data get 0 and a null time.
    """
    sequences = load_sequences(
        data_dir, vocabulary_lookup(items), True, _READ_BATCH, keep_unknown=True
    )
    user_set, item_set = pa.array(list(users), pa.string()), pa.array(list(items), pa.string())
    # A vocabulary listing an id twice gives every copy the first copy's values (as a dict did).
    item_first = id_positions(item_set, item_set)
    row = id_positions(user_set, pa.array(sequences.users, pa.string()))
    stamps = sequences.timestamps
    assert stamps is not None  # asked for above
    # Per user: the end of its positions (0 with none; a user's record is never empty).
    stop = np.append(sequences.offsets[1:], 0)[row]
    start = np.append(sequences.offsets[:-1], 0)[row]
    user_count = stop - start
    # Protocol order is time order: a user's last position is their latest.
    user_last = np.append(stamps, 0)[stop - 1]
    known = sequences.items >= 0
    item, train = sequences.items[known], sequences.splits[known] == 0
    item_count = np.bincount(item, minlength=len(items))
    item_last = _latest(item, stamps[known], len(items))
    histories = None
    if history_length:
        histories = _histories(sequences, items, np.maximum(start, stop - history_length), stop)
    return Activity(
        histories,
        {
            "interactions": pa.array(user_count, pa.int64()),
            "last_seen": _times(user_last, user_count > 0),
        },
        {
            "popularity": pa.array(
                _popularity(data_dir, np.bincount(item[train], minlength=len(items)), items)[
                    item_first
                ],
                pa.int64(),
            ),
            "last_seen": _times(item_last[item_first], item_count[item_first] > 0),
        },
    )


def _latest(ids: np.ndarray, stamp: np.ndarray, size: int) -> np.ndarray:
    """Per position 0..size-1: the largest timestamp of its rows (int64 min when none)."""
    best = np.full(size, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(best, ids, stamp)
    return best


def _histories(
    sequences: Sequences, items: Sequence[str], starts: np.ndarray, stops: np.ndarray
) -> list[list[str]]:
    """Item ids of the positions `starts[i]:stops[i]`, one list per user."""
    flat = concat_ranges(starts, stops)
    index = sequences.items[flat]
    names = np.asarray(list(items), dtype=object)[np.maximum(index, 0)] if len(items) else index
    # Ids missing from `items` (first seen after training's split) stay in histories:
    # `unknown` holds their strings in position order.
    missing = np.flatnonzero(index < 0)
    if len(missing) and sequences.unknown is not None:
        names = names.astype(object)
        every_missing = np.flatnonzero(sequences.items < 0)
        names[missing] = sequences.unknown[np.searchsorted(every_missing, flat[missing])]
    bounds = np.cumsum(stops - starts)[:-1]
    return [part.tolist() for part in np.split(names, bounds)] if len(starts) else []


def _times(seconds: np.ndarray, seen: np.ndarray) -> pa.Array:
    """Seconds as UTC millisecond timestamps, null where the id never occurs."""
    return pa.array(np.where(seen, seconds, 0) * 1000, TIMESTAMP_TYPE, mask=~seen)


def _popularity(data_dir: Path, train_counts: np.ndarray, items: Sequence[str]) -> np.ndarray:
    path = data_dir / DataFile.ITEM_FEATURES
    if path.is_file() and "train_count" in pq.read_schema(path).names:
        table = pq.read_table(path, columns=["item_id", "train_count"])
        counts = dict(
            zip(table["item_id"].to_pylist(), table["train_count"].to_pylist(), strict=True)
        )
        return np.array([counts.get(i, 0) for i in items], dtype=np.int64)
    return train_counts
