"""Validated interactions as Arrow record batches: what crosses the job's one shuffle.

A batch holds rows of one shard (not a Python object per row), as a zstd-compressed Arrow
IPC stream (~14 bytes a row). With preprocess.shuffle "beam" the stream bytes are the
shuffled elements; with "files" (the default) each reader appends them to one spill file per
shard and only (rows, path) is shuffled: the in-process runner holds its shuffle in memory
(several copies of it), so that keeps memory flat whatever the input size.
"""

import zlib
from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

USER, ITEM, TS, WEIGHT, FILE, ROW, RAW = "user", "item", "timestamp", "weight", "file", "row", "raw"
BUCKET = "bucket"
BUCKETS = 256
# What the readers produce. file: index into the job's sorted input files; row: 1-based row
# in it; raw: the row's text for text formats, null for columnar files (read back from the
# file only if the row is rejected after the shuffle).
ROW_SCHEMA = pa.schema(
    [
        (USER, pa.string()),
        (ITEM, pa.string()),
        (TS, pa.int64()),
        (WEIGHT, pa.float64()),
        (FILE, pa.int32()),
        (ROW, pa.int64()),
        (RAW, pa.string()),
    ]
)
# What crosses the shuffle: plus the user's bucket within its shard (another part of the same
# crc32), so that a big shard can be processed a range of buckets (whole users) at a time.
EVENT_SCHEMA = ROW_SCHEMA.append(pa.field(BUCKET, pa.uint8()))
# zstd shrinks a batch ~3.5x (~14 bytes a row) for ~0.2 us a row: less for the shuffle to hold.
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd" if pa.Codec.is_available("zstd") else None)
# Order of a shard's rows: the split protocol's (user, time, item), then (file, row) so that
# the first of exact duplicates comes first.
SORT_KEYS = [(USER, "ascending"), (TS, "ascending"), (ITEM, "ascending"),
             (FILE, "ascending"), (ROW, "ascending")]  # fmt: skip


def event_batch(
    users: list[str],
    items: list[str],
    stamps: list[int],
    weights: list[float],
    file: int,
    rows: list[int],
    raws: list[str | None],
) -> pa.RecordBatch:
    """A batch of validated rows of one file from Python lists (text readers)."""
    return pa.record_batch(
        [
            pa.array(users, pa.string()),
            pa.array(items, pa.string()),
            pa.array(stamps, pa.int64()),
            pa.array(weights, pa.float64()),
            pa.array(np.full(len(users), file, dtype=np.int32)),
            pa.array(rows, pa.int64()),
            pa.array(raws, pa.string()),
        ],
        schema=ROW_SCHEMA,
    )


def to_ipc(batch: pa.RecordBatch | pa.Table) -> bytes:
    """A batch (or table) as Arrow IPC stream bytes."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=_IPC_OPTIONS) as writer:
        writer.write(batch)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    """The table of an Arrow IPC stream."""
    return pa.ipc.open_stream(data).read_all()


def concat_ipc(parts: Iterable[bytes | None], schema: pa.Schema = EVENT_SCHEMA) -> pa.Table:
    """One table from IPC parts (None parts are shard markers and skipped)."""
    tables = [from_ipc(p) for p in parts if p is not None]
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables).combine_chunks()


def user_hashes(users: pa.Array) -> np.ndarray:
    """crc32 of each user id's UTF-8 bytes (as beam_jobs.sinks.shard_of), once per distinct id."""
    if len(users) == 0:
        return np.zeros(0, dtype=np.int64)
    encoded = pc.dictionary_encode(users)
    ids = encoded.dictionary.cast(pa.binary()).to_pylist()
    crcs = np.fromiter((zlib.crc32(i) for i in ids), np.int64, len(ids))
    return crcs[encoded.indices.to_numpy(zero_copy_only=False)]


