"""Interaction logs are read line by line: a stray quote costs one row, every physical line is
reconciled (input_lines), duplicates are counted apart, blank lines and odd headers are safe."""

import datetime as dt
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beam_jobs.pipeline import run_preprocess
from beam_jobs.readers import LineCount, ReadSpec, read_delimited
from beam_jobs.stats import ReconciliationError, check_reconciled
from recsys.core.config import parse_config
from recsys.core.errors import DataError
from recsys.core.layout import end_of_day_utc
from recsys.data_io import load_split

RUN_DATE = dt.date(2026, 1, 5)
CUTOFF = end_of_day_utc(RUN_DATE)
HEADER = "user_id,item_id,timestamp"
CSV = ReadSpec("delimited", "user_id", "item_id", "timestamp", "weight", False)


def good_lines(n: int, users: int = 40) -> list[str]:
    """n distinct valid interactions, spread over `users` users."""
    return [f"u{k % users},i{k % 97},{CUTOFF - 100_000 + k}" for k in range(n)]


def config(path: Path, **preprocess: object) -> object:
    """A CSV config for `path` with some preprocess settings."""
    return parse_config({"data": {"source": "csv", "path": str(path)}, "preprocess": preprocess})


def test_a_stray_quote_costs_exactly_one_row(tmp_path: Path) -> None:
    # The case, smaller: 5 lines that open a quote and never close it.
    lines = good_lines(600)
    for k in (50, 51, 200, 400, 599):
        lines[k] = '"' + lines[k]
    path = tmp_path / "log.csv"
    path.write_text("\n".join([HEADER, *lines]) + "\n")
    count = LineCount()
    out = list(read_delimited(str(path), CSV, count))
    rejected = [o for o in out if isinstance(o, dict)]
    assert [(o["row"], o["reason"]) for o in rejected] == [
        (k + 2, "unbalanced_quote") for k in (50, 51, 200, 400, 599)
    ]
    assert len(out) == 600 and (count.data, count.header, count.blank) == (600, 1, 0)


