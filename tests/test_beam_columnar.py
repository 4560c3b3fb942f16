"""The batched (columnar) paths of the Beam job against their per-row references.

- beam_jobs.examples encodes byte-identically to recsys.core.schema.encode_example, framed as Beam's
  TFRecord writer does;
- beam_jobs.split.split_shard gives the same rows, splits, histories and rejections as the
  per-user reference split_user;
- Parquet record batches validated column-wise accept and reject exactly what the per-row
  validate does;
- the timestamp lower bound and the user side file, end to end.
"""

import datetime as dt
import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.io.tfrecordio import _TFRecordUtil
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from beam_jobs import columnar as col
from beam_jobs.examples import encode_rows, frame_records, gather_lists, history_pieces
from beam_jobs.pipeline import run_preprocess
from beam_jobs.readers import Bounds, ReadSpec, read_batches, read_parquet
from beam_jobs.split import SplitSettings, split_shard, split_user
from beam_jobs.validation import validate
from recsys.core.config import parse_config
from recsys.core.layout import SUCCESS, end_of_day_utc
from recsys.core.schema import SPLITS, encode_example

RUN_DATE = dt.date(2026, 1, 5)
CUTOFF = end_of_day_utc(RUN_DATE)
DAY = 86_400
SPEC = ReadSpec("parquet", "user_id", "item_id", "timestamp", "weight", False)
FAST = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip

ids = st.text(min_size=1, max_size=40) | st.text("ab", min_size=1, max_size=3)
record = st.fixed_dictionaries(
    {
        "user_id": ids,
        "item_id": ids | st.text(min_size=130, max_size=300),  # 2-byte length varints
        "timestamp": st.integers(-(2**63), 2**63 - 1),
        "weight": st.floats(allow_nan=False, allow_infinity=False) | st.just(1e300),
        "history": st.lists(ids, max_size=25),
    }
)


# --- encoding --------------------------------------------------------------------------------


@FAST
@given(rows=st.lists(record, max_size=20))
@example(rows=[{"user_id": "u", "item_id": "i", "timestamp": 0, "weight": 1.0, "history": []}])
def test_batched_examples_are_byte_identical_to_encode_example(rows: list[dict]) -> None:
    assert encode_rows(rows) == [encode_example(row) for row in rows]


def test_framing_matches_beams_tfrecord_writer() -> None:
    rows = [{"user_id": f"u{k}", "item_id": "i", "timestamp": k, "weight": 0.5,
             "history": ["x"] * (k % 40)} for k in range(300)]  # fmt: skip
    serialised = [encode_example(row) for row in rows]
    expected = io.BytesIO()
    for data in serialised:
        _TFRecordUtil.write_record(expected, data)
    framed = frame_records(pa.array(serialised, pa.large_binary()))
    assert bytes(framed) == expected.getvalue()
    # A slice (non-zero array offset) frames just its rows.
    part = frame_records(pa.array(serialised, pa.large_binary()).slice(7, 5))
    expected_part = io.BytesIO()
    for data in serialised[7:12]:
        _TFRecordUtil.write_record(expected_part, data)
    assert bytes(part) == expected_part.getvalue()


def test_history_windows_overlap_and_long_values() -> None:
    items = pa.array(["a", "bb", "c" * 20, "d", "é" * 9])
    starts, stops = np.array([0, 0, 1, 2, 4, 5]), np.array([0, 1, 3, 5, 5, 5])
    got = gather_lists(history_pieces(items), starts, stops).to_pylist()
    values = items.to_pylist()
    expected = [
        b"".join(bytes([0x0A, len(v.encode())]) + v.encode() for v in values[a:b])
        for a, b in zip(starts, stops, strict=True)
    ]
    assert got == expected


# --- split_shard against split_user ------------------------------------------------------------

event = st.tuples(
    st.sampled_from(["u1", "u2", "ü3", "u10"]),
    st.integers(0, 6).map(lambda day: day * DAY),  # few values: ties and duplicates are common
    st.sampled_from(["i1", "i2", "i10", "j"]),
    st.integers(0, 1),  # file
    st.integers(1, 30),  # row
)
split_settings = st.builds(
    SplitSettings,
    min_interactions=st.integers(3, 6),
    history_length=st.integers(0, 4),
    protocol=st.sampled_from(["leave_last_out", "time_window"]),
    cutoff=st.just(7 * DAY),
    eval_days=st.integers(1, 2),
    min_user_count=st.integers(0, 4),
    min_item_count=st.integers(0, 3),
)


