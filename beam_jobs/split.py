"""Per-user split (leave-last-out or time window) with history features, after de-duplication,
written straight to the TFRecord shards.

Duplicates are found inside each shard: an exact duplicate has the same user, so the one
GroupByKey the split needs anyway also finds them, with no second shuffle. The shard arrives
as Arrow record batches; sorted by (user, time, item, file, row) it gives, with array
operations and no Python call per row, the duplicates (equal to the row before), each user's
rows in protocol order, their split and their history (a window of the rows before, within
the user). The split rows never travel through a second shuffle to the writer: they are
encoded and written here, in batches, and leave as per-shard counts.

`split_user` and the small functions before it are the per-user reference the columnar
`split_shard` is tested against (tests/test_beam_columnar.py).
"""

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from apache_beam.typehints import no_annotations

from beam_jobs import columnar as col
from beam_jobs.examples import (
    SEQUENCE_ORDERED,
    encode_batch,
    frame_records,
    gather_lists,
    history_pieces,
    varints,
)
from beam_jobs.records import (
    DUPLICATE,
    RARE_ITEM,
    RARE_USER,
    Interaction,
    Raw,
    Rejection,
    rejection,
)
from beam_jobs.sinks import TFRecordFile, shard_path
from recsys.core.layout import SEQUENCES
from recsys.core.schema import (
    HISTORY,
    ITEM_ID,
    ITEM_IDS,
    SPLIT_CODES,
    SPLITS,
    TIMESTAMP,
    TIMESTAMPS,
    USER_ID,
    WEIGHT,
)

REJECTED = "rejected"
COUNTS = "counts"
USERS = "users"
ITEMS = "items"
ITEM_COUNTS = "item_counts"
SPLIT_KEY = "split:"  # as in beam_jobs.stats
SEQUENCES_KEY = "sequences"  # users written to the sequence records (beam_jobs.stats)
SEQUENCE_POSITIONS_KEY = "sequence_positions"  # positions written (beam_jobs.stats)
SEQUENCE_LENGTH_KEY = "sequence_length:"  # users per log2 length bucket (beam_jobs.stats)
TRAIN, VALIDATION, TEST = SPLITS
SECONDS_PER_DAY = 86_400
LEAVE_LAST_OUT = "leave_last_out"
TIME_WINDOW = "time_window"
ENCODE_ROWS = 64 * 1024  # rows encoded and written at a time
# Rows of a shard processed at once (~150 bytes each while split and encoded): a bigger
# shard is processed in several passes over ranges of user buckets.
PASS_ROWS = 1 << 19
COUNT = "count"
ID = "id"
# Per-shard tallies (train rows per user, per item; distinct rows per item) as Arrow tables.
COUNTS_SCHEMA = pa.schema([(ID, pa.string()), (COUNT, pa.int64())])

# (timestamp, item, file, row, weight, raw): see records.Event.
EventValue = tuple[int, str, str, int, float, Raw]


def dedupe(ordered: list[EventValue]) -> tuple[list[EventValue], list[Rejection]]:
    """Keep the first of each (timestamp, item) by (file, row); reject the rest.

    `ordered` must be sorted: then the first of equal (timestamp, item) is the earliest row.
    """
    kept: list[EventValue] = []
    duplicates: list[Rejection] = []
    for event in ordered:
        if kept and kept[-1][:2] == event[:2]:
            duplicates.append(rejection(event[2], event[3], None, DUPLICATE, event[5]))
        else:
            kept.append(event)
    return kept, duplicates


def split_names(count: int, min_interactions: int) -> list[str]:
    """Split of each of a user's `count` time-ordered interactions: ..., validation, test."""
    if count < min_interactions:
        return [TRAIN] * count
    return [TRAIN] * (count - 2) + [VALIDATION, TEST]


def window_split_names(timestamps: list[int], cutoff: int, eval_days: int) -> list[str]:
    """Time-window split: the last `eval_days` days before `cutoff` are test, the ones before
    them validation, everything earlier train."""
    test_from = cutoff - eval_days * SECONDS_PER_DAY
    validation_from = test_from - eval_days * SECONDS_PER_DAY
    return [
        TEST if ts >= test_from else VALIDATION if ts >= validation_from else TRAIN
        for ts in timestamps
    ]


def histories(items: list[str], length: int) -> list[tuple[str, ...]]:
    """For each position, the up to `length` items strictly before it, oldest first."""
    if length == 0:
        return [()] * len(items)
    return [tuple(items[max(0, i - length) : i]) for i in range(len(items))]