def test_quoted_fields_are_still_read(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_text(f'{HEADER}\n"u,1","i""2",{CUTOFF - 5}\nu1,i"3,{CUTOFF - 4}\n')
    rows = list(read_delimited(str(path), CSV))
    assert [r[2][:2] for r in rows] == [("u,1", 'i"2'), ("u1", 'i"3')]


def test_multiline_fields_is_an_opt_in(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_text(f'{HEADER}\nu1,"i\n2",{CUTOFF - 5}\nu1,i3,{CUTOFF - 4}\n')
    spanning = ReadSpec(**{**CSV.__dict__, "multiline": True})
    count = LineCount()
    rows = list(read_delimited(str(path), spanning, count))
    assert [r[1] for r in rows] == [2, 4] and rows[0][2][1] == "i\n2"
    assert (count.data, count.continuation, count.header) == (2, 1, 1)
    # Line by line (the default), the open quote is one rejected line, the next its own row.
    out = list(read_delimited(str(path), CSV))
    reasons = [(o["row"], o["reason"]) for o in out if isinstance(o, dict)]
    assert reasons == [(2, "unbalanced_quote"), (3, "wrong_column_count")] and out[2][1] == 4
    assert parse_config({"data": {"multiline_fields": True}}).data.multiline_fields


def test_blank_lines_before_the_header_are_not_rows(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_text("\n\n" + HEADER + "\n\n" + "\n".join(good_lines(20)) + "\n\n")
    count = LineCount()
    out = list(read_delimited(str(path), CSV, count))
    assert all(isinstance(o, tuple) for o in out) and len(out) == 20
    assert (count.data, count.header, count.blank) == (20, 1, 4)


def test_a_header_naming_a_column_twice_is_an_error_naming_file_and_column(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.csv"
    path.write_text("user_id,item_id,timestamp,item_id\n" + f"u1,i1,{CUTOFF - 5},i2\n")
    with pytest.raises(DataError, match=r"log\.csv.*'item_id' twice"):
        run_preprocess(config(path), path, tmp_path / "out", RUN_DATE)


def test_stats_reconcile_lines_and_count_duplicates_apart(tmp_path: Path) -> None:
    good = good_lines(300)
    lines = [*good[:150], "", '"u1,i1,5', *good[:40], "u9,i9,notatime", "u9,i9,notatime"]
    lines += [*good[150:], ""]
    path = tmp_path / "log.csv"
    path.write_text("\n" + "\n".join([HEADER, *lines]) + "\n")
    # 40 duplicates of 342 lines: neither counts against max_rejected_fraction (3 bad / 342).
    stats = run_preprocess(config(path, max_rejected_fraction=0.01), path, tmp_path / "o", RUN_DATE)
    assert stats["input_lines"] == 343
    assert stats["lines"] == {"header": 1, "blank": 3, "continuation": 0}
    assert (stats["accepted"], stats["duplicates"], stats["rejected"]) == (300, 40, 3)
    assert stats["rejected_by_reason"] == {"bad_timestamp": 2, "unbalanced_quote": 1}
    dead = [
        json.loads(line)
        for f in sorted((tmp_path / "o" / "rejected").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    dups = sorted(d["row"] for d in dead if d["reason"] == "duplicate")
    # Each dropped duplicate is traceable: the file and its physical line.
    assert dups == list(range(155, 195)) and {d["file"] for d in dead} == {str(path)}


def test_duplicates_have_their_own_threshold(tmp_path: Path) -> None:
    good = good_lines(100)
    path = tmp_path / "log.csv"
    path.write_text("\n".join([HEADER, *good, *good[:60]]) + "\n")
    with pytest.raises(DataError, match=r"60 of 160 input lines are exact duplicates.*30\.00%"):
        run_preprocess(config(path, max_duplicate_fraction=0.3), path, tmp_path / "a", RUN_DATE)
    # The default (0.5) lets them through, and they are not rejections.
    stats = run_preprocess(config(path), path, tmp_path / "b", RUN_DATE)
    assert (stats["duplicates"], stats["rejected"], stats["rejected_fraction"]) == (60, 0, 0.0)


def test_a_mismatch_of_lines_fails_the_run_clearly() -> None:
    stats = {
        "input_lines": 10,
        "input_rows": 9,
        "accepted": 7,
        "splits": {"train": 7, "validation": 0, "test": 0},
        "rejected": 1,
        "duplicates": 1,
    }
    with pytest.raises(ReconciliationError, match=r"input_lines=10 .* = 9: 1 line"):
        check_reconciled(stats)


# --- generated logs ------------------------------------------------------------------------

bad_line = st.sampled_from(
    ['"u1,i1,1', "u2,i2", "u3,,5", "u4,i4,yesterday", "u5,i5,1,2", 'x,"y', "u6,i6,9e99"]
)
event = st.tuples(
    st.sampled_from(["stray", "blank", "duplicate", "bad"]), st.integers(0, 10**6), bad_line
)


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(event, max_size=60), n_good=st.integers(20, 120))
def test_generated_logs_reconcile_by_lines_and_every_good_line_reaches_a_split(
    tmp_path_factory: pytest.TempPathFactory, events: list, n_good: int
) -> None:
    tmp = tmp_path_factory.mktemp("gen")
    good = good_lines(n_good, users=7)
    lines = list(good)
    bad = dup = 0
    for kind, where, text in events:
        at = where % (len(lines) + 1)
        if kind == "stray":
            lines.insert(at, '"' + good[where % n_good])
            bad += 1
        elif kind == "blank":
            lines.insert(at, "")
        elif kind == "duplicate":
            # After its original: a duplicate is the later copy.
            original = lines.index(good[where % n_good])
            lines.insert(max(at, original + 1), good[where % n_good])
            dup += 1
        else:
            lines.insert(at, text)
            bad += 1
    path = tmp / "log.csv"
    path.write_text("\n".join(["", HEADER, *lines]) + "\n")
    cfg = config(path, max_rejected_fraction=1.0, max_duplicate_fraction=1.0)
    stats = run_preprocess(cfg, path, tmp / "out", RUN_DATE)
    data_lines = sum(1 for line in lines if line)
    assert stats["input_lines"] == data_lines == stats["input_rows"]
    assert stats["accepted"] + stats["rejected"] + stats["duplicates"] == data_lines
    assert (stats["accepted"], stats["rejected"], stats["duplicates"]) == (n_good, bad, dup)
    seen = set()
    for split in ("train", "validation", "test"):
        got = load_split(tmp / "out", split)
        seen |= {
            (u.decode(), i.decode(), int(t))
            for u, i, t in zip(got["user_id"], got["item_id"], got["timestamp"], strict=True)
        }
    expected = {(u, i, int(t)) for u, i, t in (line.split(",") for line in good)}
    assert seen == expected