def _table(events: list[tuple[str, int, str, int, int]]) -> pa.Table:
    columns = list(zip(*events, strict=True)) if events else [[]] * 5
    users, stamps, items, files, rows = (list(c) for c in columns)
    return pa.Table.from_batches(
        [
            pa.record_batch(
                [
                    pa.array(users, pa.string()),
                    pa.array(items, pa.string()),
                    pa.array(stamps, pa.int64()),
                    pa.array([1.0 + k for k in range(len(users))], pa.float64()),
                    pa.array(files, pa.int32()),
                    pa.array(rows, pa.int64()),
                    pa.array([f"raw{k}" for k in range(len(users))], pa.string()),
                ],
                schema=col.ROW_SCHEMA,
            )
        ]
    )


@settings(max_examples=150, deadline=None)
@given(events=st.lists(event, max_size=40, unique_by=lambda e: (e[3], e[4])), s=split_settings)
def test_split_shard_matches_the_per_user_reference(events: list, s: SplitSettings) -> None:
    files = ["a.csv", "b.csv"]
    table = _table(events)
    # Distinct (user, time, item) per item, as the pipeline's first pass counts them.
    distinct = {(u, t, i) for u, t, i, _, _ in events}
    counts: dict[str, int] = defaultdict(int)
    for _, _, item in distinct:
        counts[item] += 1
    count_table = pa.table({"id": list(counts), "count": list(counts.values())})
    got = split_shard(table, s, files, count_table)
    # The reference, user by user in id order.
    weights = table.column(col.WEIGHT).to_pylist()
    raws = table.column(col.RAW).to_pylist()
    by_user: dict[str, list] = defaultdict(list)
    for k, (u, t, i, f, row) in enumerate(events):
        by_user[u].append((t, i, files[f], row, weights[k], raws[k]))
    expected_rows, expected_rejected = [], []
    for user in sorted(by_user):
        rows, rejected = split_user(user, by_user[user], s, counts)
        expected_rejected += rejected
        per_user = [(name, *row) for name in SPLITS for row in rows[name]]
        expected_rows += sorted(per_user, key=lambda x: (x[3], x[2]))  # time, item order
    items = got.rows.column(col.ITEM).to_pylist()
    got_rows = [
        (SPLITS[code], user, item, ts, w, tuple(items[start:k]))
        for k, (code, user, item, ts, w, start) in enumerate(
            zip(
                got.split,
                got.rows.column(col.USER).to_pylist(),
                items,
                got.rows.column(col.TS).to_pylist(),
                got.rows.column(col.WEIGHT).to_pylist(),
                got.history_start,
                strict=True,
            )
        )
    ]
    assert got_rows == expected_rows
    key = lambda rej: (rej["file"], rej["row"])  # noqa: E731
    assert sorted(got.rejected, key=key) == sorted(expected_rejected, key=key)


# --- Parquet: column-wise validation == per-row validation ----------------------------------


def _per_row(path: str, bounds: Bounds) -> tuple[set, set]:
    accepted, rejected = set(), set()
    for out in read_parquet(path, SPEC):
        result = out if isinstance(out, dict) else validate(out, *bounds_args(bounds))
        if isinstance(result, dict):
            rejected.add((result["row"], result["field"], result["reason"], result["raw"]))
        else:
            user, (ts, item, _, row, weight, _) = result
            accepted.add((user, item, ts, weight, row))
    return accepted, rejected


def bounds_args(bounds: Bounds) -> tuple[int, int, int]:
    """validate()'s (cutoff, unit divisor, floor)."""
    return bounds.cutoff, bounds.divisor, bounds.floor


def _batched(path: str, bounds: Bounds) -> tuple[set, set]:
    accepted, rejected = set(), set()
    for out in read_batches(path, 0, SPEC, bounds):
        if isinstance(out, dict):
            rejected.add((out["row"], out["field"], out["reason"], out["raw"]))
            continue
        for row in out.to_pylist():
            accepted.add((row["user"], row["item"], row["timestamp"], row["weight"], row["row"]))
    return accepted, rejected


