"""End-to-end runs of the Beam preprocessing job on the synthetic log (and the real ml-100k)."""

import csv
import datetime as dt
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from beam_jobs.pipeline import PIPELINE_SECONDS, run_preprocess
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.layout import SEQUENCES, SUCCESS
from recsys.core.schema import SPLITS, feature_spec
from recsys.synthetic import write_csv

SHARDS = 2
# Like conftest's SMALL log (which module-scoped fixtures cannot share): 150 users, 5 days.
SYNTHETIC = {"num_users": 150, "num_items": 80, "mean_interactions_per_user": 12, "days": 5,
             "start_date": "2026-01-01"}  # fmt: skip
Row = tuple[str, str, int, float]


def last_day(config: RecsysConfig) -> dt.date:
    """The last day of a config's synthetic log: the run date that includes all of it."""
    synthetic = config.data.synthetic
    return dt.date.fromisoformat(synthetic.start_date) + dt.timedelta(days=synthetic.days - 1)


@pytest.fixture(scope="module")
def config() -> RecsysConfig:
    """A small synthetic log, two shards per split."""
    return parse_config({"data": {"synthetic": SYNTHETIC}, "preprocess": {"num_shards": SHARDS}})


@pytest.fixture(scope="module")
def raw_csv(tmp_path_factory: pytest.TempPathFactory, config: RecsysConfig) -> Path:
    """The synthetic log as CSV, shared by the module."""
    return write_csv(config.data.synthetic, tmp_path_factory.mktemp("raw") / "interactions.csv")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, config: RecsysConfig, raw_csv: Path) -> tuple:
    """One pipeline run shared by the tests below: (output folder, returned stats)."""
    out = tmp_path_factory.mktemp("work") / "data" / "run"
    return out, run_preprocess(config, raw_csv, out, last_day(config))


def read_csv_rows(path: Path) -> list[Row]:
    """The raw log, typed, straight from the CSV (the reference the pipeline is checked against)."""
    with path.open(newline="") as fh:
        return [(r["user_id"], r["item_id"], int(r["timestamp"]), float(r["weight"]))
                for r in csv.DictReader(fh)]  # fmt: skip


def expected_splits(rows: list[Row], min_interactions: int) -> dict[str, set[Row]]:
    """The protocol (docs/PROTOCOL.md), written independently: per user sort by (time, item)."""
    by_user: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_user[row[0]].append(row)
    splits: dict[str, set[Row]] = {name: set() for name in SPLITS}
    for events in by_user.values():
        events.sort(key=lambda e: (e[2], e[1]))
        if len(events) >= min_interactions:
            splits["test"].add(events[-1])
            splits["validation"].add(events[-2])
            events = events[:-2]
        splits["train"].update(events)
    return splits


def parsed_split(out: Path, split: str) -> dict[str, tf.Tensor]:
    """A split's TFRecords parsed the way the trainer does: batch, then tf.io.parse_example."""
    files = sorted(str(p) for p in out.glob(f"{split}-*.tfrecord.gz"))
    ds = tf.data.TFRecordDataset(files, compression_type="GZIP").batch(1_000_000)
    return tf.io.parse_example(next(iter(ds)), feature_spec())


def split_rows(out: Path, split: str) -> set[Row]:
    """A split's examples as (user, item, timestamp, weight) tuples."""
    parsed = parsed_split(out, split)
    columns = [parsed[name].numpy().tolist() for name in ("user_id", "item_id", "timestamp")]
    weights = parsed["weight"].numpy().tolist()
    return {(u.decode(), i.decode(), t, w) for u, i, t, w in zip(*columns, weights, strict=True)}


def output_bytes(out: Path) -> dict[str, bytes]:
    """Every data file's bytes (stats.json holds paths, _SUCCESS nothing)."""
    skip = {"stats.json", SUCCESS}
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def test_output_layout_and_shards(run: tuple) -> None:
    out, _ = run
    names = {p.name for p in out.iterdir()}
    shards = {
        f"{s}-{i:05d}-of-{SHARDS:05d}.tfrecord.gz"
        for s in (*SPLITS, SEQUENCES)
        for i in range(SHARDS)
    }
    assert names == shards | {"vocab", "rejected", "item_features.parquet", "stats.json", SUCCESS}
    assert sorted(p.name for p in (out / "vocab").iterdir()) == ["items.txt", "users.txt"]
    rejected = [f"rejected-{i:05d}-of-{SHARDS:05d}.jsonl" for i in range(SHARDS)]
    assert sorted(p.name for p in (out / "rejected").iterdir()) == rejected
    assert all((out / "rejected" / name).read_text() == "" for name in rejected)
    # Nothing left behind: no temporary sibling folders, no Beam temp folders.
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    newest = max(p.stat().st_mtime_ns for p in out.rglob("*") if p.name != SUCCESS)
    assert (out / SUCCESS).stat().st_mtime_ns >= newest


