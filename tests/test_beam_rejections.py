"""Bad input rows: each rejection reason, its provenance, and the publish rules around them."""

import datetime as dt
import json
from pathlib import Path

import pytest

from beam_jobs.pipeline import run_preprocess
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.errors import DataError
from recsys.core.layout import SUCCESS, end_of_day_utc

RUN_DATE = dt.date(2026, 1, 5)
T = end_of_day_utc(RUN_DATE) - 86400  # midnight at the start of the run date
HEADER = "user_id,item_id,timestamp,weight"
# (physical line, content, expected reason or None for an accepted row, field)
LINES: list[tuple[str, str | None, str | None]] = [
    (f"u1,i1,{T + 1},5", None, None),
    (f"u1,i2,{T + 2},4", None, None),
    (f"u1,,{T + 3},3", "missing_field", "item_id"),
    ("u1,i3,yesterday,3", "bad_timestamp", "timestamp"),
    (f"u1,i4,{T + 4},lots", "bad_weight", "weight"),
    (f"u1,i1,{T + 1},5", "duplicate", None),
    (f"u1,i5,{T + 86400},1", "after_run_date", "timestamp"),
    (f"u2,i1,{T},1,extra", "wrong_column_count", None),
    ("u1,i6,2026-01-04T10:00:00Z,2", None, None),
    (f"u1,i7,{T - 100},", None, None),
    (f"u1,i8,{T + 86399},1", None, None),  # the last second of the run date is in
    (f"u2,i1,{T},1", None, None),
]
REASONS = {
    (line_no, reason, field)
    for line_no, (_, reason, field) in enumerate(LINES, start=2)
    if reason is not None
}


def bad_csv(folder: Path) -> Path:
    """The hand-written log: header on line 1, then LINES."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bad.csv"
    path.write_text("\n".join([HEADER, *(content for content, _, _ in LINES)]) + "\n")
    return path


def csv_config(max_rejected: float = 0.01) -> RecsysConfig:
    """A CSV config with the given rejection threshold."""
    return parse_config({
        "data": {"source": "csv", "path": "unused"},
        "preprocess": {"max_rejected_fraction": max_rejected},
    })  # fmt: skip


def rejected_records(out: Path) -> list[dict]:
    """Every record of rejected/*.jsonl."""
    lines = []
    for path in sorted((out / "rejected").glob("rejected-*.jsonl")):
        lines += path.read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def tolerant_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """The bad log with a threshold of 100%: published, _SUCCESS and all."""
    base = tmp_path_factory.mktemp("bad")
    path, out = bad_csv(base / "raw"), base / "out"
    return path, out, run_preprocess(csv_config(1.0), path, out, RUN_DATE)


def test_each_reason_with_file_row_and_raw(tolerant_run: tuple[Path, Path, dict]) -> None:
    path, out, _ = tolerant_run
    records = rejected_records(out)
    assert {(r["row"], r["reason"], r["field"]) for r in records} == REASONS
    for record in records:
        assert record["file"] == str(path.resolve())
        assert record["raw"] == LINES[record["row"] - 2][0]
        assert list(record) == ["file", "row", "field", "reason", "raw"]


def test_duplicate_keeps_the_first_row(tolerant_run: tuple[Path, Path, dict]) -> None:
    _, out, _ = tolerant_run
    (dup,) = [r for r in rejected_records(out) if r["reason"] == "duplicate"]
    assert dup["row"] == 7  # line 2 holds the same (u1, i1, T + 1) and is kept


def test_counts_reconcile(tolerant_run: tuple[Path, Path, dict]) -> None:
    _, out, stats = tolerant_run
    assert stats["input_rows"] == len(LINES)
    assert stats["rejected"] == len(REASONS)
    assert stats["input_rows"] == sum(stats["splits"].values()) + stats["rejected"]
    assert stats["rejected_by_reason"] == {reason: 1 for _, reason, _ in REASONS}
    # u1 keeps 5 rows (>= 5): the last two are validation and test; u2's one row is train.
    assert stats["splits"] == {"train": 4, "validation": 1, "test": 1}
    assert stats["max_timestamp"] == T + 86399
    assert (out / SUCCESS).is_file()


def test_too_many_rejections_publish_without_success(tmp_path: Path) -> None:
    path, out = bad_csv(tmp_path / "raw"), tmp_path / "out"
    with pytest.raises(DataError) as info:
        run_preprocess(csv_config(0.25), path, out, RUN_DATE)
    message = str(info.value)
    fraction = len(REASONS) / len(LINES)
    top = "top reasons: after_run_date: 1, bad_timestamp: 1, bad_weight: 1;"  # ties: by name
    for part in (f"{fraction:.2%}", "25.00%", top, str(out / "rejected")):
        assert part in message
    assert not (out / SUCCESS).exists()
    assert len(rejected_records(out)) == len(REASONS)
    assert json.loads((out / "stats.json").read_text())["rejected"] == len(REASONS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "raw"]  # no temp folders


def test_no_accepted_rows_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.csv"
    path.write_text(HEADER + "\n")
    with pytest.raises(DataError, match="no usable interactions in 0 input rows"):
        run_preprocess(csv_config(), path, tmp_path / "out", RUN_DATE)
    assert not (tmp_path / "out" / SUCCESS).exists()
    assert rejected_records(tmp_path / "out") == []


def test_missing_input_raises_before_touching_the_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"absent\.csv"):
        run_preprocess(csv_config(), tmp_path / "absent.csv", out, RUN_DATE)
    assert not out.exists()
