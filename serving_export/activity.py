"""What the data says about each user and item, for the embeddings files' extra columns.

One pass over a data folder's splits gives each user's latest history (the query a request
would carry tonight, so users.parquet holds the vector serving would compute), interaction
counts and last-seen times, and each item's popularity and last-seen time.

The splits are read batch by batch and every row is kept as integers only (user and item
positions in the vocabularies the caller passes, int64 timestamps: 16 bytes a row), never as
Python strings: at 30M rows the string arrays were the export stage's memory wall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys.core import schema
from recsys.core.layout import DataFile
from recsys.data_io import iter_split
from recsys.evaluation import id_positions

# Parquet has no seconds unit (pyarrow would coerce to ms on write): ms from the start.
TIMESTAMP_TYPE = pa.timestamp("ms", tz="UTC")

_READ_BATCH = 1 << 18
"""Rows per read batch."""


class _Positions:
    """Id -> position in a vocabulary, hashed once (a per-batch `pc.index_in` rebuilt the
    whole vocabulary's hash table for every batch: rows x users work at 1M users)."""

    def __init__(self, ids: Sequence[str]) -> None:
        self._index: dict[bytes, int] = {}
        for position, value in enumerate(ids):
            self._index.setdefault(value.encode("utf-8"), position)  # first copy wins

    def __call__(self, values: np.ndarray) -> np.ndarray:
        """Each id's position (bytes as TFRecords hold them, or str); -1 when absent."""
        get = self._index.get
        found = (get(v if isinstance(v, bytes) else v.encode("utf-8"), -1) for v in values)
        return np.fromiter(found, np.int64, count=len(values))


@dataclass
class Activity:
    """Per-id columns aligned with the users and items they were computed for."""

    histories: list[list[str]] | None
    user_columns: dict[str, pa.Array] = field(default_factory=dict)
    item_columns: dict[str, pa.Array] = field(default_factory=dict)


@dataclass
class _Rows:
    """Every row of the splits as integer columns (user -1: not in `users`)."""

    user: np.ndarray  # int32 position in `users`
    item: np.ndarray  # int32 position in `vocab` (`items`, then ids only the data has)
    stamp: np.ndarray  # int64 seconds
    vocab: list[str]
    train_item_counts: np.ndarray  # per position in `items`: training interactions


def read_activity(
    data_dir: Path, users: Sequence[str], items: Sequence[str], history_length: int
) -> Activity:
    """Histories (last `history_length` items by (timestamp, item id)), counts, last seen.

    Users: `interactions` (all splits) and `last_seen`. Items: `popularity` (training
    interactions, the count the model's logQ correction used) and `last_seen`. Ids absent
    from the data get 0 and a null time.
    """
    user_set, item_set = pa.array(list(users), pa.string()), pa.array(list(items), pa.string())
    rows = _read_rows(data_dir, users, item_set)
    # A vocabulary listing an id twice gives every copy the first copy's values (as a dict did).
    user_first = id_positions(user_set, user_set)
    item_first = id_positions(item_set, item_set)
    known = rows.user >= 0
    user_count = np.bincount(rows.user[known], minlength=len(users))
    user_last = _latest(rows.user[known], rows.stamp[known], len(users))
    in_items = rows.item < len(items)
    item_count = np.bincount(rows.item[in_items], minlength=len(items))
    item_last = _latest(rows.item[in_items], rows.stamp[in_items], len(items))
    histories = None
    if history_length:
        by_user = _histories(rows, known, len(users), history_length)
        histories = [by_user[i] for i in user_first.tolist()]
    return Activity(
        histories,
        {
            "interactions": pa.array(user_count[user_first], pa.int64()),
            "last_seen": _times(user_last[user_first], user_count[user_first] > 0),
        },
        {
            "popularity": pa.array(
                _popularity(data_dir, rows.train_item_counts[item_first], items), pa.int64()
            ),
            "last_seen": _times(item_last[item_first], item_count[item_first] > 0),
        },
    )


def _read_rows(data_dir: Path, user_ids: Sequence[str], item_set: pa.Array) -> _Rows:
    """One streamed pass over the splits, ids mapped to positions batch by batch."""
    vocab: list[str] = item_set.to_pylist()
    user_position, item_position = _Positions(user_ids), _Positions(vocab)
    extra: dict[bytes, int] = {}  # item ids of the data missing from `items`, by first sight
    users, items, stamps = [], [], []
    train_counts = np.zeros(len(item_set), np.int64)
    columns = (schema.USER_ID, schema.ITEM_ID, schema.TIMESTAMP)
    for split in schema.SPLITS:
        for batch in iter_split(data_dir, split, columns, _READ_BATCH):
            user = user_position(batch[schema.USER_ID]).astype(np.int32)
            item = item_position(batch[schema.ITEM_ID])
            missing = np.flatnonzero(item < 0)
            if len(missing):
                # Histories keep every item id, in the vocabulary or not (rare: items first
                # seen after training's split), so those get positions past `items`.
                raw, inverse = np.unique(batch[schema.ITEM_ID][missing], return_inverse=True)
                for value in raw.tolist():
                    if value not in extra:
                        extra[value] = len(vocab)
                        vocab.append(value.decode("utf-8") if isinstance(value, bytes) else value)
                item[missing] = np.array([extra[v] for v in raw.tolist()])[inverse]
            if split == schema.SPLITS[0]:
                seen = item[item < len(item_set)]
                train_counts += np.bincount(seen, minlength=len(item_set))
            users.append(user)
            items.append(item.astype(np.int32))
            stamps.append(batch[schema.TIMESTAMP].astype(np.int64))
    return _Rows(
        np.concatenate(users) if users else np.zeros(0, np.int32),
        np.concatenate(items) if items else np.zeros(0, np.int32),
        np.concatenate(stamps) if stamps else np.zeros(0, np.int64),
        vocab,
        train_counts,
    )


def _latest(ids: np.ndarray, stamp: np.ndarray, size: int) -> np.ndarray:
    """Per position 0..size-1: the largest timestamp of its rows (int64 min when none)."""
    best = np.full(size, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(best, ids, stamp)
    return best


def _histories(rows: _Rows, known: np.ndarray, num_users: int, length: int) -> list[list[str]]:
    """Per user position: the last `length` item ids by (timestamp, item id), oldest first."""
    user, item, stamp = rows.user[known], rows.item[known], rows.stamp[known]
    # Ties in time are broken by the item id string (the protocol's order): the rank of each
    # vocabulary entry in string order stands in for the string.
    by_string = np.argsort(np.array(rows.vocab, dtype=object), kind="stable")
    string_rank = np.empty(len(rows.vocab), np.int32)
    string_rank[by_string] = np.arange(len(rows.vocab), dtype=np.int32)
    order = np.lexsort((string_rank[item], stamp, user))
    user, item = user[order], item[order]
    ends = np.searchsorted(user, np.arange(num_users), side="right")
    starts = np.r_[0, ends[:-1]] if num_users else ends
    starts = np.maximum(starts, ends - length)
    names = rows.vocab
    return [
        [names[i] for i in item[s:e].tolist()]
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
    ]


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
