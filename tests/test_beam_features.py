"""Features and options of the Beam job: history, item side files, splits, min counts, drift.

Byte-identical output (twice, and under multi_processing) is tested in test_beam_pipeline.py.
"""

import datetime as dt
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from beam_jobs.pipeline import run_preprocess
from beam_jobs.split import histories, window_split_names
from beam_jobs.stats import popularity
from conductor.stages import resolve_input
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.layout import SUCCESS, Workdir, end_of_day_utc
from recsys.core.schema import SPLITS, decode_example
from recsys.synthetic import GENRES, items_path, write_csv, write_items_csv

RUN_DATE = dt.date(2026, 1, 5)
CUTOFF = end_of_day_utc(RUN_DATE)
DAY = 86_400
SYNTHETIC = {"num_users": 60, "num_items": 40, "mean_interactions_per_user": 10, "days": 5,
             "start_date": "2026-01-01"}  # fmt: skip
HISTORY = 3


def examples(out: Path, split: str) -> list[dict[str, Any]]:
    """Every example of a split, decoded, in file order."""
    files = sorted(str(p) for p in out.glob(f"{split}-*.tfrecord.gz"))
    return [decode_example(r.numpy()) for r in tf.data.TFRecordDataset(files, "GZIP")]


def config_with(**preprocess: Any) -> RecsysConfig:
    """A small synthetic config with preprocess settings."""
    return parse_config({"data": {"synthetic": SYNTHETIC}, "preprocess": preprocess})


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, RecsysConfig]:
    """One run through resolve_input (so with the synthetic item file), history length 3."""
    config = config_with(history_length=HISTORY, num_shards=2)
    workdir = Workdir(tmp_path_factory.mktemp("work"))
    config, raw = resolve_input(config, workdir, None)
    out = workdir.data(RUN_DATE)
    return out, run_preprocess(config, raw, out, RUN_DATE), config


# --- history ---------------------------------------------------------------------------------


def test_histories_unit() -> None:
    assert histories(["a", "b", "c", "d"], 2) == [(), ("a",), ("a", "b"), ("b", "c")]
    assert histories(["a", "b"], 0) == [(), ()]


def test_history_has_only_earlier_items_in_protocol_order(synthetic_run: tuple) -> None:
    out, stats, _ = synthetic_run
    by_user: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for split in SPLITS:
        for ex in examples(out, split):
            by_user[ex["user_id"]].append({**ex, "split": split})
    assert sum(map(len, by_user.values())) == stats["accepted"]
    checked_test = 0
    for events in by_user.values():
        events.sort(key=lambda e: (e["timestamp"], e["item_id"]))
        for i, ex in enumerate(events):
            expected = [e["item_id"] for e in events[max(0, i - HISTORY) : i]]
            assert ex["history"] == expected  # oldest first, strictly before, at most 3
            earlier = {(e["timestamp"], e["item_id"]) for e in events[:i]}
            later = [e for e in events[i:] if (e["timestamp"], e["item_id"]) not in earlier]
            # No leakage: nothing at or after this interaction (its own item included).
            assert len(ex["history"]) <= i
            assert all((e["timestamp"], e["item_id"]) < (ex["timestamp"], ex["item_id"])
                       for e in events[:i])  # fmt: skip
            assert later[0] is ex
            if ex["split"] == "test":
                checked_test += 1
                assert ex["history"][-1] == events[i - 1]["item_id"]
                assert events[i - 1]["split"] == "validation"
    assert checked_test == stats["splits"]["test"] > 0


# --- item side file --------------------------------------------------------------------------


def test_synthetic_item_file_is_joined_in_vocab_order(synthetic_run: tuple) -> None:
    out, stats, config = synthetic_run
    assert config.data.items is not None
    assert Path(config.data.items.path or "") == items_path(Path(config.data.path or ""))
    table = pq.read_table(out / "item_features.parquet")
    assert table.schema.names == ["item_id", "train_count", "genres", "title"]
    rows = table.to_pylist()
    assert [r["item_id"] for r in rows] == (out / "vocab" / "items.txt").read_text().split()
    for r in rows:
        assert r["title"] == f"Item {r['item_id'][1:]}"
        assert 1 <= len(r["genres"]) <= 3 and set(r["genres"]) <= set(GENRES)
    assert stats["rejected"] == 0 and (out / SUCCESS).is_file()


def test_csv_item_file_unknown_items_rejected_and_missing_features_empty(tmp_path: Path) -> None:
    log = tmp_path / "log.csv"
    rows = [f"u{u},i{(u + k) % 4},{CUTOFF - DAY + 60 * k}" for u in range(3) for k in range(5)]
    log.write_text("user_id,item_id,timestamp\n" + "\n".join([*rows, f"u0,zz,{CUTOFF - 5}"]) + "\n")
    # Headerless, ';'-separated, columns by index; i3 has no row: empty genres and title.
    side = tmp_path / "items.txt"
    side.write_text("i0;Zero;a,b\ni1;One;\ni2;Two;c\n")
    items = {"path": str(side), "delimiter": ";", "header": False, "id_column": 0,
             "title_column": 1, "genres_column": 2, "genres_separator": ","}  # fmt: skip
    config = parse_config({"data": {"source": "csv", "path": str(log), "items": items},
                           "preprocess": {"max_rejected_fraction": 0.5}})  # fmt: skip
    out = tmp_path / "out"
    stats = run_preprocess(config, log, out, RUN_DATE)
    # Every row of item i3 is unknown too: the file defines the catalog.
    unknown = 1 + sum(r.split(",")[1] == "i3" for r in rows)
    assert stats["rejected_by_reason"] == {"unknown_item": unknown}
    assert stats["input_rows"] == stats["accepted"] + stats["rejected"]
    by_id = {r["item_id"]: r for r in pq.read_table(out / "item_features.parquet").to_pylist()}
    assert by_id["i0"]["genres"] == ["a", "b"] and by_id["i0"]["title"] == "Zero"
    assert by_id["i1"]["genres"] == [] and "i3" not in by_id


