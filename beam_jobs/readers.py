"""Read raw interaction rows, with their provenance, from delimited text, JSON Lines, Parquet.

Every reader turns one file path into raw rows `(file, row, values, raw)` and rejections; it
never raises on bad content, so one broken file costs its rows, not the night's run. Row
numbers are 1-based: physical line numbers for delimited text (the header is line 1), data row
numbers for Parquet.
"""

import csv
import json
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, BinaryIO, Literal, TypeAlias

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.typehints import no_annotations

from beam_jobs import columnar as col
from beam_jobs.items import unknown_item
from beam_jobs.records import (
    EXCLUDED_EVENT_TYPE,
    MALFORMED_ROW,
    MISSING_COLUMN,
    MISSING_FIELD,
    UNBALANCED_QUOTE,
    UNDECODABLE,
    UNREADABLE_FILE,
    WRONG_COLUMN_COUNT,
    Raw,
    RawRow,
    Rejection,
    raw_json,
    rejection,
)
from beam_jobs.validation import validate
from recsys.core import storage
from recsys.core.config import DataConfig
from recsys.core.errors import ConfigError, DataError
from recsys.core.schema import ITEM_ID, TIMESTAMP, USER_ID, WEIGHT

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
    multiline: bool = False  # True: a quoted field may span lines (data.multiline_fields)


@dataclass
class LineCount:
    """Physical lines of the files read, by kind; `data` lines are what stats.json reconciles.

    Every data line ends as exactly one accepted, rejected or duplicate row. A file that cannot
    be read at all counts as one data line (its one `unreadable_file` rejection); a Parquet
    row counts as one line. `continuation`: lines that continued a quoted field
    (data.multiline_fields only).
    """

    data: int = 0
    header: int = 0
    blank: int = 0
    continuation: int = 0


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
        multiline=data.multiline_fields,
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
    recorded in `undecodable`, so the rest of the file is still read. Only used with
    data.multiline_fields, where a quoted field may span lines.
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

    def take(self) -> tuple[int, str, int]:
        """First line number, raw text and number of the lines read since the last take."""
        start, raw = self._row_start, "".join(self._pending).rstrip("\r\n")
        self._pending.clear()
        self._row_start = self.line_no + 1
        return start, raw, self.line_no - start + 1


def read_delimited(
    path: str, spec: ReadSpec, lines: LineCount | None = None
) -> Iterator[RawRow | Rejection]:
    """Rows of a delimited text file (with a header, or headerless like u.data)."""
    lines = LineCount() if lines is None else lines
    rows = _multiline_rows if spec.multiline else _line_rows
    try:
        with storage.open_input(path) as fh:
            yield from rows(path, fh, spec, lines)
    except OSError as exc:
        lines.data += 1
        yield rejection(path, 0, None, UNREADABLE_FILE, f"{type(exc).__name__}: {exc}")


def split_line(text: str, delimiter: str) -> tuple[list[str] | None, str | None]:
    """One line's fields, or (None, reason) when its quoting is broken.

    A line without quotes is split as is (what csv.reader would return, faster). A quoted
    field must close on its own line: if it does not, the line is `unbalanced_quote`, and the
    next line is read as the next row whatever this one held.
    """
    if '"' not in text:
        return text.split(delimiter), None
    sep = delimiter
    if len(delimiter) > 1:
        text, sep = text.replace(delimiter, MULTI_CHAR_STAND_IN), MULTI_CHAR_STAND_IN
    try:
        return next(csv.reader([text], delimiter=sep, strict=True)), None
    except csv.Error as exc:
        # Strict parsing fails at the end of the line exactly when a quoted field is open.
        if "unexpected end of data" in str(exc):
            return None, UNBALANCED_QUOTE
    try:
        # Text after a closing quote (`"a"b`): the lenient reading, as csv.reader gives it.
        return next(csv.reader([text], delimiter=sep)), None
    except csv.Error:
        return None, MALFORMED_ROW


def header_names(fields: list[str]) -> list[str]:
    """A header row's column names: stripped, without a spreadsheet export's BOM."""
    names = [name.strip() for name in fields]
    if names:
        names[0] = names[0].removeprefix("\ufeff")
    return names


