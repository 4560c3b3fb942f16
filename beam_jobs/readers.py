"""Read raw interaction rows, with their provenance, from CSV, MovieLens u.data and Parquet.

Every reader turns one file path into raw rows `(file, row, values, raw)` and rejections; it
never raises on bad content, so one broken file costs its rows, not the night's run. Row
numbers are 1-based: physical line numbers for delimited text (the header is line 1), data row
numbers for Parquet.
"""

import csv
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, BinaryIO, Literal

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.typehints import no_annotations

from beam_jobs.records import (
    MALFORMED_ROW,
    MISSING_COLUMN,
    UNDECODABLE,
    UNREADABLE_FILE,
    WRONG_COLUMN_COUNT,
    RawRow,
    Rejection,
    raw_json,
    rejection,
)
from recsys.config import DataConfig
from recsys.errors import ConfigError
from recsys.schema import ITEM_ID, TIMESTAMP, USER_ID, WEIGHT

REJECTED = "rejected"
PARQUET_BATCH_ROWS = 64 * 1024
MOVIELENS_COLUMNS = ("user_id", "item_id", "rating", "timestamp")


@dataclass(frozen=True)
class ReadSpec:
    """How to read one kind of input: format, column names and (headerless files) the header."""

    format: Literal["delimited", "parquet"]
    user: str
    item: str
    timestamp: str
    weight: str
    weight_required: bool
    delimiter: str = ","
    header: tuple[str, ...] | None = None


def read_spec(data: DataConfig) -> ReadSpec:
    """The ReadSpec for `data.source`; the synthetic log is read as the CSV it is written as."""
    if data.source == "movielens-100k":
        user, item, rating, timestamp = MOVIELENS_COLUMNS
        return ReadSpec(
            format="delimited",
            user=user,
            item=item,
            timestamp=timestamp,
            weight=rating,
            weight_required=True,
            delimiter="\t",
            header=MOVIELENS_COLUMNS,
        )
    if len(data.delimiter) != 1:
        raise ConfigError(f"data.delimiter must be one character, got {data.delimiter!r}")
    cols = data.columns
    # An unmapped weight column is optional: use a column named like the schema's if present.
    weight, required = (cols.weight, True) if cols.weight else (WEIGHT, False)
    fmt: Literal["delimited", "parquet"] = "parquet" if data.source == "parquet" else "delimited"
    return ReadSpec(
        format=fmt,
        user=cols.user_id,
        item=cols.item_id,
        timestamp=cols.timestamp,
        weight=weight,
        weight_required=required,
        delimiter=data.delimiter,
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
    if spec.weight_required or spec.weight in position:
        wanted.append((WEIGHT, spec.weight))
    missing = next((field for field, column in wanted if column not in position), None)
    indexes = tuple(position.get(column, -1) for _, column in wanted)
    return _Columns(indexes, len(wanted) == 4, missing)


class _LineFeed:
    """Decoded lines for csv.reader, remembering line numbers and raw text of the current row.

    A line that is not UTF-8 is handed to csv.reader as a blank line (which it skips) and
    recorded in `undecodable`, so the rest of the file is still read.
    """

    def __init__(self, lines: Iterable[bytes]) -> None:
        self._lines = iter(lines)
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
        return text

    def take(self) -> tuple[int, str]:
        """The first line number and the raw text of the lines read since the last take."""
        start, raw = self._row_start, "".join(self._pending).rstrip("\r\n")
        self._pending.clear()
        self._row_start = self.line_no + 1
        return start, raw


def read_delimited(path: str, spec: ReadSpec) -> Iterator[RawRow | Rejection]:
    """Rows of a delimited text file (CSV with a header, or headerless like u.data)."""
    try:
        with open(path, "rb") as fh:
            yield from _delimited_rows(path, fh, spec)
    except OSError as exc:
        yield rejection(path, 0, None, UNREADABLE_FILE, f"{type(exc).__name__}: {exc}")


def _delimited_rows(path: str, fh: BinaryIO, spec: ReadSpec) -> Iterator[RawRow | Rejection]:
    feed = _LineFeed(fh)
    reader = csv.reader(feed, delimiter=spec.delimiter)
    header = list(spec.header) if spec.header else _read_header(reader)
    if header is None:
        return
    if spec.header is None:
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
            fields = next(reader)
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
            values = pick(fields)
            yield path, line, values if cols.has_weight else (*values, None), raw


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
            yield from _batch_rows(path, row, batch, wanted, cols.has_weight)
            row += batch.num_rows
    except (OSError, pa.ArrowException) as exc:
        # Row 0 when the file cannot be opened, else the first row that could not be read.
        first_unread = row + 1 if row else 0
        yield rejection(path, first_unread, None, UNREADABLE_FILE, f"{type(exc).__name__}: {exc}")


def _batch_rows(
    path: str, offset: int, batch: pa.RecordBatch, wanted: list[str], has_weight: bool
) -> Iterator[RawRow]:
    values_by_column = {name: batch.column(name).to_pylist() for name in set(wanted)}
    columns: list[list[Any]] = [values_by_column[name] for name in wanted]
    if not has_weight:
        columns.append([None] * batch.num_rows)
    for i, values in enumerate(zip(*columns, strict=True), start=offset + 1):
        raw = raw_json(dict(zip(wanted, values, strict=False)))  # not the filler weight
        yield path, i, values, raw


class _ReadFile(beam.DoFn):
    """file path -> raw rows (main output) and rejections (tagged output)."""

    def __init__(self, spec: ReadSpec) -> None:
        self._spec = spec
        self._read = read_parquet if spec.format == "parquet" else read_delimited

    def process(self, path: str) -> Iterator[Any]:
        for item in self._read(path, self._spec):
            yield beam.pvalue.TaggedOutput(REJECTED, item) if isinstance(item, dict) else item


class ReadRawRows(beam.PTransform):
    """PCollection of file paths -> (rows, rejected): every row of every file, with provenance."""

    def __init__(self, spec: ReadSpec) -> None:
        super().__init__()
        self._spec = spec

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, paths: beam.PCollection) -> beam.pvalue.DoOutputsTuple:
        return (
            paths
            # Spread files over workers on distributed runners (a handful of elements: cheap).
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadFile" >> beam.ParDo(_ReadFile(self._spec)).with_outputs(REJECTED, main="rows")
        )