value_sets = {
    "user_id": st.sampled_from(["u1", " u2 ", "", None, "a\nb", "é", "u 3"]),
    "item_id": st.sampled_from([1, 2, -3, None]),
    "timestamp": st.sampled_from([CUTOFF - 5, CUTOFF, -1, None, CUTOFF - 10 * DAY, 0]),
    "weight": st.sampled_from([1.0, 2.5, float("nan"), float("inf"), None, -1.0]),
}


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(rows=st.lists(st.fixed_dictionaries(value_sets), min_size=1, max_size=30),
       floor=st.sampled_from([0, CUTOFF - 2 * DAY]))  # fmt: skip
def test_parquet_batches_accept_and_reject_exactly_like_validate(
    tmp_path: Path, rows: list[dict], floor: int
) -> None:
    path = tmp_path / "log.parquet"
    table = pa.table(
        {
            "user_id": pa.array([x["user_id"] for x in rows], pa.string()),
            "item_id": pa.array([x["item_id"] for x in rows], pa.int64()),
            "timestamp": pa.array([x["timestamp"] for x in rows], pa.int64()),
            "weight": pa.array([x["weight"] for x in rows], pa.float64()),
        }
    )
    pq.write_table(table, path)
    bounds = Bounds(CUTOFF, floor)
    batched, per_row = _batched(str(path), bounds), _per_row(str(path), bounds)
    assert batched[0] == per_row[0]
    assert batched[1] == per_row[1]


def test_parquet_typed_and_odd_columns_take_the_exact_path(tmp_path: Path) -> None:
    path = tmp_path / "typed.parquet"
    when = pa.array([1767571200123, None, 1767571200999], pa.timestamp("ms"))
    table = pa.table(
        {
            "user_id": pa.array([7.0, 8.5, float("nan")]),  # float ids: per-row rules
            "item_id": ["i", "i", "i"],
            "timestamp": when,
            "weight": pa.array([True, False, True]),  # booleans are bad weights
        }
    )
    pq.write_table(table, path)
    bounds = Bounds(CUTOFF)
    assert _batched(str(path), bounds) == _per_row(str(path), bounds)


# --- end to end: lower timestamp bound, user side file, raw read back ------------------------


def _events_csv(path: Path) -> list[str]:
    rows = [f"u{u},i{k},{CUTOFF - (6 - k) * DAY + u}" for u in range(3) for k in range(6)]
    rows += [f"u1,i9,{CUTOFF - 30 * DAY}"]  # older than any bound below
    path.write_text("user_id,item_id,timestamp\n" + "\n".join(rows) + "\n")
    return rows


@pytest.mark.parametrize(
    ("bound", "rejected"),
    [({"min_timestamp": "2025-12-31"}, 1), ({"max_age_days": 3}, 1 + 3 * 3),
     ({"min_timestamp": int(CUTOFF - 2 * DAY)}, 1 + 3 * 4)],
)  # fmt: skip
def test_timestamp_lower_bound_rejects_old_rows(
    tmp_path: Path, bound: dict[str, Any], rejected: int
) -> None:
    log = tmp_path / "log.csv"
    _events_csv(log)
    config = parse_config({"data": {"source": "csv", "path": str(log)},
                           "preprocess": {"max_rejected_fraction": 1.0, **bound}})  # fmt: skip
    out = tmp_path / "out"
    stats = run_preprocess(config, log, out, RUN_DATE)
    assert stats["rejected_by_reason"] == {"before_min_timestamp": rejected}
    assert stats["input_rows"] == stats["accepted"] + stats["rejected"] == 19
    assert stats["stages"]["validated"] == 19 - rejected
    records = [json.loads(line) for p in (out / "rejected").glob("*.jsonl") for line in p.open()]
    assert {(x["reason"], x["field"]) for x in records} == {("before_min_timestamp", "timestamp")}
    assert f"u1,i9,{CUTOFF - 30 * DAY}" in {x["raw"] for x in records}