def _line_rows(
    path: str, fh: BinaryIO, spec: ReadSpec, lines: LineCount
) -> Iterator[RawRow | Rejection]:
    """Rows of a line-oriented file: one row per non-blank line, quotes never span lines."""
    delimiter = spec.delimiter
    header = list(spec.header) if spec.header else None
    table = _Table(header, spec) if header else None
    for line_no, data in enumerate(fh, start=1):
        try:
            text = data.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raw = data.decode("utf-8", "backslashreplace").rstrip("\r\n")
            if table is None and spec.has_header:
                lines.header += 1
                lines.data += 1  # the file's one unreadable_file rejection
                msg = f"header line {line_no} is not UTF-8: {raw[:200]}"
                yield rejection(path, 0, None, UNREADABLE_FILE, msg)
                return
            lines.data += 1
            yield rejection(path, line_no, None, UNDECODABLE, raw)
            continue
        if not text:
            lines.blank += 1
            continue
        fields, reason = split_line(text, delimiter)
        if table is None and spec.has_header:
            lines.header += 1
            table = _Table(header_names(fields or [text]), spec)
            continue
        lines.data += 1
        if fields is None:
            assert reason is not None  # split_line gives a reason with every None
            yield rejection(path, line_no, None, reason, text)
            continue
        if table is None:
            # Headerless: columns by index, as many as the first parsed row has.
            table = _Table([str(i) for i in range(len(fields))], spec)
        yield table.row(path, line_no, fields, text)


class _Table:
    """A file's columns: turns one row's fields into a RawRow or a rejection."""

    def __init__(self, header: list[str], spec: ReadSpec) -> None:
        self.cols = _locate(header, spec)
        self.pick = itemgetter(*self.cols.indexes)
        self.width = len(header)
        self.spec = spec

    def row(self, path: str, line: int, fields: list[str], raw: str) -> RawRow | Rejection:
        """The row of these fields, or the rejection of a missing column or wrong width."""
        if self.cols.missing_field:
            return rejection(path, line, self.cols.missing_field, MISSING_COLUMN, raw)
        if len(fields) != self.width:
            return rejection(path, line, None, WRONG_COLUMN_COUNT, raw)
        return _finish(path, line, _as_tuple(self.pick(fields)), raw, self.cols, self.spec)


def _multiline_rows(
    path: str, fh: BinaryIO, spec: ReadSpec, lines: LineCount
) -> Iterator[RawRow | Rejection]:
    """Rows of a file whose quoted fields may span lines (data.multiline_fields: true)."""
    multi = spec.delimiter if len(spec.delimiter) > 1 else None
    feed = _LineFeed(fh, multi)
    reader = csv.reader(feed, delimiter=MULTI_CHAR_STAND_IN if multi else spec.delimiter)
    table = _Table(list(spec.header), spec) if spec.header else None
    while True:
        try:
            fields = next(reader)
            error = None
        except StopIteration:
            break
        except csv.Error:
            fields, error = [], MALFORMED_ROW
        line, raw, taken = feed.take()
        undecodable = len(feed.undecodable)
        if undecodable and table is None and spec.has_header:
            lines.header += taken
            lines.data += 1
            msg = f"header line {line} is not UTF-8: {raw[:200]}"
            yield rejection(path, 0, None, UNREADABLE_FILE, msg)
            return
        lines.data += undecodable
        yield from (rejection(path, n, None, UNDECODABLE, r) for n, r in feed.undecodable)
        feed.undecodable.clear()
        if not fields and error is None:
            lines.blank += taken - undecodable
            continue
        if table is None and spec.has_header:
            lines.header += taken
            table = _Table(header_names(fields), spec)
            continue
        lines.data += 1
        lines.continuation += taken - 1 - undecodable
        if error is not None:
            yield rejection(path, line, None, error, raw)
            continue
        if table is None:
            table = _Table([str(i) for i in range(len(fields))], spec)
        yield table.row(path, line, fields, raw)


def _as_tuple(values: Any) -> tuple[Any, ...]:
    return values if isinstance(values, tuple) else (values,)