def by_shard(batch: pa.RecordBatch, num_shards: int) -> Iterable[tuple[int, pa.RecordBatch]]:
    """(shard, the batch's rows of that shard, with their bucket) for each shard with rows."""
    if batch.num_rows == 0:
        return
    crcs = user_hashes(batch.column(USER))
    shards = crcs % num_shards
    buckets = (crcs // num_shards) % BUCKETS
    batch = batch.append_column(BUCKET, pa.array(buckets.astype(np.uint8)))
    order = np.argsort(shards, kind="stable")
    bounds = np.searchsorted(shards[order], np.arange(num_shards + 1))
    for shard in range(num_shards):
        lo, hi = int(bounds[shard]), int(bounds[shard + 1])
        if hi > lo:
            yield shard, batch.take(pa.array(order[lo:hi]))


# A shard's part: (rows, payload), the payload being IPC bytes or the path of a spill file.
Part = tuple[int, bytes | str]


class SpillFiles:
    """Per shard, one Arrow IPC stream file that batches are appended to (the files shuffle).

    Names are deterministic (`<prefix>-<shard>.arrow`): a retried bundle rewrites the same
    files with the same content.
    """

    def __init__(self, directory: str, prefix: str) -> None:
        self._dir = Path(directory)
        self._prefix = prefix
        self._open: dict[int, tuple[pa.ipc.RecordBatchStreamWriter, pa.NativeFile, int]] = {}

    def path(self, shard: int) -> str:
        """The spill file of a shard."""
        return str(self._dir / f"{self._prefix}-{shard:05d}.arrow")

    def write(self, shard: int, batch: pa.RecordBatch | pa.Table) -> None:
        """Append rows to the shard's file."""
        if shard not in self._open:
            self._dir.mkdir(parents=True, exist_ok=True)
            sink = pa.OSFile(self.path(shard), "wb")
            self._open[shard] = (pa.ipc.new_stream(sink, batch.schema, options=_IPC_OPTIONS),
                                 sink, 0)  # fmt: skip
        writer, sink, rows = self._open[shard]
        writer.write(batch)
        self._open[shard] = (writer, sink, rows + batch.num_rows)

    def close(self) -> list[tuple[int, Part]]:
        """Close every file; (shard, (rows, path)) for each."""
        done: list[tuple[int, Part]] = []
        for shard, (writer, sink, rows) in sorted(self._open.items()):
            writer.close()
            sink.close()
            done.append((shard, (rows, self.path(shard))))
        self._open.clear()
        return done


def part_batches(part: Part) -> Iterable[pa.RecordBatch]:
    """The record batches of a part (read from its file for spilled parts)."""
    _, payload = part
    if isinstance(payload, str):
        with pa.OSFile(payload, "rb") as source:
            yield from pa.ipc.open_stream(source)
    else:
        yield from pa.ipc.open_stream(payload)


def in_passes(parts: Iterable[Part | None], max_rows: int) -> Iterable[pa.Table]:
    """A shard's parts as tables of at most ~max_rows rows, each of whole users.

    A shard with more rows is read once per range of buckets (decompressing its parts each
    time, batch by batch), so what a worker holds unpacked stays bounded whatever the input.
    """
    present = [p for p in parts if p is not None]
    total = sum(rows for rows, _ in present)
    count = min(BUCKETS, max(1, -(-total // max_rows)))
    edges = [j * BUCKETS // count for j in range(count + 1)]
    for lo, hi in pairwise(edges):
        batches = []
        for part in present:
            for batch in part_batches(part):
                if count > 1:
                    bucket = batch.column(BUCKET)
                    batch = batch.filter(pc.and_(pc.greater_equal(bucket, lo), pc.less(bucket, hi)))
                batches.append(batch)
        if not batches:
            yield EVENT_SCHEMA.empty_table()
            continue
        yield pa.Table.from_batches(batches).combine_chunks()


def neighbours_equal(values: pa.Array) -> np.ndarray:
    """Per row: does it equal the row before it (False for the first row)."""
    n = len(values)
    out = np.zeros(n, dtype=bool)
    if n > 1:
        same = pc.equal(values.slice(1), values.slice(0, n - 1))
        out[1:] = same.to_numpy(zero_copy_only=False)
    return out