def test_bad_min_timestamp_is_a_config_error(tmp_path: Path) -> None:
    log = tmp_path / "log.csv"
    _events_csv(log)
    config = parse_config({"data": {"source": "csv", "path": str(log)},
                           "preprocess": {"min_timestamp": "last tuesday"}})  # fmt: skip
    with pytest.raises(Exception, match="min_timestamp"):
        run_preprocess(config, log, tmp_path / "out", RUN_DATE)


def test_movielens_user_file_joined_in_vocab_order(tmp_path: Path) -> None:
    folder = tmp_path / "ml-100k"
    folder.mkdir()
    t = CUTOFF - DAY
    lines = [f"{u}\t{i}\t3\t{t + 60 * i + u}" for u in (1, 2, 3) for i in range(1, 7 - u)]
    (folder / "u.data").write_text("\n".join(lines) + "\n")
    (folder / "u.user").write_bytes(
        "1|24|M|technician|85711\n2|53|F|other|94043\n9|30|M|writer|Café\n".encode("latin-1")
    )
    config = parse_config({"data": {"source": "movielens-100k", "path": str(folder)}})
    out = tmp_path / "out"
    run_preprocess(config, folder, out, RUN_DATE)
    features = pq.read_table(out / "user_features.parquet")
    assert features.column_names == ["user_id", "age", "gender", "occupation", "zip_code"]
    users = (out / "vocab" / "users.txt").read_text().split()
    assert features["user_id"].to_pylist() == users == ["2", "1", "3"]  # train count order
    by_user = {row["user_id"]: row for row in features.to_pylist()}
    assert by_user["1"] == {"user_id": "1", "age": "24", "gender": "M",
                            "occupation": "technician", "zip_code": "85711"}  # fmt: skip
    assert by_user["3"]["age"] is None  # no row in u.user: nulls, not a rejection
    assert (out / SUCCESS).is_file()


def test_csv_user_file_with_chosen_columns(tmp_path: Path) -> None:
    log = tmp_path / "log.csv"
    _events_csv(log)
    side = tmp_path / "users.tsv"
    side.write_text("id\tsegment\tcountry\tignored\nu0\tgold\tFR\tx\nu2\tsilver\t\tx\n")
    users = {"path": str(side), "delimiter": "tab", "id_column": "id",
             "columns": ["segment", "country"]}  # fmt: skip
    config = parse_config({"data": {"source": "csv", "path": str(log), "users": users},
                           "preprocess": {"max_rejected_fraction": 1.0}})  # fmt: skip
    out = tmp_path / "out"
    run_preprocess(config, log, out, RUN_DATE)
    rows = {x["user_id"]: x for x in pq.read_table(out / "user_features.parquet").to_pylist()}
    assert rows["u0"] == {"user_id": "u0", "segment": "gold", "country": "FR"}
    assert rows["u2"] == {"user_id": "u2", "segment": "silver", "country": None}
    assert rows["u1"] == {"user_id": "u1", "segment": None, "country": None}


def test_parquet_split_stage_rejections_get_their_raw_values_back(tmp_path: Path) -> None:
    path = tmp_path / "log.parquet"
    users = ["u1"] * 6 + ["u2"]
    items = [1, 2, 3, 1, 4, 5, 1]
    stamps = [CUTOFF - 100 + k for k in range(3)] + [CUTOFF - 100] + [CUTOFF - 50, CUTOFF - 40]
    stamps += [CUTOFF - 10]
    pq.write_table(pa.table({"user_id": users, "item_id": items, "timestamp": stamps,
                             "extra": ["x"] * 7}), path, row_group_size=2)  # fmt: skip
    items_file = tmp_path / "items.csv"
    items_file.write_text("item_id\n1\n2\n3\n4\n")
    config = parse_config({"data": {"source": "parquet", "path": str(path),
                                    "items": {"path": str(items_file)}},
                           "preprocess": {"max_rejected_fraction": 1.0}})  # fmt: skip
    out = tmp_path / "out"
    stats = run_preprocess(config, path, out, RUN_DATE)
    lines = [json.loads(line) for p in (out / "rejected").glob("*.jsonl") for line in p.open()]
    records = {(x["row"], x["reason"]): json.loads(x["raw"]) for x in lines}
    assert records == {
        (4, "duplicate"): {"user_id": "u1", "item_id": 1, "timestamp": CUTOFF - 100},
        (6, "unknown_item"): {"user_id": "u1", "item_id": 5, "timestamp": CUTOFF - 40},
    }
    assert stats["input_rows"] == 7 == stats["accepted"] + stats["rejected"] + stats["duplicates"]