def check_header(path: str, spec: ReadSpec) -> None:
    """DataError naming the file and the column when a delimited file's header repeats a name.

    Two columns of one name would make the row's value depend on which one is taken.
    """
    if spec.format != "delimited" or spec.header or not spec.has_header:
        return
    try:
        with storage.open_input(path) as fh:
            first = next((line for line in fh if line.strip()), b"")
    except OSError:
        return  # the reader reports it as unreadable_file
    text = first.decode("utf-8", "replace").rstrip("\r\n")
    fields, _ = split_line(text, spec.delimiter)
    seen: set[str] = set()
    for name in header_names(fields or [text]):
        if name in seen:
            raise DataError(
                f"{path}: the header names column {name!r} twice; rename one of them "
                "(which one holds the value would be a guess)"
            )
        seen.add(name)


def read_parquet(path: str, spec: ReadSpec) -> Iterator[RawRow | Rejection]:
    """Rows of a Parquet file, read in Arrow record batches of the needed columns only."""
    row = 0  # rows read so far
    try:
        pf = parquet_file(path)
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


def read_jsonl(
    path: str, spec: ReadSpec, lines: LineCount | None = None
) -> Iterator[RawRow | Rejection]:
    """Rows of a JSON Lines file: one object per line, fields by key (absent key: null)."""
    lines = LineCount() if lines is None else lines
    try:
        with storage.open_input(path) as fh:
            yield from _jsonl_rows(path, fh, spec, lines)
    except OSError as exc:
        lines.data += 1
        yield rejection(path, 0, None, UNREADABLE_FILE, f"{type(exc).__name__}: {exc}")


def _jsonl_rows(
    path: str, fh: BinaryIO, spec: ReadSpec, lines: LineCount
) -> Iterator[RawRow | Rejection]:
    keys = [spec.user, spec.item, spec.timestamp, spec.weight]
    if spec.event:
        keys.append(spec.event)
    for line_no, data in enumerate(fh, start=1):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            lines.data += 1
            raw = data.decode("utf-8", "backslashreplace").rstrip("\r\n")
            yield rejection(path, line_no, None, UNDECODABLE, raw)
            continue
        raw = text.rstrip("\r\n")
        if not raw.strip():
            lines.blank += 1
            continue  # a blank line is not a row
        lines.data += 1
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
        values: tuple[Any, ...] = tuple(record.get(key) for key in keys)
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


# --- batched reading and validation ---------------------------------------------------------
#
# Every reader hands out either rejections or record batches of validated rows
# (columnar.EVENT_SCHEMA). Parquet is validated column-wise: a row whose values are certainly
# valid (ids already clean printable ASCII or integers, integer or temporal timestamp inside
# the bounds, numeric weight) is accepted by array kernels; only the others go through the
# per-row `validate`, which gives the same result for clean rows and the reason for the rest.
# So the vectorised path is an optimisation that cannot change what is accepted or rejected.

TEXT_BATCH_ROWS = 64 * 1024
# A clean id: printable ASCII, no surrounding space (parse_id would return it unchanged).
_CLEAN_ID = r"^[!-~](?:[ -~]*[!-~])?$"
_SECONDS_PER = {"s": 1, "ms": 1000, "us": 1_000_000, "ns": 1_000_000_000}
Output: TypeAlias = Rejection | pa.RecordBatch


@dataclass(frozen=True)
class Bounds:
    """Accepted timestamps: [floor, cutoff) in seconds, and the unit of integer timestamps."""

    cutoff: int
    floor: int = 0
    divisor: int = 1


def _clean_ids(values: pa.Array) -> tuple[np.ndarray, pa.Array | None]:
    """(rows whose id is certainly valid, the ids as strings) for string or integer columns."""
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        ok = pc.fill_null(pc.match_substring_regex(values, _CLEAN_ID), False)
        return ok.to_numpy(zero_copy_only=False), values.cast(pa.string())
    if pa.types.is_integer(values.type):
        return values.is_valid().to_numpy(zero_copy_only=False), values.cast(pa.string())
    return np.zeros(len(values), dtype=bool), None


