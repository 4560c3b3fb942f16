"""Read raw interaction rows, with their provenance, from delimited text, JSON Lines, Parquet.

Every reader turns one file path into raw rows `(file, row, values, raw)` and rejections; it
never raises on bad content, so one broken file costs its rows, not the night's run. Row
numbers are 1-based: physical line numbers for delimited text (the header is line 1), data row
numbers for Parquet.
"""

import csv
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, BinaryIO, Literal

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.typehints import no_annotations

from beam_jobs.records import (
    EXCLUDED_EVENT_TYPE,
    MALFORMED_ROW,
    MISSING_COLUMN,
    MISSING_FIELD,
    UNDECODABLE,
    UNREADABLE_FILE,
    WRONG_COLUMN_COUNT,
    Raw,
    RawRow,
    Rejection,
    raw_json,
    rejection,
)
from beam_jobs.validation import MS_PER_SECOND, validate
from recsys.config import DataConfig
from recsys.errors import ConfigError
from recsys.schema import ITEM_ID, TIMESTAMP, USER_ID, WEIGHT

REJECTED = "rejected"
PARQUET_BATCH_ROWS = 64 * 1024
MOVIELENS_COLUMNS = ("user_id", "item_id", "rating", "timestamp")
EVENT_TYPE = "event_type"
# ml-latest ratings.csv has a header; 1M/10M ratings.dat are `user::item::rating::timestamp`.
MOVIELENS_LATEST_COLUMNS = ("userId", "movieId", "rating", "timestamp")
MULTI_CHAR_STAND_IN = "\x1f"  # csv wants a one-character delimiter: `::` is replaced by this


@dataclass(frozen=True)
class ReadSpec:
    """How to read one kind of input: format, column names and (headerless files) the header."""

    format: Literal["delimited", "parquet", "jsonl"]
    user: str
    item: str
    timestamp: str
    weight: str
    weight_required: bool
    delimiter: str = ","
    header: tuple[str, ...] | None = None
    has_header: bool = True  # False: columns are named by index, "0", "1", ...
    event: str | None = None
    event_types: frozenset[str] | None = None


def read_spec(data: DataConfig) -> ReadSpec:
    """The ReadSpec for `data.source`; the synthetic log is read as the CSV it is written as."""
    if data.source in ("movielens-100k", "movielens-1m", "movielens-10m", "movielens-latest"):
        return _movielens_spec(data.source)
    delimiter = {"tab": "\t", "\\t": "\t"}.get(data.delimiter, data.delimiter)
    if not delimiter or "\n" in delimiter or "\r" in delimiter or '"' in delimiter:
        raise ConfigError(
            f"data.delimiter {data.delimiter!r} cannot separate fields: use e.g. ',', '\\t', '|' "
            "or '::'"
        )
    cols = data.columns
    # An unmapped weight column is optional: use a column named like the schema's if present.
    weight, required = (cols.weight, True) if cols.weight else (WEIGHT, False)
    fmt: Literal["delimited", "parquet", "jsonl"] = (
        "parquet"
        if data.source == "parquet"
        else "jsonl"
        if data.source == "jsonl"
        else "delimited"
    )
    if data.event_types is not None and not cols.event_type:
        raise ConfigError(
            "data.event_types needs data.columns.event_type (the column to filter on)"
        )
    return ReadSpec(
        format=fmt,
        user=cols.user_id,
        item=cols.item_id,
        timestamp=cols.timestamp,
        weight=weight,
        weight_required=required,
        delimiter=delimiter,
        has_header=data.header,
        event=cols.event_type,
        event_types=frozenset(data.event_types) if data.event_types is not None else None,
    )


def _movielens_spec(source: str) -> ReadSpec:
    if source == "movielens-latest":
        user, item, rating, timestamp = MOVIELENS_LATEST_COLUMNS
        return ReadSpec("delimited", user, item, timestamp, rating, True, ",")
    user, item, rating, timestamp = MOVIELENS_COLUMNS
    delimiter = "\t" if source == "movielens-100k" else "::"
    return ReadSpec(
        "delimited", user, item, timestamp, rating, True, delimiter, header=MOVIELENS_COLUMNS
    )


