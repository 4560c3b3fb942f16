"""Property-based tests (hypothesis): whatever the readers and validation are given, they never
crash, every row gets a reasoned rejection or becomes an interaction, and the counts reconcile."""

import datetime as dt
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from beam_jobs import records as r
from beam_jobs.pipeline import run_preprocess
from beam_jobs.readers import ReadSpec, read_delimited, read_jsonl
from beam_jobs.validation import validate
from recsys.core.config import parse_config
from recsys.core.errors import DataError
from recsys.core.layout import end_of_day_utc

RUN_DATE = dt.date(2026, 1, 5)
CUTOFF = end_of_day_utc(RUN_DATE)
REASONS = {v for k, v in vars(r).items() if k.isupper() and isinstance(v, str)}
CSV = ReadSpec("delimited", "user_id", "item_id", "timestamp", "weight", False)
JSONL = ReadSpec("jsonl", "user_id", "item_id", "timestamp", "weight", False)
HEADER = b"user_id,item_id,timestamp,weight\n"
FAST = settings(max_examples=15, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip

# Field text without the characters that would merge or split physical lines.
field = st.one_of(
    # No lone surrogates: a UTF-8 file cannot hold them (odd bytes are tested separately).
    st.text(
        alphabet=st.characters(blacklist_characters='\r\n"', blacklist_categories=("Cs",)),
        max_size=12,
    ),
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["", " ", "nan", "inf", "1e400", "2026-01-04T10:00:00Z", "\ufeff", "\x00"]),
)
line = st.lists(field, min_size=0, max_size=6).map(",".join)
encoding = st.sampled_from(["utf-8", "latin-1", "utf-16-le", "cp1252"])


def check_outputs(outputs: list, path: str) -> tuple[list, list]:
    """Split reader outputs into rows and rejections, checking the shape of each."""
    rows, rejections = [], []
    for out in outputs:
        if isinstance(out, dict):
            assert out["reason"] in REASONS and out["file"] == path and out["row"] >= 0
            json.dumps(out)  # a rejection is always writable as a JSON line
            rejections.append(out)
        else:
            assert out[0] == path and len(out[2]) == 4 and isinstance(out[3], str)
            rows.append(out)
    return rows, rejections


def check_validation(rows: list) -> None:
    """Every row validates to an event or a reasoned rejection, never an exception."""
    for row in rows:
        result = validate(row, CUTOFF)
        if isinstance(result, dict):
            assert result["reason"] in REASONS
        else:
            user, (seconds, item, *_rest) = result
            assert user and item and 0 <= seconds < CUTOFF


@FAST
@given(data=st.binary(max_size=300))
@example(data=b"")
@example(data=b"\xff\xfe\x00garbage\n\n,,,\n")
@example(data=b'u1,"unterminated,1\n')
def test_delimited_reader_survives_any_bytes(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "any.csv"
    path.write_bytes(HEADER + data)
    rows, _ = check_outputs(list(read_delimited(str(path), CSV)), str(path))
    check_validation(rows)


@FAST
@given(lines=st.lists(line, max_size=8), enc=encoding)
@example(lines=["u," + "x" * 200_000 + ",1"], enc="utf-8")  # a field over csv's 128 KiB limit
def test_every_nonblank_line_is_one_row_or_one_rejection(
    tmp_path: Path, lines: list[str], enc: str
) -> None:
    path = tmp_path / "log.csv"
    body = b"".join(text.encode(enc, "replace") + b"\n" for text in lines)
    path.write_bytes(HEADER + body)
    outputs = list(read_delimited(str(path), CSV))
    rows, _ = check_outputs(outputs, str(path))
    nonblank = [n for n, raw in enumerate(body.split(b"\n")[:-1], start=2) if raw]
    assert sorted(o[1] if isinstance(o, tuple) else o["row"] for o in outputs) == nonblank
    check_validation(rows)


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
json_line = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "user_id": json_value,
            "item_id": json_value,
            "timestamp": json_value,
            "weight": json_value,
        },
    ).map(json.dumps),
    json_value.map(json.dumps),
    st.text(max_size=20).filter(lambda t: "\n" not in t and "\r" not in t),
)


@FAST
@given(lines=st.lists(json_line, max_size=8))
def test_jsonl_reader_one_output_per_nonblank_line(tmp_path: Path, lines: list[str]) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text("".join(f"{text}\n" for text in lines), encoding="utf-8")
    outputs = list(read_jsonl(str(path), JSONL))
    rows, _ = check_outputs(outputs, str(path))
    nonblank = [n for n, text in enumerate(lines, start=1) if text.strip()]
    assert sorted(o[1] if isinstance(o, tuple) else o["row"] for o in outputs) == nonblank
    check_validation(rows)


@pytest.mark.slow
@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(lines=st.lists(line, max_size=12))
def test_pipeline_counts_reconcile_on_messy_input(tmp_path: Path, lines: list[str]) -> None:
    path = tmp_path / "log.csv"
    good = [f"u{k % 3},i{k % 4},{CUTOFF - 1000 + k}" for k in range(6)]
    path.write_text(HEADER.decode() + "\n".join(good + lines) + "\n", encoding="utf-8")
    config = parse_config({"data": {"source": "csv", "path": str(path)},
                           "preprocess": {"max_rejected_fraction": 1.0}})  # fmt: skip
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    try:
        stats = run_preprocess(config, path, out, RUN_DATE)
    except DataError:
        stats = json.loads((out / "stats.json").read_text())
    assert stats["input_rows"] == sum(stats["splits"].values()) + stats["rejected"]
    written = sum(1 for f in (out / "rejected").glob("*.jsonl") for _ in f.open())
    assert written == stats["rejected"]