def test_big_shards_in_several_passes_give_the_same_examples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tensorflow as tf

    from recsys.core.schema import decode_example

    log = tmp_path / "log.csv"
    rows = [f"u{u},i{(u * k) % 7},{CUTOFF - DAY + 60 * k + u}" for u in range(40) for k in range(6)]
    rows += rows[:5]  # duplicates
    log.write_text("user_id,item_id,timestamp\n" + "\n".join(rows) + "\n")
    config = parse_config({"data": {"source": "csv", "path": str(log)},
                           "preprocess": {"history_length": 3, "min_item_count": 2,
                                          "max_rejected_fraction": 1.0}})  # fmt: skip

    def examples(out: Path) -> dict[str, list]:
        decoded = {}
        for split in SPLITS:
            files = sorted(str(p) for p in out.glob(f"{split}-*.tfrecord.gz"))
            records = tf.data.TFRecordDataset(files, compression_type="GZIP")
            decoded[split] = sorted(json.dumps(decode_example(x.numpy())) for x in records)
        return decoded

    one = run_preprocess(config, log, tmp_path / "one", RUN_DATE)
    monkeypatch.setattr("beam_jobs.split.PASS_ROWS", 30)  # ~8 passes over the shard
    many = run_preprocess(config, log, tmp_path / "many", RUN_DATE)
    assert one["fingerprint"] == many["fingerprint"]
    assert one["duplicates"] == 5
    assert examples(tmp_path / "one") == examples(tmp_path / "many")
    # Passes did happen: users come by bucket range, then id, so the file order differs.
    name = "train-00000-of-00001.tfrecord.gz"
    assert (tmp_path / "one" / name).read_bytes() != (tmp_path / "many" / name).read_bytes()
    for name in ("vocab/users.txt", "vocab/items.txt", "item_features.parquet"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "many" / name).read_bytes()


def test_beam_shuffle_gives_the_same_bytes_as_the_files_shuffle(tmp_path: Path) -> None:
    log = tmp_path / "log.parquet"
    users = [f"u{k % 23}" for k in range(400)]
    stamps = [CUTOFF - 5000 + k for k in range(400)]
    items = [k % 17 for k in range(400)]
    pq.write_table(pa.table({"user_id": users, "item_id": items, "timestamp": stamps}), log)
    outputs = {}
    for mode in ("files", "beam"):
        config = parse_config({"data": {"source": "parquet", "path": str(log)},
                               "preprocess": {"num_shards": 3, "shuffle": mode}})  # fmt: skip
        out = tmp_path / mode
        run_preprocess(config, log, out, RUN_DATE)
        assert not (out / "_shuffle").exists()  # spill files are gone before publishing
        outputs[mode] = {
            str(p.relative_to(out)): p.read_bytes()
            for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in ("stats.json", SUCCESS)
        }
    assert sum(name.endswith(".tfrecord.gz") for name in outputs["files"]) == 12
    assert outputs["files"] == outputs["beam"]


def test_shards_and_buckets_follow_crc32_of_the_user_id() -> None:
    from beam_jobs.sinks import shard_of

    users = ["u1", "é", "u1", "x" * 300, "u2", "😀"]
    batch = col.event_batch(users, ["i"] * 6, [1] * 6, [1.0] * 6, 0, list(range(1, 7)), [None] * 6)
    seen = {}
    for shard, part in col.by_shard(batch, 3):
        for user, bucket in zip(part.column(col.USER).to_pylist(),
                                part.column(col.BUCKET).to_pylist(), strict=True):  # fmt: skip
            assert shard == shard_of(user, 3)
            seen[user] = bucket
    assert len(seen) == 5 and sum(1 for _ in col.by_shard(batch, 3)) <= 3
    assert all(0 <= b < col.BUCKETS for b in seen.values())
