"""Reading the preprocess stage's splits (gzip TFRecords of the schema's examples) as
tf.data batches or numpy arrays, shared by training, evaluation, tracking and serving export.

The one model-input transform both the training input and the serving signatures apply
(`history_indices`) lives here too, so serving_export needs nothing of recsys.training.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tensorflow as tf
from scipy import sparse

from recsys.core import schema
from recsys.core.errors import DataError, StageNotReadyError
from recsys.core.layout import SEQUENCES, DataFile, shard_pattern
from recsys.model import PAD


def split_files(data_dir: Path, split: str) -> list[str]:
    """The sorted shard files of one split (or of the sequence records, `SEQUENCES`); an error
    naming the folder if there are none."""
    paths = sorted(data_dir.glob(shard_pattern(split)))
    if not paths:
        hint = (
            "this data folder predates the per-user sequence records: redo it with "
            "`recsys nightly --rerun-from preprocess` (or `recsys preprocess`)"
            if split == SEQUENCES and any(data_dir.glob(str(DataFile.TRAIN_SHARDS)))
            else "run `recsys preprocess`"
        )
        raise StageNotReadyError(f"no {split}-*.tfrecord.gz in {data_dir}: {hint}")
    # The writer's gzip files are never empty (a header even without records): 0 bytes is a
    # truncated or lost file, bad input rather than a stage not yet run.
    empty = next((p for p in paths if p.stat().st_size == 0), None)
    if empty is not None:
        raise DataError(
            f"shard {empty} is empty (0 bytes): the data folder is damaged; redo it with "
            "`recsys nightly --rerun-from preprocess` (or `recsys preprocess`)"
        )
    return [str(p) for p in paths]


def read_examples(
    files: list[str],
    batch_size: int,
    shuffle_buffer: int | None = None,
    seed: int | None = None,
    deterministic: bool = True,
    drop_remainder: bool = False,
    columns: Sequence[str] | None = None,
) -> tf.data.Dataset:
    """Batches of parsed examples (dict of name -> [batch] tensor, lists ragged [batch, None]);
    `columns`: only these features (None: all).

    Batching before `parse_example` parses a whole batch in one op, several times faster than
    parsing example by example. With `deterministic` and a seed the order is reproducible;
    without, tf.data may reorder parallel work for speed.
    """
    ds = tf.data.TFRecordDataset(files, compression_type="GZIP", num_parallel_reads=len(files))
    if shuffle_buffer:
        ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    spec = schema.feature_spec()
    if columns is not None:
        spec = {name: spec[name] for name in columns}
    ds = ds.map(lambda b: tf.io.parse_example(b, spec), num_parallel_calls=tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.deterministic = deterministic
    return ds.with_options(options)


def history_indices(
    history: tf.RaggedTensor, lookup: tf.keras.layers.StringLookup, length: int
) -> tf.Tensor:
    """Ragged [batch, None] id strings -> [batch, length] int64: the last `length`, PAD-filled.

    Empty strings (the serving signature's padding) are dropped first.
    """
    history = tf.ragged.boolean_mask(history, tf.not_equal(history, ""))[:, -length:]
    indices = tf.ragged.map_flat_values(lookup, history)
    return indices.to_tensor(default_value=tf.constant(PAD, tf.int64), shape=[None, length])


def load_split(
    data_dir: Path,
    split: str,
    batch_size: int = 65536,
    columns: Sequence[str] = schema.FEATURE_NAMES,
) -> dict[str, np.ndarray]:
    """A whole split as numpy arrays (evaluation reads targets and exclusions this way).

    `columns`: the features to parse and keep; at millions of rows the ragged history
    column (one Python list per example) dominates memory, and most readers need only ids.
    """
    return concat_batches(iter_split(data_dir, split, columns, batch_size), columns)


def concat_batches(
    batches: Iterable[dict[str, np.ndarray]], columns: Sequence[str]
) -> dict[str, np.ndarray]:
    """Batches of `iter_split` (or a selection of their rows) as one array per column."""
    parts: dict[str, list[np.ndarray]] = {name: [] for name in columns}
    for batch in batches:
        for name in parts:
            parts[name].append(batch[name])
    return {
        name: np.concatenate(chunks) if chunks else np.array([]) for name, chunks in parts.items()
    }


def count_rows(data_dir: Path, split: str) -> int:
    """Examples in a split, read in one pass that parses only the user ids."""
    return sum(len(b[schema.USER_ID]) for b in iter_split(data_dir, split, (schema.USER_ID,)))


def iter_split(
    data_dir: Path,
    split: str,
    columns: Sequence[str] = schema.FEATURE_NAMES,
    batch_size: int = 65536,
) -> Iterator[dict[str, np.ndarray]]:
    """A split batch by batch as numpy arrays: memory of one batch, whatever the split's size."""
    for batch in read_examples(split_files(data_dir, split), batch_size, columns=columns):
        yield {name: _to_numpy(batch[name]) for name in columns}


def _to_numpy(value: tf.Tensor | tf.RaggedTensor) -> np.ndarray:
    """A dense batch as is; a ragged one as a 1-D object array of per-example lists."""
    if not isinstance(value, tf.RaggedTensor):
        return value.numpy()
    rows = value.to_list()
    out = np.empty(len(rows), dtype=object)
    out[:] = rows
    return out


def latest_histories(data_dir: Path, users: list[str], length: int) -> list[list[str]]:
    """Per user (in `users` order): their last `length` items over every split, oldest first.

    From the sequence records, in the protocol's order (timestamp, then item id): the history
    a query made tonight would carry.
    """
    sequences = load_sequences(data_dir)
    row = {user: r for r, user in enumerate(sequences.users)}
    ends = sequences.offsets
    return [
        sequences.items[max(ends[r], ends[r + 1] - length) : ends[r + 1]].tolist()
        if (r := row.get(user)) is not None and length
        else []
        for user in users
    ]


def latest_items(
    user: np.ndarray, item: np.ndarray, stamp: np.ndarray, users: Sequence[str], length: int
) -> list[list[str]]:
    """Per user in `users`: their last `length` items by (timestamp, item id), oldest first."""
    if not len(user):
        return [[] for _ in users]
    order = np.lexsort((item, stamp, user))
    user, item = user[order], item[order]
    starts = np.flatnonzero(np.r_[True, user[1:] != user[:-1]])
    ends = np.r_[starts[1:], len(user)]
    by_user = {
        user[s]: item[max(s, e - length) : e].tolist() for s, e in zip(starts, ends, strict=True)
    }
    return [by_user.get(u, []) for u in users]


def decoded(values: list[bytes | str]) -> np.ndarray:
    """Id strings (bytes as TFRecords hold them, or str) as a numpy str array."""
    return np.array([v.decode("utf-8") if isinstance(v, bytes) else v for v in values], dtype=str)


ItemLookup = Callable[[tf.Tensor], tf.Tensor]
"""String ids -> int64 indices, applied inside tf.data (e.g. a model's `item_lookup()`)."""


@dataclass
class Sequences:
    """Every user's ordered interactions, as flat arrays with per-user offsets (CSR).

    User r's positions are `offsets[r]:offsets[r + 1]`, in protocol order (timestamp, then
    item id); `splits` holds each position's index into `schema.SPLITS`.
    """

    users: list[str]
    offsets: np.ndarray  # [users + 1] int64
    items: np.ndarray  # [positions]: int64 indices of the lookup, or id strings (object)
    splits: np.ndarray  # [positions] int8
    timestamps: np.ndarray | None = None  # [positions] int64 seconds, when asked for
    # With `keep_unknown`: the id strings of the positions the lookup mapped below 0, in
    # position order (ids missing from a `vocabulary_lookup`).
    unknown: np.ndarray | None = None

    @property
    def lengths(self) -> np.ndarray:
        """Positions per user."""
        return np.diff(self.offsets)

    def user_of_position(self) -> np.ndarray:
        """[positions] int64: the row (in `users`) of each position."""
        return np.repeat(np.arange(len(self.users), dtype=np.int64), self.lengths)


def load_sequences(
    data_dir: Path,
    lookup: ItemLookup | None = None,
    timestamps: bool = False,
    batch_size: int = 4096,
    keep_unknown: bool = False,
) -> Sequences:
    """The per-user sequence records of a data folder, read once into flat arrays.

    With `lookup`, item ids become its int64 indices inside tf.data (no Python per item);
    without, they stay strings (a 1-D object array). Memory: about 9 bytes per position
    (17 with timestamps), plus one Python string per user. `keep_unknown` (with a lookup
    that maps ids it lacks below 0, `vocabulary_lookup`) also keeps those ids' strings.
    """
    names = [schema.USER_ID, schema.ITEM_IDS, schema.SPLIT_CODES]
    if timestamps:
        names.append(schema.TIMESTAMPS)
    spec = schema.feature_spec(schema.SEQUENCE_FEATURES)
    spec = {name: spec[name] for name in names}

    def parse(records: tf.Tensor) -> dict[str, tf.Tensor]:
        parsed = tf.io.parse_example(records, spec)
        if lookup is not None:
            ids = parsed[schema.ITEM_IDS]
            parsed[schema.ITEM_IDS] = tf.ragged.map_flat_values(lookup, ids)
            if keep_unknown:
                found = parsed[schema.ITEM_IDS].flat_values
                parsed[UNKNOWN] = tf.boolean_mask(ids.flat_values, found < 0)
        return parsed

    files = split_files(data_dir, SEQUENCES)
    ds = tf.data.TFRecordDataset(files, compression_type="GZIP", num_parallel_reads=len(files))
    ds = ds.batch(batch_size).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    users: list[str] = []
    lengths: list[np.ndarray] = []
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names[1:]}
    unknown: list[np.ndarray] = []
    for batch in ds.prefetch(2):
        users.extend(u.decode("utf-8") for u in batch[schema.USER_ID].numpy().tolist())
        lengths.append(batch[schema.ITEM_IDS].row_lengths().numpy())
        for name in parts:
            parts[name].append(batch[name].flat_values.numpy())
        if UNKNOWN in batch:
            unknown.append(batch[UNKNOWN].numpy())
    offsets = np.zeros(len(users) + 1, np.int64)
    if lengths:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    flat: dict[str, np.ndarray] = {
        name: np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        for name, chunks in parts.items()
    }
    items = flat[schema.ITEM_IDS]
    if lookup is None:
        items = decoded(items.tolist()).astype(object)
    return Sequences(
        users,
        offsets,
        items,
        flat[schema.SPLIT_CODES].astype(np.int8),
        flat.get(schema.TIMESTAMPS),
        _decoded_flat(unknown) if keep_unknown and lookup is not None else None,
    )