def test_stats_reconcile_with_the_raw_log(run: tuple, raw_csv: Path, config: RecsysConfig) -> None:
    out, stats = run
    rows = read_csv_rows(raw_csv)
    # The result is stats.json plus the Beam pipeline's own seconds (what rows/s divides).
    stats = dict(stats)
    assert stats.pop(PIPELINE_SECONDS) > 0
    assert stats == json.loads((out / "stats.json").read_text())
    assert stats["input_rows"] == len(rows) == stats["accepted"]
    assert stats["input_rows"] == sum(stats["splits"].values()) + stats["rejected"]
    assert stats["rejected"] == 0 and stats["rejected_by_reason"] == {}
    users = Counter(r[0] for r in rows)
    eligible = sum(n >= config.preprocess.min_user_interactions for n in users.values())
    assert stats["eval_users"] == stats["splits"]["test"] == stats["splits"]["validation"]
    assert stats["eval_users"] == eligible
    assert 0 < eligible < len(users)  # both kinds of user are exercised
    assert (stats["min_timestamp"], stats["max_timestamp"]) == (
        min(r[2] for r in rows),
        max(r[2] for r in rows),
    )
    assert stats["input_files"] == [
        {"path": str(raw_csv.resolve()), "bytes": raw_csv.stat().st_size}
    ]
    assert stats["run_date"] == "2026-01-05" and len(stats["fingerprint"]) == 64


def test_split_protocol(run: tuple, raw_csv: Path, config: RecsysConfig) -> None:
    out, _ = run
    expected = expected_splits(read_csv_rows(raw_csv), config.preprocess.min_user_interactions)
    for split in SPLITS:
        assert split_rows(out, split) == expected[split], split


def test_tfrecords_parse_with_the_schema(run: tuple) -> None:
    out, stats = run
    parsed = parsed_split(out, "train")
    assert parsed["user_id"].dtype == tf.string and parsed["timestamp"].dtype == tf.int64
    assert parsed["weight"].dtype == tf.float32
    assert parsed["user_id"].shape[0] == stats["splits"]["train"]
    per_shard = [
        sum(1 for _ in tf.data.TFRecordDataset(str(p), compression_type="GZIP"))
        for p in sorted(out.glob("train-*.tfrecord.gz"))
    ]
    assert len(per_shard) == SHARDS and sum(per_shard) == stats["splits"]["train"]


def test_vocab_is_train_only_ordered_by_count_then_id(run: tuple) -> None:
    out, stats = run
    train = split_rows(out, "train")
    for name, column in (("users", 0), ("items", 1)):
        counts = Counter(row[column] for row in train)
        ranking = sorted(counts, key=lambda id_: (-counts[id_], id_))
        assert (out / "vocab" / f"{name}.txt").read_text().splitlines() == ranking
        assert stats[name] == len(ranking)
    features = pq.read_table(out / "item_features.parquet")
    assert features.schema.field("item_id").type == "string"
    assert features.schema.field("train_count").type == "int64"
    items = (out / "vocab" / "items.txt").read_text().splitlines()
    assert features["item_id"].to_pylist() == items
    item_counts = Counter(row[1] for row in train)
    assert features["train_count"].to_pylist() == [item_counts[i] for i in items]


def test_rerun_replaces_the_output_with_the_same_fingerprint(
    small_config: RecsysConfig, small_csv: Path, tmp_path: Path
) -> None:
    out = tmp_path / "data" / "day"
    first = run_preprocess(small_config, small_csv, out, last_day(small_config))
    assert first["rejected"] == 0 and first["accepted"] > 0
    first_bytes = output_bytes(out)
    (out / "stale-file").write_text("from an older run")
    second = run_preprocess(small_config, small_csv, out, last_day(small_config))
    first.pop(PIPELINE_SECONDS), second.pop(PIPELINE_SECONDS)  # timings differ, stats not
    assert second == first
    assert output_bytes(out) == first_bytes  # byte-identical TFRecords, vocab and features
    assert not (out / "stale-file").exists() and (out / SUCCESS).is_file()
    assert [p.name for p in out.parent.iterdir()] == [out.name]


@pytest.mark.slow
def test_multi_processing_runner_gives_the_same_data(
    tmp_path: Path, config: RecsysConfig, raw_csv: Path, run: tuple
) -> None:
    args = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    stats = run_preprocess(config, raw_csv, tmp_path / "mp", last_day(config), beam_args=args)
    assert stats["fingerprint"] == run[1]["fingerprint"]
    tfrecords = output_bytes(run[0])
    assert sum(name.endswith(".tfrecord.gz") for name in tfrecords) == 4 * SHARDS
    assert output_bytes(tmp_path / "mp") == tfrecords


@pytest.mark.slow
@pytest.mark.movielens
def test_movielens_100k(ml100k: Path, tmp_path: Path) -> None:
    config = parse_config({"data": {"source": "movielens-100k", "path": str(ml100k)}})
    start = time.perf_counter()
    stats = run_preprocess(config, ml100k, tmp_path / "ml", dt.date(1998, 4, 22))
    seconds = time.perf_counter() - start
    assert stats["input_rows"] == 100_000
    assert stats["input_rows"] == sum(stats["splits"].values()) + stats["rejected"]
    assert stats["rejected"] == 0
    assert stats["eval_users"] == stats["users"] == 943
    assert stats["splits"]["test"] == stats["splits"]["validation"] == 943
    assert (tmp_path / "ml" / SUCCESS).is_file()
    assert seconds < 60, f"ml-100k took {seconds:.1f} s"
