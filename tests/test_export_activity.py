"""serving_export.activity reads the sequence records as integers and gives the string-based
answer of the per-row splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from recsys.core import schema
from recsys.core.layout import SEQUENCES
from recsys.data_io import decoded, latest_items, load_split
from serving_export import activity
from serving_export.activity import TIMESTAMP_TYPE, read_activity

# (user, item, timestamp) per split. Ties in time are broken by the item id *string*
# ("i10" < "i9"), not by vocabulary position; "new" and "z0" are not in the vocabulary (they
# stay in histories), "ghost" is in no vocabulary at all, "u4" has no rows.
SPLIT_ROWS = {
    "train": [
        ("u1", "i9", 100),
        ("u1", "i10", 100),
        ("u1", "i2", 50),
        ("u2", "i2", 70),
        ("u2", "i9", 70),
        ("u3", "i10", 10),
        ("ghost", "i2", 500),
        ("u1", "i1", 100),
        ("u2", "i1", 71),
        ("u3", "i2", 10),
    ],
    "validation": [("u1", "z0", 100), ("u2", "i1", 80), ("u3", "new", 11)],
    "test": [("u1", "i2", 200), ("u2", "new", 90), ("u3", "i9", 12), ("ghost", "i9", 900)],
}
USERS = ["u3", "u1", "u4", "u2"]
ITEMS = ["i9", "i1", "i10", "i2", "i7"]


def write_split(path: Path, rows: list[tuple[str, str, int]]) -> None:
    """One gzip TFRecord shard of schema examples, as the Beam job writes them."""
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(path), options="GZIP") as writer:
        for user, item, stamp in rows:
            writer.write(
                schema.encode_example(
                    {"user_id": user, "item_id": item, "timestamp": stamp, "weight": 1.0}
                )
            )


def write_sequences(path: Path, split_rows: dict[str, list[tuple[str, str, int]]]) -> None:
    """The same rows as per-user sequence records, in protocol order (time, then item id)."""
    import tensorflow as tf

    by_user: dict[str, list[tuple[int, str, int]]] = {}
    for code, split in enumerate(schema.SPLITS):
        for user, item, stamp in split_rows[split]:
            by_user.setdefault(user, []).append((stamp, item, code))
    with tf.io.TFRecordWriter(str(path), options="GZIP") as writer:
        for user, events in sorted(by_user.items()):
            events.sort()
            record = {
                schema.USER_ID: user,
                schema.ITEM_IDS: [e[1] for e in events],
                schema.TIMESTAMPS: [e[0] for e in events],
                schema.SPLIT_CODES: [e[2] for e in events],
            }
            writer.write(schema.encode_example(record, schema.SEQUENCE_FEATURES))


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    for split, rows in SPLIT_ROWS.items():
        write_split(tmp_path / f"{split}-00000-of-00001.tfrecord.gz", rows)
    write_sequences(tmp_path / f"{SEQUENCES}-00000-of-00001.tfrecord.gz", SPLIT_ROWS)
    return tmp_path


def string_based(data_dir: Path, users: list[str], items: list[str], length: int) -> dict:
    """The former implementation: every row as numpy str arrays, grouped by string keys."""
    columns = (schema.USER_ID, schema.ITEM_ID, schema.TIMESTAMP)
    parts = [load_split(data_dir, split, columns=columns) for split in schema.SPLITS]
    user = decoded([u for p in parts for u in p[schema.USER_ID]])
    item = decoded([i for p in parts for i in p[schema.ITEM_ID]])
    stamp = np.array([t for p in parts for t in p[schema.TIMESTAMP]], dtype=np.int64)
    train_items = decoded(list(parts[0][schema.ITEM_ID])).tolist()

    def last(values: np.ndarray, ids: list[str]) -> pa.Array:
        latest: dict[str, int] = {}
        for v, t in zip(values.tolist(), stamp.tolist(), strict=True):
            latest[v] = max(latest.get(v, t), t)
        return pa.array([latest[i] * 1000 if i in latest else None for i in ids], TIMESTAMP_TYPE)

    return {
        "histories": latest_items(user, item, stamp, users, length),
        "interactions": pa.array([user.tolist().count(u) for u in users], pa.int64()),
        "user_last_seen": last(user, users),
        "popularity": pa.array([train_items.count(i) for i in items], pa.int64()),
        "item_last_seen": last(item, items),
    }


@pytest.mark.parametrize("batch", [2, 1 << 18])
def test_streamed_activity_equals_the_string_based_one(
    data_dir: Path, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(activity, "_READ_BATCH", batch)  # several batches of users, or one
    expected = string_based(data_dir, USERS, ITEMS, 4)
    got = read_activity(data_dir, USERS, ITEMS, 4)
    assert got.histories == expected["histories"]
    assert got.histories[USERS.index("u1")] == [
        "i10",
        "i9",
        "z0",
        "i2",
    ]  # i1 < i10 < i9 < z0 at t=100
    assert got.histories[USERS.index("u2")] == ["i9", "i1", "i1", "new"]
    assert got.histories[USERS.index("u4")] == []
    assert got.user_columns["interactions"].equals(expected["interactions"])
    assert got.user_columns["last_seen"].equals(expected["user_last_seen"])
    assert got.item_columns["popularity"].equals(expected["popularity"])
    assert got.item_columns["last_seen"].equals(expected["item_last_seen"])
    assert got.item_columns["last_seen"].null_count == 1  # "i7" never occurs


def test_no_history_length_gives_no_histories(data_dir: Path) -> None:
    got = read_activity(data_dir, USERS, ITEMS, 0)
    assert got.histories is None
    assert got.user_columns["interactions"].to_pylist() == [4, 6, 0, 5]
