"""The preprocessing job's pure functions and file readers (no pipeline runs: fast)."""

import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from beam_jobs import records as r
from beam_jobs.inputs import InputFile, list_input_files
from beam_jobs.pipeline import quality_failure
from beam_jobs.readers import MOVIELENS_COLUMNS, ReadSpec, read_delimited, read_parquet, read_spec
from beam_jobs.records import raw_text
from beam_jobs.split import dedupe, split_names
from beam_jobs.stats import ReconciliationError, assemble_stats, check_reconciled, fingerprint
from beam_jobs.validation import InvalidValue, parse_id, parse_timestamp, parse_weight, validate
from beam_jobs.vocab import ranked
from recsys.core.config import DataConfig, PreprocessConfig
from recsys.core.errors import ConfigError, DataError

CSV_SPEC = ReadSpec("delimited", "user_id", "item_id", "timestamp", "weight", False)
DAY = int(dt.datetime(2026, 1, 5, tzinfo=dt.UTC).timestamp())


def reason_of(fn: Callable[..., object], *args: object) -> str:
    with pytest.raises(InvalidValue) as info:
        fn(*args)
    return info.value.reason


# --- field parsing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "unit", "expected"),
    [
        ("1767571200", 1, 1767571200),
        (" 1767571200 ", 1, 1767571200),
        ("1767571200123", 1000, 1767571200),
        (1767571200, 1, 1767571200),
        (1767571200.9, 1, 1767571200),
        ("1767571200.5", 1, 1767571200),
        ("2026-01-05T00:00:00Z", 1, 1767571200),
        ("2026-01-05T01:00:00+01:00", 1000, 1767571200),  # ISO ignores the numeric unit
        ("2026-01-05 00:00:00", 1, 1767571200),  # naive means UTC
        ("2026-01-05", 1, 1767571200),
        (dt.datetime(2026, 1, 5, tzinfo=dt.UTC), 1, 1767571200),
        (dt.date(2026, 1, 5), 1, 1767571200),
    ],
)
def test_parse_timestamp_accepts_seconds_ms_and_iso(
    value: object, unit: int, expected: int
) -> None:
    assert parse_timestamp(value, unit) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", r.MISSING_FIELD),
        (None, r.MISSING_FIELD),
        (float("nan"), r.MISSING_FIELD),
        ("yesterday", r.BAD_TIMESTAMP),
        ("inf", r.BAD_TIMESTAMP),
        ("-5", r.BAD_TIMESTAMP),
        (True, r.BAD_TIMESTAMP),
        ([1], r.BAD_TIMESTAMP),
    ],
)
def test_parse_timestamp_rejects(value: object, reason: str) -> None:
    assert reason_of(parse_timestamp, value) == reason


def test_parse_weight() -> None:
    assert parse_weight("4") == 4.0
    assert parse_weight(2) == 2.0
    assert parse_weight(None) == parse_weight("") == parse_weight(float("nan")) == 1.0
    assert reason_of(parse_weight, "four") == r.BAD_WEIGHT
    assert reason_of(parse_weight, "inf") == r.BAD_WEIGHT


def test_parse_id() -> None:
    assert parse_id(" u1 ") == "u1"
    assert parse_id(7) == "7"
    assert parse_id(7.0) == "7"  # pandas turns int columns with nulls into floats
    assert parse_id(b"i9") == "i9"
    assert parse_id("é") == "é"
    assert reason_of(parse_id, "  ") == r.MISSING_FIELD
    assert reason_of(parse_id, None) == r.MISSING_FIELD
    assert reason_of(parse_id, float("nan")) == r.MISSING_FIELD
    assert reason_of(parse_id, "a\nb") == r.BAD_ID