@dataclass(frozen=True)
class SplitSettings:
    """What the split needs from the config: protocol, thresholds, history length, cutoff."""

    min_interactions: int = 5
    history_length: int = 0
    protocol: str = LEAVE_LAST_OUT
    cutoff: int = 0  # first second after the run date (time-window split)
    eval_days: int = 1
    min_user_count: int = 0
    min_item_count: int = 0


def split_user(
    user: str,
    events: list[EventValue],
    settings: SplitSettings,
    item_counts: Mapping[str, int] | None = None,
) -> tuple[dict[str, list[Interaction]], list[Rejection]]:
    """One user's events -> rows per split (time order, with history) and rejections.

    Order of the checks: exact duplicates, then rare items, then rare users.
    """
    s = settings
    # Tuple order sorts by (timestamp, item id) as the protocol says, then by (file, row).
    kept, rejected = dedupe(sorted(events))
    if s.min_item_count and item_counts is not None:
        rare = [e for e in kept if item_counts.get(e[1], 0) < s.min_item_count]
        rejected += [rejection(e[2], e[3], ITEM_ID, RARE_ITEM, e[5]) for e in rare]
        kept = [e for e in kept if item_counts.get(e[1], 0) >= s.min_item_count]
    rows: dict[str, list[Interaction]] = {name: [] for name in SPLITS}
    if len(kept) < s.min_user_count:
        rejected += [rejection(e[2], e[3], USER_ID, RARE_USER, e[5]) for e in kept]
        return rows, rejected
    if s.protocol == TIME_WINDOW:
        names = window_split_names([e[0] for e in kept], s.cutoff, s.eval_days)
    else:
        names = split_names(len(kept), s.min_interactions)
    history = histories([e[1] for e in kept], s.history_length)
    for split, (ts, item, _, _, weight, _), past in zip(names, kept, history, strict=True):
        rows[split].append((user, item, ts, weight, past))
    return rows, rejected


# --- the columnar shard split ----------------------------------------------------------------


@dataclass
class ShardSplit:
    """A shard's kept rows in protocol order, their split and history, and the rejections."""

    rows: pa.Table  # user, item, timestamp, weight, ... sorted by (user, time, item)
    split: np.ndarray  # index into SPLITS per row
    history_start: np.ndarray  # per row: its history is rows[history_start:row] (same user)
    rejected: list[Rejection]


def sort_shard(table: pa.Table) -> pa.Table:
    """A shard's rows by (user, timestamp, item, file, row): the protocol's order."""
    if table.num_rows == 0:
        return table
    return table.take(pc.sort_indices(table, sort_keys=col.SORT_KEYS))


def duplicate_rows(table: pa.Table) -> np.ndarray:
    """Rows of a sorted shard equal in (user, timestamp, item) to the row before (not kept)."""
    stamps = table.column(col.TS).to_numpy()
    same = col.neighbours_equal(table.column(col.USER).combine_chunks())
    same &= col.neighbours_equal(table.column(col.ITEM).combine_chunks())
    same[1:] &= stamps[1:] == stamps[:-1]
    return same