def _clean_seconds(values: pa.Array, divisor: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows with an exactly convertible timestamp, whole seconds) for integer/temporal types."""
    kind = values.type
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    if pa.types.is_integer(kind) and kind != pa.uint64():
        raw = pc.fill_null(values.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        return valid, raw // divisor
    if pa.types.is_timestamp(kind):  # naive means UTC, as in parse_timestamp; unit ignored
        raw = pc.fill_null(values.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        return valid, raw // _SECONDS_PER[kind.unit]
    if pa.types.is_date32(kind):
        raw = pc.fill_null(values.cast(pa.int32()), 0).to_numpy(zero_copy_only=False)
        return valid, raw.astype(np.int64) * 86_400
    return np.zeros(len(values), dtype=bool), np.zeros(len(values), dtype=np.int64)


def _clean_weights(values: pa.Array | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows with a usable numeric weight, the weights: null and NaN are 1.0)."""
    if values is None:
        return np.ones(n, dtype=bool), np.ones(n, dtype=np.float64)
    kind = values.type
    if not (pa.types.is_floating(kind) or pa.types.is_integer(kind)):
        return np.zeros(n, dtype=bool), np.ones(n, dtype=np.float64)
    weights = pc.fill_null(values.cast(pa.float64()), 1.0).to_numpy(zero_copy_only=False)
    weights = np.where(np.isnan(weights), 1.0, weights)
    return ~np.isinf(weights), weights


def _clean_events(values: pa.Array, spec: ReadSpec) -> np.ndarray:
    """Rows whose event type certainly passes data.event_types (unchecked without a list)."""
    if spec.event_types is None:
        return np.ones(len(values), dtype=bool)
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        return np.zeros(len(values), dtype=bool)
    keep = pc.is_in(values, value_set=pa.array(sorted(spec.event_types), values.type))
    return pc.fill_null(keep, False).to_numpy(zero_copy_only=False)


def validate_parquet_batch(
    path: str,
    file: int,
    offset: int,
    batch: pa.RecordBatch,
    wanted: list[str],
    cols: _Columns,
    spec: ReadSpec,
    bounds: Bounds,
) -> Iterator[Output]:
    """One Parquet record batch -> a batch of validated rows, and rejections for the others."""
    n = batch.num_rows
    user_ok, users = _clean_ids(batch.column(wanted[0]))
    item_ok, items = _clean_ids(batch.column(wanted[1]))
    ts_ok, seconds = _clean_seconds(batch.column(wanted[2]), bounds.divisor)
    weight_col = batch.column(wanted[3]) if cols.has_weight else None
    weight_ok, weights = _clean_weights(weight_col, n)
    ok = user_ok & item_ok & ts_ok & weight_ok & (seconds >= bounds.floor)
    ok &= seconds < bounds.cutoff
    if spec.event:
        ok &= _clean_events(batch.column(wanted[-1]), spec)
    fast = np.flatnonzero(ok)
    if len(fast):
        take = pa.array(fast)
        yield pa.record_batch(
            [
                users.take(take),  # type: ignore[union-attr]
                items.take(take),  # type: ignore[union-attr]
                pa.array(seconds[fast]),
                pa.array(weights[fast]),
                pa.array(np.full(len(fast), file, dtype=np.int32)),
                pa.array(fast + offset + 1),
                pa.nulls(len(fast), pa.string()),
            ],
            schema=col.ROW_SCHEMA,
        )
    slow = np.flatnonzero(~ok)
    if len(slow):
        # The per-row path for the rest: exact reasons, and the raw values for rejections.
        picked = batch.select(list(dict.fromkeys(wanted))).take(pa.array(slow))
        values_by_column = {name: picked.column(name).to_pylist() for name in set(wanted)}
        columns = [values_by_column[name] for name in wanted]
        rows = (
            _finish(path, int(i) + offset + 1, values, (tuple(wanted), values), cols, spec)
            for i, values in zip(slow, zip(*columns, strict=True), strict=True)
        )
        yield from _validated(rows, file, bounds, keep_raw=False)


