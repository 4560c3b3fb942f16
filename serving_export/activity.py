"""What the data says about each user and item, for the embeddings files' extra columns.

One pass over a data folder's splits gives each user's latest history (the query a request
would carry tonight, so users.parquet holds the vector serving would compute), interaction
counts and last-seen times, and each item's popularity and last-seen time.
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
from recsys.data_io import decoded, latest_items, load_split

# Parquet has no seconds unit (pyarrow would coerce to ms on write): ms from the start.
TIMESTAMP_TYPE = pa.timestamp("ms", tz="UTC")


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
    parts = [load_split(data_dir, split) for split in schema.SPLITS]
    user = decoded([u for p in parts for u in p[schema.USER_ID]])
    item = decoded([i for p in parts for i in p[schema.ITEM_ID]])
    stamp = np.array([t for p in parts for t in p[schema.TIMESTAMP]], dtype=np.int64)
    train_items = decoded(list(parts[0][schema.ITEM_ID]))
    histories = None
    if history_length:
        histories = latest_items(user, item, stamp, users, history_length)
    return Activity(
        histories,
        {
            "interactions": pa.array(_counts(user, users), pa.int64()),
            "last_seen": _last_seen(user, stamp, users),
        },
        {
            "popularity": pa.array(_popularity(data_dir, train_items, items), pa.int64()),
            "last_seen": _last_seen(item, stamp, items),
        },
    )


def _counts(values: np.ndarray, ids: Sequence[str]) -> np.ndarray:
    keys, counts = np.unique(values, return_counts=True) if len(values) else ([], [])
    table = dict(zip(np.asarray(keys).tolist(), np.asarray(counts).tolist(), strict=True))
    return np.array([table.get(i, 0) for i in ids], dtype=np.int64)


def _last_seen(values: np.ndarray, stamp: np.ndarray, ids: Sequence[str]) -> pa.Array:
    latest: dict[str, int] = {}
    if len(values):
        keys, inverse = np.unique(values, return_inverse=True)
        best = np.full(len(keys), np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(best, inverse, stamp)
        latest = dict(zip(keys.tolist(), best.tolist(), strict=True))
    millis = [latest[i] * 1000 if i in latest else None for i in ids]
    return pa.array(millis, TIMESTAMP_TYPE)


def _popularity(data_dir: Path, train_items: np.ndarray, items: Sequence[str]) -> np.ndarray:
    path = data_dir / DataFile.ITEM_FEATURES
    if path.is_file() and "train_count" in pq.read_schema(path).names:
        table = pq.read_table(path, columns=["item_id", "train_count"])
        counts = dict(
            zip(table["item_id"].to_pylist(), table["train_count"].to_pylist(), strict=True)
        )
        return np.array([counts.get(i, 0) for i in items], dtype=np.int64)
    return _counts(train_items, items)