def _group_starts(users: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(index of each user's first row, per row the number of its user) for sorted rows."""
    first = ~col.neighbours_equal(users)
    if len(first):
        first[0] = True
    return np.flatnonzero(first), np.cumsum(first) - 1


def count_lookup(ids: pa.Array, counts: pa.Table | None) -> np.ndarray:
    """Per id its count in a (id, count) table, 0 when absent."""
    if counts is None or counts.num_rows == 0:
        return np.zeros(len(ids), dtype=np.int64)
    where = pc.index_in(ids, value_set=counts.column(ID).combine_chunks())
    found = pc.take(counts.column(COUNT).combine_chunks(), where)
    return pc.fill_null(found, 0).to_numpy(zero_copy_only=False)


def _rejections(
    table: pa.Table, mask: np.ndarray, field: str | None, reason: str, files: Sequence[str]
) -> list[Rejection]:
    """One rejection per masked row (raw None for columnar files: read back later)."""
    if not mask.any():
        return []
    picked = table.filter(pa.array(mask))
    return [
        rejection(files[f], r, field, reason, raw)
        for f, r, raw in zip(
            picked.column(col.FILE).to_pylist(),
            picked.column(col.ROW).to_pylist(),
            picked.column(col.RAW).to_pylist(),
            strict=True,
        )
    ]


def split_shard(
    table: pa.Table,
    settings: SplitSettings,
    files: Sequence[str],
    item_counts: pa.Table | None = None,
) -> ShardSplit:
    """A shard's validated rows -> kept rows with split and history, and the rejections.

    Same checks in the same order as `split_user`: exact duplicates, rare items, rare users.
    """
    s = settings
    table = sort_shard(table)
    dup = duplicate_rows(table)
    rejected = _rejections(table, dup, None, DUPLICATE, files)
    table = table.filter(pa.array(~dup))
    if s.min_item_count and item_counts is not None:
        rare = count_lookup(table.column(col.ITEM).combine_chunks(), item_counts) < s.min_item_count
        rejected += _rejections(table, rare, ITEM_ID, RARE_ITEM, files)
        table = table.filter(pa.array(~rare))
    users = table.column(col.USER).combine_chunks()
    starts, group = _group_starts(users)
    sizes = np.diff(np.append(starts, table.num_rows))
    if s.min_user_count:
        rare = sizes[group] < s.min_user_count
        rejected += _rejections(table, rare, USER_ID, RARE_USER, files)
        table = table.filter(pa.array(~rare))
        users = table.column(col.USER).combine_chunks()
        starts, group = _group_starts(users)
        sizes = np.diff(np.append(starts, table.num_rows))
    n = table.num_rows
    position = np.arange(n) - starts[group] if n else np.zeros(0, dtype=np.int64)
    # Split codes index SPLITS: 0 train, 1 validation, 2 test.
    if s.protocol == TIME_WINDOW:
        test_from = s.cutoff - s.eval_days * SECONDS_PER_DAY
        validation_from = test_from - s.eval_days * SECONDS_PER_DAY
        stamps = table.column(col.TS).to_numpy()
        split = np.where(stamps >= test_from, 2, np.where(stamps >= validation_from, 1, 0))
    else:
        size = sizes[group] if n else np.zeros(0, dtype=np.int64)
        eligible = size >= s.min_interactions
        split = np.where(eligible & (position == size - 1), 2, 0)
        split = np.where(eligible & (position == size - 2), 1, split)
    history_start = np.arange(n) - np.minimum(position, s.history_length)
    return ShardSplit(table, split.astype(np.int64), history_start, rejected)


def write_split(result: ShardSplit, code: int, out: TFRecordFile) -> int:
    """Encode one split's rows of a shard into its TFRecord file; returns the number of rows."""
    chosen = np.flatnonzero(result.split == code)
    rows = result.rows
    users, items = rows.column(col.USER), rows.column(col.ITEM)
    stamps, weights = rows.column(col.TS).to_numpy(), rows.column(col.WEIGHT).to_numpy()
    for start in range(0, len(chosen), ENCODE_ROWS):
        index = chosen[start : start + ENCODE_ROWS]
        # The chunk's histories lie in rows[lo:hi]: frame those items once.
        lo, hi = int(result.history_start[index].min()), int(index.max())
        pieces = history_pieces(items.slice(lo, hi - lo).combine_chunks())
        take = pa.array(index)
        columns = {
            USER_ID: users.take(take).combine_chunks(),
            ITEM_ID: items.take(take).combine_chunks(),
            TIMESTAMP: stamps[index],
            WEIGHT: weights[index],
            HISTORY: gather_lists(pieces, result.history_start[index] - lo, index - lo),
        }
        out.write(frame_records(encode_batch(columns)))
    return len(chosen)


def write_sequences(result: ShardSplit, out: TFRecordFile) -> np.ndarray:
    """Encode one record per user of a shard's split (its ordered items, times and split codes)
    into the sequences file; returns each written user's sequence length."""
    rows = result.rows
    users, items = rows.column(col.USER).combine_chunks(), rows.column(col.ITEM)
    stamps = rows.column(col.TS).to_numpy()
    starts, _ = _group_starts(users)
    stops = np.append(starts[1:], rows.num_rows).astype(np.int64)
    first = 0
    while first < len(starts):
        # Users in chunks of about ENCODE_ROWS positions (at least one user per chunk).
        last = max(first + 1, int(np.searchsorted(stops, starts[first] + ENCODE_ROWS, "right")))
        lo, hi = int(starts[first]), int(stops[last - 1])
        begin, end = starts[first:last] - lo, stops[first:last] - lo
        columns = {
            USER_ID: users.take(pa.array(starts[first:last])),
            ITEM_IDS: gather_lists(
                history_pieces(items.slice(lo, hi - lo).combine_chunks()), begin, end
            ),
            TIMESTAMPS: gather_lists(varints(stamps[lo:hi]), begin, end),
            SPLIT_CODES: gather_lists(varints(result.split[lo:hi]), begin, end),
        }
        out.write(frame_records(encode_batch(columns, SEQUENCE_ORDERED)))
        first = last
    return stops - starts


def length_buckets(lengths: np.ndarray) -> dict[str, int]:
    """Users per sequence-length bucket: "1", "2-3", "4-7", ... (powers of two)."""
    if not len(lengths):
        return {}
    exponents = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(exponents)
    return {
        (f"{1 << e}" if e == 0 else f"{1 << e}-{(2 << e) - 1}"): int(n)
        for e, n in enumerate(counts)
        if n
    }


def train_counts(result: ShardSplit) -> tuple[pa.Table, pa.Table]:
    """(user, train rows) and (item, train rows) tables of a shard's split."""
    train = result.split == 0
    users = result.rows.column(col.USER).combine_chunks()
    starts, group = _group_starts(users)
    per_user = np.bincount(group[train], minlength=len(starts))
    has_train = np.flatnonzero(per_user)
    user_table = pa.table(
        [users.take(pa.array(starts[has_train])), pa.array(per_user[has_train])],
        schema=COUNTS_SCHEMA,
    )
    return user_table, value_counts(result.rows.column(col.ITEM).filter(pa.array(train)))


def value_counts(values: pa.Array | pa.ChunkedArray) -> pa.Table:
    """(id, count) of each distinct value."""
    counted = pc.value_counts(values)
    return pa.table(
        [counted.field("values").cast(pa.string()), counted.field("counts").cast(pa.int64())],
        schema=COUNTS_SCHEMA,
    )


def sum_counts(parts: Iterable[bytes]) -> bytes:
    """Per-shard (id, count) tables -> one table of the summed counts, as IPC bytes."""
    table = col.concat_ipc(parts, COUNTS_SCHEMA)
    summed = table.group_by(ID).aggregate([(COUNT, "sum")])
    summed = summed.rename_columns([ID, COUNT] if summed.column_names[0] == ID else [COUNT, ID])
    return col.to_ipc(summed.select([ID, COUNT]))


class _DedupeShard(beam.DoFn):
    """A shard's batches -> its de-duplicated rows (one element), distinct rows per item and
    the duplicates' rejections: the first pass when rare items need global counts."""

    def __init__(self, files: Sequence[str], spill_dir: str | None = None) -> None:
        self._files = list(files)
        self._spill = spill_dir

    def process(self, element: tuple[int, Iterable[col.Part | None]]) -> Iterator[Any]:
        shard, parts = element
        kept_parts: list[col.Part] = []
        spill = col.SpillFiles(self._spill, f"kept-{shard:05d}") if self._spill else None
        for table in col.in_passes(parts, PASS_ROWS):
            table = sort_shard(table)
            dup = duplicate_rows(table)
            for rej in _rejections(table, dup, None, DUPLICATE, self._files):
                yield beam.pvalue.TaggedOutput(REJECTED, rej)
            kept = table.filter(pa.array(~dup))
            counts = value_counts(kept.column(col.ITEM))
            yield beam.pvalue.TaggedOutput(ITEM_COUNTS, col.to_ipc(counts))
            if spill is not None:
                spill.write(0, kept)
            else:
                kept_parts.append((kept.num_rows, col.to_ipc(kept)))
        if spill is not None:
            kept_parts = [part for _, part in spill.close()]
        yield shard, kept_parts


class _SplitAndWriteShard(beam.DoFn):
    """One shard's batches -> its three TFRecord files; outputs counts, not rows."""

    def __init__(
        self, settings: SplitSettings, out_dir: str, num_shards: int, files: Sequence[str]
    ) -> None:
        self._s = settings
        self._out = out_dir
        self._shards = num_shards
        self._files = list(files)

    def process(
        self,
        element: tuple[int, Iterable[col.Part | None]],
        item_counts: bytes | None = None,
    ) -> Iterator[Any]:
        shard, parts = element
        counts = col.from_ipc(item_counts) if item_counts is not None else None
        paths = [
            shard_path(f"{self._out}/{name}", shard, self._shards) for name in (*SPLITS, SEQUENCES)
        ]
        outs = [TFRecordFile(path) for path in paths]
        written = [0] * len(SPLITS)
        lengths: list[np.ndarray] = []
        try:
            # Users never straddle passes: each pass is a range of user buckets.
            for table in col.in_passes(parts, PASS_ROWS):
                result = split_shard(table, self._s, self._files, counts)
                for rej in result.rejected:
                    yield beam.pvalue.TaggedOutput(REJECTED, rej)
                for code, out in enumerate(outs[: len(SPLITS)]):
                    written[code] += write_split(result, code, out)
                lengths.append(write_sequences(result, outs[-1]))
                users, items = train_counts(result)
                yield beam.pvalue.TaggedOutput(USERS, col.to_ipc(users))
                yield beam.pvalue.TaggedOutput(ITEMS, col.to_ipc(items))
        finally:
            for out in outs:
                out.close()
        for name, rows in zip(SPLITS, written, strict=True):
            yield beam.pvalue.TaggedOutput(COUNTS, (SPLIT_KEY + name, rows))
        every = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        yield beam.pvalue.TaggedOutput(COUNTS, (SEQUENCES_KEY, len(every)))
        yield beam.pvalue.TaggedOutput(COUNTS, (SEQUENCE_POSITIONS_KEY, int(every.sum())))
        for bucket, users in length_buckets(every).items():
            yield beam.pvalue.TaggedOutput(COUNTS, (SEQUENCE_LENGTH_KEY + bucket, users))


@dataclass(frozen=True)
class _Outputs:
    """The same attributes as the DoOutputsTuple of the one-pass case."""

    rejected: beam.PCollection
    counts: beam.PCollection
    users: beam.PCollection
    items: beam.PCollection


class SplitAndWrite(beam.PTransform):
    """(shard, (rows, IPC bytes or spill file)) -> `<split>-SSSSS-of-NNNNN.tfrecord.gz` files
    and `sequences-SSSSS-of-NNNNN.tfrecord.gz` (one record per user, recsys.core.schema).

    One shuffle, keyed by shard (crc32 of the user id): each shard's users are split, get
    their history and are written by one worker, in sorted order, so the files are
    byte-identical whatever the runner. Outputs: `rejected` (duplicates, rare users/items),
    `counts` (("split:<name>", rows) per shard), `users` and `items` (IPC tables of (id, train
    rows); items are summed over shards). A worker unpacks at most PASS_ROWS rows of a shard
    at a time (a range of user buckets); with `spill_dir` the shard's batches stay on disk.
    With min_item_count, a first pass per shard drops duplicates and counts distinct rows
    per item, and the split runs on its output with the summed counts as a side input.
    """

    def __init__(
        self,
        settings: SplitSettings,
        out_dir: str,
        num_shards: int,
        files: Sequence[str],
        spill_dir: str | None = None,
    ) -> None:
        super().__init__()
        self._s = settings
        self._out = out_dir
        self._shards = num_shards
        self._files = list(files)
        self._spill = spill_dir

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, batches: beam.PCollection) -> beam.pvalue.DoOutputsTuple | _Outputs:
        n = self._shards
        markers = batches.pipeline | "ShardMarkers" >> beam.Create([(i, None) for i in range(n)])
        grouped = (
            (batches, markers)
            | "WithMarkers" >> beam.Flatten()
            | "GroupByShard" >> (beam.GroupByKey())
        )
        split_fn = _SplitAndWriteShard(self._s, self._out, n, self._files)
        if not self._s.min_item_count:
            return grouped | "SplitAndWrite" >> beam.ParDo(split_fn).with_outputs(
                REJECTED, COUNTS, USERS, ITEMS
            )
        dedupe = _DedupeShard(self._files, self._spill)
        first = grouped | "Dedupe" >> beam.ParDo(dedupe).with_outputs(
            REJECTED, ITEM_COUNTS, main="kept"
        )
        counts = (
            first[ITEM_COUNTS]
            | "AllItemCounts" >> beam.combiners.ToList()
            | "SumItemCounts" >> beam.Map(sum_counts)
        )
        out = first.kept | "SplitAndWrite" >> beam.ParDo(
            split_fn, item_counts=beam.pvalue.AsSingleton(counts)
        ).with_outputs(REJECTED, COUNTS, USERS, ITEMS)
        rejected = (first[REJECTED], out[REJECTED]) | "AllSplitRejected" >> beam.Flatten()
        return _Outputs(rejected, out[COUNTS], out[USERS], out[ITEMS])