def test_validate_names_the_first_bad_field_and_the_cutoff() -> None:
    cutoff = DAY + 86400
    row = ("f.csv", 3, ("u1", "i1", str(DAY), "2.5"), "u1,i1,...")
    assert validate(row, cutoff) == ("u1", (DAY, "i1", "f.csv", 3, 2.5, "u1,i1,..."))
    bad_item = ("f.csv", 4, ("u1", "", "bad", "x"), "raw")
    assert validate(bad_item, cutoff) == r.rejection("f.csv", 4, "item_id", r.MISSING_FIELD, "raw")
    late = ("f.csv", 5, ("u1", "i1", str(cutoff), None), "raw")
    assert validate(late, cutoff)["reason"] == r.AFTER_RUN_DATE
    just_in = ("f.csv", 6, ("u1", "i1", str(cutoff - 1), None), "raw")
    assert validate(just_in, cutoff)[1][4] == 1.0


# --- split, dedupe, vocab order --------------------------------------------------------------


def test_split_names_leave_last_out() -> None:
    assert split_names(5, 5) == ["train", "train", "train", "validation", "test"]
    assert split_names(4, 5) == ["train"] * 4
    assert split_names(3, 3) == ["train", "validation", "test"]


def test_dedupe_keeps_the_first_row_by_file_then_row() -> None:
    events = sorted(
        [
            (10, "i1", "b.csv", 2, 1.0, "late file"),
            (10, "i1", "a.csv", 9, 1.0, "first"),
            (10, "i1", "a.csv", 12, 1.0, "later row"),
            (10, "i2", "a.csv", 3, 1.0, "other item"),
        ]
    )
    kept, dups = dedupe(events)
    assert [e[5] for e in kept] == ["first", "other item"]
    assert sorted((d["file"], d["row"], d["reason"]) for d in dups) == [
        ("a.csv", 12, "duplicate"),
        ("b.csv", 2, "duplicate"),
    ]


def test_ranked_orders_by_count_then_id() -> None:
    assert ranked([("b", 2), ("c", 5), ("a", 2), ("10", 2)]) == [
        ("c", 5),
        ("10", 2),
        ("a", 2),
        ("b", 2),
    ]


# --- input listing ---------------------------------------------------------------------------


def test_list_input_files(tmp_path: Path) -> None:
    for name in ("b.csv", "a.csv", "_SUCCESS", ".a.csv.crc"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "sub").mkdir()
    names = [Path(f.path).name for f in list_input_files(tmp_path, "csv")]
    assert names == ["a.csv", "b.csv"]
    assert [Path(f.path).name for f in list_input_files(tmp_path / "b*", "csv")] == ["b.csv"]
    single = tmp_path / "a.csv"
    assert list_input_files(single, "csv") == [InputFile(str(single.resolve()), 2)]


def test_missing_inputs_raise_data_error_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nowhere\.csv"):
        list_input_files(tmp_path / "nowhere.csv", "csv")
    with pytest.raises(DataError, match=r"no input files in .*\*\.parquet"):
        list_input_files(tmp_path / "*.parquet", "parquet")
    with pytest.raises(DataError, match=r"u\.data"):
        list_input_files(tmp_path, "movielens-100k")


# --- readers ---------------------------------------------------------------------------------


def test_read_spec_per_source() -> None:
    ml = read_spec(DataConfig(source="movielens-100k", path="x"))
    assert (ml.delimiter, ml.weight, ml.header) == ("\t", "rating", MOVIELENS_COLUMNS)
    mapped = read_spec(
        DataConfig(source="csv", path="x", delimiter=";", columns={"user_id": "u", "weight": "w"})
    )
    assert (mapped.user, mapped.weight, mapped.weight_required, mapped.delimiter) == (
        "u",
        "w",
        True,
        ";",
    )
    assert read_spec(DataConfig(source="parquet", path="x")).format == "parquet"
    assert read_spec(DataConfig(source="csv", path="x", delimiter="tab")).delimiter == "\t"
    assert read_spec(DataConfig(source="movielens-1m", path="x")).delimiter == "::"
    assert read_spec(DataConfig(source="jsonl", path="x")).format == "jsonl"
    with pytest.raises(ConfigError, match="cannot separate fields"):
        read_spec(DataConfig(source="csv", path="x", delimiter="\n"))