def _decoded_flat(chunks: list[np.ndarray]) -> np.ndarray:
    """Chunks of id bytes as one object array of str."""
    return decoded(np.concatenate(chunks).tolist() if chunks else []).astype(object)


UNKNOWN = "unknown_item_ids"
"""`load_sequences`' batch key of the ids its lookup lacks."""


def vocabulary_lookup(vocabulary: Sequence[str]) -> ItemLookup:
    """Id strings -> their index in `vocabulary` (the first copy's), -1 for ids it lacks."""
    ids = pa.array(list(vocabulary), pa.string())
    position = pc.index_in(ids, value_set=ids).to_numpy(zero_copy_only=False)
    first = np.flatnonzero(position == np.arange(len(ids)))  # a repeated id: its first copy
    keys = tf.constant(ids.take(pa.array(first)).to_numpy(zero_copy_only=False), tf.string)
    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(keys, tf.constant(first, tf.int64)), default_value=-1
    )
    return table.lookup


def sparse_interactions(
    rows: np.ndarray, cols: np.ndarray, num_rows: int, num_cols: int
) -> sparse.csr_matrix:
    """A binary float32 CSR matrix with ones at (rows, cols); duplicates collapse to one."""
    x = sparse.csr_matrix(
        (np.ones(len(rows), np.float32), (rows, cols)), shape=(num_rows, num_cols)
    )
    x.data[:] = 1.0  # summed duplicates: a repeated (user, item) is one interaction
    return x