@dataclass(frozen=True)
class _Columns:
    """Where the schema fields are among a file's columns, and which required ones are missing."""

    indexes: tuple[int, ...]  # user, item, timestamp[, weight]
    has_weight: bool
    missing_field: str | None


def _locate(names: list[str], spec: ReadSpec) -> _Columns:
    position = {name: i for i, name in reversed(list(enumerate(names)))}
    wanted = [(USER_ID, spec.user), (ITEM_ID, spec.item), (TIMESTAMP, spec.timestamp)]
    has_weight = spec.weight_required or spec.weight in position
    if has_weight:
        wanted.append((WEIGHT, spec.weight))
    if spec.event:
        wanted.append((EVENT_TYPE, spec.event))
    missing = next((field for field, column in wanted if column not in position), None)
    indexes = tuple(position.get(column, -1) for _, column in wanted)
    return _Columns(indexes, has_weight, missing)


def _finish(
    path: str, line: int, values: tuple[Any, ...], raw: Raw, cols: _Columns, spec: ReadSpec
) -> RawRow | Rejection:
    """Picked values -> a RawRow (weight None when absent), or an excluded-event rejection."""
    if spec.event:
        *values_list, event = values
        values = tuple(values_list)
        if spec.event_types is not None and str(event).strip() not in spec.event_types:
            return rejection(path, line, EVENT_TYPE, EXCLUDED_EVENT_TYPE, raw)
    return path, line, values if cols.has_weight else (*values, None), raw


class _LineFeed:
    """Decoded lines for csv.reader, remembering line numbers and raw text of the current row.

    A line that is not UTF-8 is handed to csv.reader as a blank line (which it skips) and
    recorded in `undecodable`, so the rest of the file is still read.
    """

    def __init__(self, lines: Iterable[bytes], multi_char_delimiter: str | None = None) -> None:
        self._lines = iter(lines)
        self._multi = multi_char_delimiter
        self.line_no = 0
        self._row_start = 1
        self._pending: list[str] = []
        self.undecodable: list[tuple[int, str]] = []

    def __iter__(self) -> "_LineFeed":
        return self

    def __next__(self) -> str:
        data = next(self._lines)
        self.line_no += 1
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raw = data.decode("utf-8", "backslashreplace").rstrip("\r\n")
            self.undecodable.append((self.line_no, raw))
            text = "\n"
        self._pending.append(text)
        if self._multi:
            return text.replace(self._multi, MULTI_CHAR_STAND_IN)
        return text

    def take(self) -> tuple[int, str]:
        """The first line number and the raw text of the lines read since the last take."""
        start, raw = self._row_start, "".join(self._pending).rstrip("\r\n")
        self._pending.clear()
        self._row_start = self.line_no + 1
        return start, raw


def read_delimited(path: str, spec: ReadSpec) -> Iterator[RawRow | Rejection]:
    """Rows of a delimited text file (with a header, or headerless like u.data)."""
    try:
        with open(path, "rb") as fh:
            yield from _delimited_rows(path, fh, spec)
    except OSError as exc:
        yield rejection(path, 0, None, UNREADABLE_FILE, f"{type(exc).__name__}: {exc}")