def _validated(
    rows: Iterable[RawRow | Rejection], file: int, bounds: Bounds, keep_raw: bool = True
) -> Iterator[Output]:
    """Per-row validation of reader output, collected into record batches of valid rows."""
    users: list[str] = []
    items: list[str] = []
    stamps: list[int] = []
    weights: list[float] = []
    lines: list[int] = []
    raws: list[str | None] = []
    for row in rows:
        result = row if isinstance(row, dict) else validate(row, *_limits(bounds))
        if isinstance(result, dict):
            yield result
            continue
        user, (seconds, item, _, line, weight, raw) = result
        users.append(user)
        items.append(item)
        stamps.append(seconds)
        weights.append(weight)
        lines.append(line)
        raws.append(raw if keep_raw and isinstance(raw, str) else None)
        if len(users) >= TEXT_BATCH_ROWS:
            yield col.event_batch(users, items, stamps, weights, file, lines, raws)
            users, items, stamps, weights, lines, raws = [], [], [], [], [], []
    if users:
        yield col.event_batch(users, items, stamps, weights, file, lines, raws)


def _limits(bounds: Bounds) -> tuple[int, int, int]:
    return bounds.cutoff, bounds.divisor, bounds.floor


def read_parquet_batches(
    path: str, file: int, spec: ReadSpec, bounds: Bounds, lines: LineCount | None = None
) -> Iterator[Output]:
    """A Parquet file as validated record batches and rejections (a row counts as a line)."""
    lines = LineCount() if lines is None else lines
    row = 0  # rows read so far
    try:
        pf = parquet_file(path)
        names = pf.schema_arrow.names
        cols = _locate(names, spec)
        if cols.missing_field:
            for out in read_parquet(path, spec):
                lines.data += 1
                yield out
            return
        wanted = [names[i] for i in cols.indexes]
        columns = list(dict.fromkeys(wanted))
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            yield from validate_parquet_batch(path, file, row, batch, wanted, cols, spec, bounds)
            row += batch.num_rows
            lines.data += batch.num_rows
    except (OSError, pa.ArrowException) as exc:
        lines.data += 1
        first_unread = row + 1 if row else 0
        yield rejection(path, first_unread, None, UNREADABLE_FILE, f"{type(exc).__name__}: {exc}")


def read_batches(
    path: str, file: int, spec: ReadSpec, bounds: Bounds, lines: LineCount | None = None
) -> Iterator[Output]:
    """Any input file as validated record batches and rejections (one per rejected row).

    `lines` (optional) counts the file's physical lines by kind as they are read.
    """
    lines = LineCount() if lines is None else lines
    if spec.format == "parquet":
        return read_parquet_batches(path, file, spec, bounds, lines)
    reader = read_jsonl if spec.format == "jsonl" else read_delimited
    return _validated(reader(path, spec, lines), file, bounds)


def parquet_file(path: str) -> pq.ParquetFile:
    """A Parquet file, local or in object storage (random access: footer, then columns)."""
    if storage.is_uri(path):
        return pq.ParquetFile(storage.open_random_access(path))
    return pq.ParquetFile(path)


def parquet_raw(path: str, spec: ReadSpec, rows: Iterable[int]) -> dict[int, str]:
    """The raw JSON of some rows (1-based) of a Parquet file, read back for their rejections."""
    wanted_rows = sorted(set(rows))
    out: dict[int, str] = {}
    pf = parquet_file(path)
    names = pf.schema_arrow.names
    cols = _locate(names, spec)
    columns = list(dict.fromkeys(names[i] for i in cols.indexes if i >= 0))
    start = 0
    position = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
        stop = start + batch.num_rows
        take = []
        while position < len(wanted_rows) and wanted_rows[position] <= stop:
            take.append(wanted_rows[position])
            position += 1
        if take:
            picked = batch.take(pa.array([r - start - 1 for r in take]))
            for row, record in zip(take, picked.to_pylist(), strict=True):
                out[row] = raw_json(record)
        start = stop
        if position == len(wanted_rows):
            break
    return out


TALLY = "tally"
TIME_RANGE = "time_range"
INPUT_ROWS = "input_rows"  # as in beam_jobs.stats
INPUT_LINES = "input_lines"  # as in beam_jobs.stats
LINES_KEY = "lines:"  # header, blank, continuation lines, as in beam_jobs.stats