def test_item_file_with_a_row_per_attribute_merges_them(tmp_path: Path) -> None:
    """`merge_rows`: item_id,attribute_id rows (as Amazon Beauty's) become one item's genres;
    without it the smallest row of a repeated id is kept."""
    log = tmp_path / "log.csv"
    rows = [f"u{u},{(u + k) % 3},{CUTOFF - DAY + 60 * k}" for u in range(3) for k in range(4)]
    log.write_text("user_id,item_id,timestamp\n" + "\n".join(rows) + "\n")
    side = tmp_path / "item_attributes.csv"
    side.write_text("item_id,attribute_id\n0,17\n0,3\n1,3\n2,9\n2,17\n2,3\n")
    features = {}
    for merge in (True, False):
        items = {"path": str(side), "id_column": "item_id", "genres_column": "attribute_id",
                 "title_column": None, "merge_rows": merge}  # fmt: skip
        config = parse_config({"data": {"source": "csv", "path": str(log), "items": items}})
        out = tmp_path / f"out-{merge}"
        stats = run_preprocess(config, log, out, RUN_DATE)
        assert stats["rejected"] == 0 and stats["accepted"] == len(rows)
        table = pq.read_table(out / "item_features.parquet").to_pylist()
        features[merge] = {r["item_id"]: sorted(r["genres"]) for r in table}
    assert features[True] == {"0": ["17", "3"], "1": ["3"], "2": ["17", "3", "9"]}
    assert features[False] == {"0": ["17"], "1": ["3"], "2": ["17"]}


def test_write_items_csv_roundtrip(tmp_path: Path) -> None:
    synth = config_with().data.synthetic
    path = write_items_csv(synth, tmp_path / "x.items.csv")
    lines = path.read_text().splitlines()
    assert lines[0] == "item_id,title,genres" and len(lines) == synth.num_items + 1


# --- splits, minimum counts, vocabularies ------------------------------------------------------


def test_window_split_names() -> None:
    names = window_split_names([CUTOFF - 3 * DAY, CUTOFF - 2 * DAY, CUTOFF - DAY - 1, CUTOFF - 1],
                               CUTOFF, 1)  # fmt: skip
    assert names == ["train", "validation", "validation", "test"]


def test_time_window_min_counts_and_vocab_min_count(tmp_path: Path) -> None:
    log = tmp_path / "log.csv"
    lines = ["user_id,item_id,timestamp"]
    # u0..u2: days -3..0, items i0..i3; u9 one row (rare user); item solo once (rare item).
    for u in range(3):
        lines += [f"u{u},i{d},{CUTOFF - (4 - d) * DAY + u}" for d in range(4)]
    lines += [f"u9,i0,{CUTOFF - 3 * DAY}", f"u0,solo,{CUTOFF - 3 * DAY + 7}"]
    log.write_text("\n".join(lines) + "\n")
    pre = {"split": "time_window", "eval_days": 1, "min_user_count": 2, "min_item_count": 2,
           "vocab_min_count": 3, "max_rejected_fraction": 0.5}  # fmt: skip
    config = parse_config({"data": {"source": "csv", "path": str(log)}, "preprocess": pre})
    out = tmp_path / "out"
    stats = run_preprocess(config, log, out, RUN_DATE)
    assert stats["rejected_by_reason"] == {"rare_item": 1, "rare_user": 1}
    assert stats["splits"] == {"train": 6, "validation": 3, "test": 3}
    assert {e["item_id"] for e in examples(out, "test")} == {"i3"}
    # i0 and i1 are in train 3 times each (>= 3); users have 2 train rows (< 3): no user vocab.
    assert (out / "vocab" / "items.txt").read_text().split() == ["i0", "i1"]
    assert (out / "vocab" / "users.txt").read_text() == ""
    assert stats["stages"] == {
        "read": 14,
        "parsed": 14,
        "validated": 14,
        "unique": 14,
        "accepted": 12,
    }


# --- stats drift -----------------------------------------------------------------------------


def test_popularity_figures() -> None:
    assert popularity([5, 5, 5, 5]) == {"gini": 0.0, "top_1pct_share": 0.25}
    skewed = popularity([0] * 99 + [100])
    assert skewed["top_1pct_share"] == 1.0 and skewed["gini"] == pytest.approx(0.99)


def test_drift_against_the_previous_run(tmp_path: Path) -> None:
    config = config_with(max_rejected_fraction=0.5)  # the first run rejects the last day
    raw = write_csv(config.data.synthetic, tmp_path / "raw.csv")
    data = tmp_path / "data"
    first = run_preprocess(config, raw, data / "2026-01-04", RUN_DATE - dt.timedelta(days=1))
    second = run_preprocess(config, raw, data / "2026-01-05", RUN_DATE)
    assert first["drift"] is None and 0 < first["popularity"]["gini"] < 1
    drift = second["drift"]
    assert drift["previous_run_date"] == "2026-01-04"
    assert drift["interactions_change"] == pytest.approx(second["accepted"] / first["accepted"] - 1)
    assert 0 <= drift["new_items_share"] < 1
    assert json.loads((data / "2026-01-05" / "stats.json").read_text())["drift"] == drift