def _delimited_rows(path: str, fh: BinaryIO, spec: ReadSpec) -> Iterator[RawRow | Rejection]:
    multi = spec.delimiter if len(spec.delimiter) > 1 else None
    feed = _LineFeed(fh, multi)
    reader = csv.reader(feed, delimiter=MULTI_CHAR_STAND_IN if multi else spec.delimiter)
    first: list[str] | None = None
    if spec.header:
        header: list[str] | None = list(spec.header)
    elif not spec.has_header:
        # Columns by index: the first row (a data row) says how many there are.
        first = _first_row(reader)
        if first is None:
            return
        header = [str(i) for i in range(len(first))]
    else:
        header = _read_header(reader)
    if header is None:
        return
    if spec.header is None and spec.has_header:
        header_line, header_raw = feed.take()
        if feed.undecodable:
            msg = f"header line {header_line} is not UTF-8: {header_raw[:200]}"
            yield rejection(path, 0, None, UNREADABLE_FILE, msg)
            return
    cols = _locate(header, spec)
    pick = itemgetter(*cols.indexes)
    width = len(header)
    while True:
        try:
            fields = first if first is not None else next(reader)
            first = None
        except StopIteration:
            break
        except csv.Error:
            line, raw = feed.take()
            yield rejection(path, line, None, MALFORMED_ROW, raw)
            continue
        line, raw = feed.take()
        if feed.undecodable:
            yield from (rejection(path, n, None, UNDECODABLE, r) for n, r in feed.undecodable)
            feed.undecodable.clear()
        if not fields:
            continue  # a blank line is not a row
        if cols.missing_field:
            yield rejection(path, line, cols.missing_field, MISSING_COLUMN, raw)
        elif len(fields) != width:
            yield rejection(path, line, None, WRONG_COLUMN_COUNT, raw)
        else:
            yield _finish(path, line, _as_tuple(pick(fields)), raw, cols, spec)


def _as_tuple(values: Any) -> tuple[Any, ...]:
    return values if isinstance(values, tuple) else (values,)


def _first_row(reader: Iterator[list[str]]) -> list[str] | None:
    # Skip blank lines and unparseable rows here; the main loop reports the latter.
    for _ in range(1000):
        try:
            row = next(reader)
        except StopIteration:
            return None
        except csv.Error:
            return ["?"]
        if row:
            return row
    return None


def _read_header(reader: Iterator[list[str]]) -> list[str] | None:
    header = next(reader, None)
    if header is None:
        return None
    header = [name.strip() for name in header]
    if header:
        header[0] = header[0].removeprefix("\ufeff")  # a BOM from spreadsheet exports
    return header


def read_parquet(path: str, spec: ReadSpec) -> Iterator[RawRow | Rejection]:
    """Rows of a Parquet file, read in Arrow record batches of the needed columns only."""
    row = 0  # rows read so far
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        cols = _locate(names, spec)
        if cols.missing_field:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                for record in batch.to_pylist():
                    row += 1
                    yield rejection(path, row, cols.missing_field, MISSING_COLUMN, raw_json(record))
            return
        wanted = [names[i] for i in cols.indexes]
        # iter_batches wants each column once, even if two fields map to the same column.
        columns = list(dict.fromkeys(wanted))
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            yield from _batch_rows(path, row, batch, wanted, cols, spec)
            row += batch.num_rows
    except (OSError, pa.ArrowException) as exc:
        # Row 0 when the file cannot be opened, else the first row that could not be read.
        first_unread = row + 1 if row else 0
        yield rejection(path, first_unread, None, UNREADABLE_FILE, f"{type(exc).__name__}: {exc}")


def _batch_rows(
    path: str,
    offset: int,
    batch: pa.RecordBatch,
    wanted: list[str],
    cols: _Columns,
    spec: ReadSpec,
) -> Iterator[RawRow | Rejection]:
    # Column-wise to_pylist is ~10x faster than a dict per row (RecordBatch.to_pylist).
    values_by_column = {name: batch.column(name).to_pylist() for name in set(wanted)}
    columns: list[list[Any]] = [values_by_column[name] for name in wanted]
    names = tuple(wanted)
    for i, values in enumerate(zip(*columns, strict=True), start=offset + 1):
        raw = (names, values)
        yield _finish(path, i, values, raw, cols, spec)


def read_jsonl(path: str, spec: ReadSpec) -> Iterator[RawRow | Rejection]:
    """Rows of a JSON Lines file: one object per line, fields by key (absent key: null)."""
    try:
        with open(path, "rb") as fh:
            yield from _jsonl_rows(path, fh, spec)
    except OSError as exc:
        yield rejection(path, 0, None, UNREADABLE_FILE, f"{type(exc).__name__}: {exc}")