class _ReadAndValidate(beam.DoFn):
    """file path -> (shard, (rows, IPC bytes or spill file)), rejections, tally, time range.

    Reading and validating in one call per file keeps Beam's per-element cost off every row:
    what leaves is one element per record batch and shard. The tallies are counted here,
    where rows leave the readers, independently of the split's counts that stats.json
    reconciles them with. With an item file, rows of items it lacks are rejected here.
    """

    def __init__(
        self,
        spec: ReadSpec,
        bounds: Bounds,
        files: Sequence[str],
        num_shards: int,
        spill_dir: str | None = None,
    ) -> None:
        self._spec = spec
        self._bounds = bounds
        self._files = {path: i for i, path in enumerate(files)}
        self._shards = num_shards
        self._spill = spill_dir
        self._catalog: tuple[int, pa.Array] | None = None

    def _known(self, items: list[str]) -> pa.Array:
        # The side input arrives once per bundle as the same list: index it once.
        if self._catalog is None or self._catalog[0] != id(items):
            self._catalog = (id(items), pa.array(items, pa.string()))
        return self._catalog[1]

    def process(self, path: str, catalog: list[str] | None = None) -> Iterator[Any]:
        file = self._files[path]
        spill = col.SpillFiles(self._spill, f"{file:06d}") if self._spill else None
        rows = 0
        low: int | None = None
        high: int | None = None
        lines = LineCount()
        for out in read_batches(path, file, self._spec, self._bounds, lines):
            if isinstance(out, dict):
                rows += 1
                yield beam.pvalue.TaggedOutput(REJECTED, out)
                continue
            rows += out.num_rows
            stamps = out.column(col.TS)
            low = _lower(low, pc.min(stamps).as_py())
            high = _higher(high, pc.max(stamps).as_py())
            if catalog is not None:
                out = yield from _known_items_only(path, out, self._known(catalog))
            for shard, part in col.by_shard(out, self._shards):
                if spill is not None:
                    spill.write(shard, part)
                else:
                    yield shard, (part.num_rows, col.to_ipc(part))
        if spill is not None:
            yield from spill.close()
        yield beam.pvalue.TaggedOutput(TALLY, (INPUT_ROWS, rows))
        yield beam.pvalue.TaggedOutput(TALLY, (INPUT_LINES, lines.data))
        for kind in ("header", "blank", "continuation"):
            yield beam.pvalue.TaggedOutput(TALLY, (LINES_KEY + kind, getattr(lines, kind)))
        yield beam.pvalue.TaggedOutput(TIME_RANGE, (low, high))


def _known_items_only(
    path: str, batch: pa.RecordBatch, known: pa.Array
) -> Generator[Any, None, pa.RecordBatch]:
    """Reject (as a tagged output) the rows whose item is not in `known`; return the rest."""
    keep = pc.is_in(batch.column(col.ITEM), value_set=known).to_numpy(zero_copy_only=False)
    if keep.all():
        return batch
    for row, raw in zip(
        batch.column(col.ROW).filter(pa.array(~keep)).to_pylist(),
        batch.column(col.RAW).filter(pa.array(~keep)).to_pylist(),
        strict=True,
    ):
        yield beam.pvalue.TaggedOutput(REJECTED, unknown_item(path, row, raw))
    return batch.filter(pa.array(keep))


def _lower(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _higher(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


class ReadAndValidate(beam.PTransform):
    """PCollection of file paths -> (batches keyed by shard, rejected, tally, time_range).

    `catalog` (optional): a PCollection of the item file's ids; other items are rejected.
    `spill_dir` (optional): write the batches there (columnar.SpillFiles), shuffle paths.
    """

    def __init__(
        self,
        spec: ReadSpec,
        bounds: Bounds,
        files: Sequence[str],
        num_shards: int,
        catalog: beam.PCollection | None = None,
        spill_dir: str | None = None,
    ) -> None:
        super().__init__()
        self._fn = _ReadAndValidate(spec, bounds, files, num_shards, spill_dir)
        self._catalog = catalog

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, paths: beam.PCollection) -> beam.pvalue.DoOutputsTuple:
        extra = {}
        if self._catalog is not None:
            extra["catalog"] = beam.pvalue.AsList(self._catalog)
        return (
            paths
            # Spread files over workers on distributed runners (a handful of elements: cheap).
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadAndValidate"
            >> beam.ParDo(self._fn, **extra).with_outputs(
                REJECTED, TALLY, TIME_RANGE, main="batches"
            )
        )