def test_read_delimited_keeps_physical_line_numbers_and_raw_text(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_bytes(
        b"\xef\xbb\xbfuser_id,item_id,timestamp\n"  # BOM, no weight column
        b"u1,i1,100\n"
        b"\n"
        b'u2,"multi\nline",200\n'
        b"u3,\xff\xfe,300\n"
        b"u4,i4\n"
        b"u5,i5,500\r\n"
    )
    f = str(path)
    rest = [
        r.rejection(f, 6, None, r.UNDECODABLE, "u3,\\xff\\xfe,300"),
        r.rejection(f, 7, None, r.WRONG_COLUMN_COUNT, "u4,i4"),
        (f, 8, ("u5", "i5", "500", None), "u5,i5,500"),
    ]
    # Line-oriented (the default): the quote left open costs its own line only.
    assert list(read_delimited(str(path), CSV_SPEC)) == [
        (f, 2, ("u1", "i1", "100", None), "u1,i1,100"),
        r.rejection(f, 4, None, r.UNBALANCED_QUOTE, 'u2,"multi'),
        r.rejection(f, 5, None, r.WRONG_COLUMN_COUNT, 'line",200'),
        *rest,
    ]
    multiline = ReadSpec(**{**CSV_SPEC.__dict__, "multiline": True})
    assert list(read_delimited(str(path), multiline)) == [
        (f, 2, ("u1", "i1", "100", None), "u1,i1,100"),
        (f, 4, ("u2", "multi\nline", "200", None), 'u2,"multi\nline",200'),
        *rest,
    ]


def test_read_delimited_missing_column_rejects_every_row(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_text("user,item_id,timestamp\nu1,i1,1\nu2,i2,2\n")
    out = list(read_delimited(str(path), CSV_SPEC))
    assert [(x["row"], x["field"], x["reason"]) for x in out] == [
        (2, "user_id", r.MISSING_COLUMN),
        (3, "user_id", r.MISSING_COLUMN),
    ]


def test_read_delimited_unreadable_file_is_a_rejection(tmp_path: Path) -> None:
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"\x89PNG\xff\xfe\x00\n\x01\x02\n")
    (rej,) = read_delimited(str(binary), CSV_SPEC)
    assert (rej["row"], rej["reason"]) == (0, r.UNREADABLE_FILE)
    (gone,) = read_delimited(str(tmp_path / "gone.csv"), CSV_SPEC)
    assert gone["reason"] == r.UNREADABLE_FILE and "FileNotFoundError" in gone["raw"]


def test_read_parquet_in_batches_with_row_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("beam_jobs.readers.PARQUET_BATCH_ROWS", 2)
    path = tmp_path / "log.parquet"
    pq.write_table(
        pa.table({"user_id": ["u1", "u2", "u3"], "item_id": [1, 2, 3], "timestamp": [10, 20, 30]}),
        path,
    )
    out = list(read_parquet(str(path), CSV_SPEC))
    assert [(row, values) for _, row, values, _ in out] == [
        (1, ("u1", 1, 10, None)),
        (2, ("u2", 2, 20, None)),
        (3, ("u3", 3, 30, None)),
    ]
    assert json.loads(raw_text(out[2][3])) == {"user_id": "u3", "item_id": 3, "timestamp": 30}


def test_read_parquet_timestamp_columns(tmp_path: Path) -> None:
    path = tmp_path / "typed.parquet"
    when = pa.array([1767571200123], pa.timestamp("ms"))  # naive: UTC
    pq.write_table(pa.table({"user_id": ["u"], "item_id": ["i"], "timestamp": when}), path)
    (row,) = read_parquet(str(path), CSV_SPEC)
    assert parse_timestamp(row[2][2]) == 1767571200
    assert json.loads(raw_text(row[3]))["timestamp"].startswith("2026-01-05 00:00:00")


def test_read_parquet_bad_files_are_rejections(tmp_path: Path) -> None:
    no_user = tmp_path / "no_user.parquet"
    pq.write_table(pa.table({"item_id": ["i1"], "timestamp": [1]}), no_user)
    (rej,) = read_parquet(str(no_user), CSV_SPEC)
    assert (rej["row"], rej["field"], rej["reason"]) == (1, "user_id", r.MISSING_COLUMN)
    assert json.loads(rej["raw"]) == {"item_id": "i1", "timestamp": 1}
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet at all")
    (rej,) = read_parquet(str(corrupt), CSV_SPEC)
    assert (rej["row"], rej["reason"]) == (0, r.UNREADABLE_FILE)


# --- stats and publishing decisions ----------------------------------------------------------


def _stats(**counts: int) -> dict:
    tallies = {"input_rows": 10, "input_lines": 10}
    tallies |= {"split:train": 6, "split:validation": 1, "split:test": 1}
    tallies |= {"rejected:bad_timestamp": 1, "rejected:duplicate": 1}
    tallies |= {"sequences": 3, "sequence_positions": 8, "sequence_length:2-3": 2}
    tallies |= {"sequence_length:4-7": 1} | counts
    files = [InputFile("/data/b.csv", 7), InputFile("/data/a.csv", 5)]
    return assemble_stats(tallies, (1, 9), 3, 4, dt.date(2026, 1, 5), files)


def test_stats_reconcile_and_fingerprint_is_stable() -> None:
    stats = _stats()
    assert stats["rejected"] == 1 and stats["accepted"] == 8 and stats["eval_users"] == 1
    assert stats["rejected_by_reason"] == {"bad_timestamp": 1} and stats["duplicates"] == 1
    check_reconciled(stats)
    assert stats["fingerprint"] == _stats()["fingerprint"] == fingerprint(stats)
    assert stats["fingerprint"] != _stats(**{"split:train": 5, "input_rows": 9})["fingerprint"]
    with pytest.raises(ReconciliationError, match="input_rows=11"):
        check_reconciled(_stats(input_rows=11))
    with pytest.raises(ReconciliationError, match="input_lines=12"):
        check_reconciled(_stats(input_lines=12))
    assert stats["sequences"] == {
        "users": 3,
        "positions": 8,
        "users_by_length": {"2-3": 2, "4-7": 1},
    }
    with pytest.raises(ReconciliationError, match="sequence records hold 7 positions"):
        check_reconciled(_stats(sequence_positions=7))
    with pytest.raises(ReconciliationError, match="of 4 users"):
        check_reconciled(_stats(sequences=4))


def test_quality_failure_messages(tmp_path: Path) -> None:
    stats = _stats(**{"rejected:bad_id": 1, "input_rows": 11, "input_lines": 11})

    def limits(rejected: float, duplicates: float = 0.5) -> PreprocessConfig:
        return PreprocessConfig(max_rejected_fraction=rejected, max_duplicate_fraction=duplicates)

    assert quality_failure(stats, limits(0.2), tmp_path) is None
    error = quality_failure(stats, limits(0.1), tmp_path)
    assert isinstance(error, DataError)
    for part in ("18.18%", "10.00%", "bad_timestamp: 1", str(tmp_path / "rejected")):
        assert part in str(error)
    error = quality_failure(stats, limits(0.2, 0.05), tmp_path)
    assert "1 of 11 input lines are exact duplicates (9.09%)" in str(error)
    empty = assemble_stats({}, (None, None), 0, 0, dt.date(2026, 1, 5), [])
    assert "no usable interactions" in str(quality_failure(empty, limits(0.1), tmp_path))