def _jsonl_rows(path: str, fh: BinaryIO, spec: ReadSpec) -> Iterator[RawRow | Rejection]:
    keys = [spec.user, spec.item, spec.timestamp, spec.weight]
    if spec.event:
        keys.append(spec.event)
    for line_no, data in enumerate(fh, start=1):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raw = data.decode("utf-8", "backslashreplace").rstrip("\r\n")
            yield rejection(path, line_no, None, UNDECODABLE, raw)
            continue
        raw = text.rstrip("\r\n")
        if not raw.strip():
            continue  # a blank line is not a row
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):
            yield rejection(path, line_no, None, MALFORMED_ROW, raw)
            continue
        if not isinstance(record, dict):
            yield rejection(path, line_no, None, MALFORMED_ROW, raw)
            continue
        if spec.weight_required and spec.weight not in record:
            yield rejection(path, line_no, WEIGHT, MISSING_FIELD, raw)
            continue
        values = tuple(record.get(key) for key in keys)
        nested = next((i for i, v in enumerate(values) if isinstance(v, dict | list)), None)
        if nested is not None:
            # An object or array is no id, time or weight (and its text would make a bogus id).
            field = (USER_ID, ITEM_ID, TIMESTAMP, WEIGHT, EVENT_TYPE)[nested]
            yield rejection(path, line_no, field, MALFORMED_ROW, raw)
            continue
        if spec.event:
            *picked, event = values
            if spec.event_types is not None and str(event).strip() not in spec.event_types:
                yield rejection(path, line_no, EVENT_TYPE, EXCLUDED_EVENT_TYPE, raw)
                continue
            values = tuple(picked)
        yield path, line_no, values, raw


READERS = {"parquet": read_parquet, "jsonl": read_jsonl, "delimited": read_delimited}
TALLY = "tally"
TIME_RANGE = "time_range"
INPUT_ROWS = "input_rows"  # as in beam_jobs.stats


class _ReadAndValidate(beam.DoFn):
    """file path -> events (main), rejections, and one row tally and time range per file.

    Reading and validating in one call per file keeps a Beam element boundary (and its
    per-element cost) off every row; the tallies are counted here, where rows leave the
    readers, independently of the split's counts that stats.json reconciles them with.
    """

    def __init__(self, spec: ReadSpec, cutoff: int, unit_divisor: int) -> None:
        self._spec = spec
        self._read = READERS[spec.format]
        self._cutoff = cutoff
        self._divisor = unit_divisor

    def process(self, path: str) -> Iterator[Any]:
        rows = 0
        low: int | None = None
        high: int | None = None
        for item in self._read(path, self._spec):
            rows += 1
            if not isinstance(item, dict):
                item = validate(item, self._cutoff, self._divisor)
            if isinstance(item, dict):
                yield beam.pvalue.TaggedOutput(REJECTED, item)
                continue
            seconds = item[1][0]
            low = seconds if low is None or seconds < low else low
            high = seconds if high is None or seconds > high else high
            yield item
        yield beam.pvalue.TaggedOutput(TALLY, (INPUT_ROWS, rows))
        yield beam.pvalue.TaggedOutput(TIME_RANGE, (low, high))


class ReadAndValidate(beam.PTransform):
    """PCollection of file paths -> (events, rejected, tally, time_range); see _ReadAndValidate."""

    def __init__(self, spec: ReadSpec, cutoff: int, timestamp_unit: str = "s") -> None:
        super().__init__()
        self._spec = spec
        self._cutoff = cutoff
        self._divisor = MS_PER_SECOND if timestamp_unit == "ms" else 1

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, paths: beam.PCollection) -> beam.pvalue.DoOutputsTuple:
        return (
            paths
            # Spread files over workers on distributed runners (a handful of elements: cheap).
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadAndValidate"
            >> beam.ParDo(_ReadAndValidate(self._spec, self._cutoff, self._divisor)).with_outputs(
                REJECTED, TALLY, TIME_RANGE, main="events"
            )
        )
