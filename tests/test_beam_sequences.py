"""The Beam job's per-user sequence records (`sequences-*.tfrecord.gz`) against the raw log and
the per-row split files: encoding, completeness, order, split codes, determinism and stats."""

from __future__ import annotations

import copy
import datetime as dt
import itertools
import json
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf

from beam_jobs.pipeline import run_preprocess
from beam_jobs.stats import ReconciliationError, check_reconciled
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.layout import SEQUENCES, end_of_day_utc
from recsys.core.schema import (
    HISTORY,
    ITEM_ID,
    ITEM_IDS,
    SEQUENCE_FEATURES,
    SPLIT_CODES,
    SPLITS,
    TIMESTAMP,
    TIMESTAMPS,
    USER_ID,
    decode_example,
    encode_example,
)

RUN_DATE = dt.date(2026, 1, 5)
CUTOFF = end_of_day_utc(RUN_DATE)
HOUR = 3_600
HISTORY_LENGTH = 4


def write_tied_log(path: Path, seed: int = 7) -> Path:
    """A CSV log whose users have several events in one second (ties broken by the item id
    string: "i10" sorts before "i9"), events on each of the last 4 days (several test days
    under the time-window split), exact repeats and one unparsable row."""
    rng = random.Random(seed)
    lines = ["user_id,item_id,timestamp,weight"]
    for u in range(40):
        for _ in range(rng.randint(1, 14)):
            # Whole hours over the last 4 days: many events share a second.
            stamp = CUTOFF - rng.randint(1, 4 * 24 // 6) * 6 * HOUR
            lines.append(f"u{u},i{rng.randint(0, 24)},{stamp},{rng.choice([1, 2])}")
    lines += lines[1:12]  # exact repeats: dropped as duplicates
    lines.append("u1,i3,not-a-time,1")
    path.write_text("\n".join(lines) + "\n")
    return path


def tied_config(log: Path, split: str, shards: int = 1) -> RecsysConfig:
    """The tied log under a split protocol, with short per-row histories."""
    return parse_config(
        {
            "data": {"source": "csv", "path": str(log)},
            "preprocess": {
                "split": split,
                "num_shards": shards,
                "history_length": HISTORY_LENGTH,
                "max_rejected_fraction": 0.1,
            },
        }
    )


def preprocess(tmp: Path, log: Path, split: str, shards: int = 1) -> tuple[Path, dict]:
    """One run of the Beam job on the tied log: (output folder, stats)."""
    out = tmp / f"{split}-{shards}" / "data" / RUN_DATE.isoformat()
    return out, run_preprocess(tied_config(log, split, shards), log, out, RUN_DATE)


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tied_log(tmp_path_factory.mktemp("raw") / "log.csv")


@pytest.fixture(scope="module", params=["leave_last_out", "time_window"])
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, log: Path
) -> dict[int, tuple[Path, dict]]:
    """The tied log under one protocol (`protocol(runs)`), on one shard and on three."""
    tmp = tmp_path_factory.mktemp(request.param)
    return {shards: preprocess(tmp, log, request.param, shards) for shards in (1, 3)}


def protocol(runs: dict[int, tuple[Path, dict]]) -> str:
    """The split protocol of a `runs` fixture (its output folders are named after it)."""
    return runs[1][0].parent.parent.name.rsplit("-", 1)[0]


def raw_records(out: Path) -> list[bytes]:
    """Every sequence record's serialised bytes, file by file."""
    files = sorted(str(p) for p in out.glob(f"{SEQUENCES}-*.tfrecord.gz"))
    return [r.numpy() for f in files for r in tf.data.TFRecordDataset(f, "GZIP")]


def sequences(out: Path) -> list[dict[str, Any]]:
    """Every sequence record, decoded."""
    return [decode_example(r, SEQUENCE_FEATURES) for r in raw_records(out)]


def split_rows(out: Path) -> list[tuple[str, str, int, int, tuple[str, ...]]]:
    """(user, item, timestamp, split code, history) of every per-row example."""
    rows = []
    for code, split in enumerate(SPLITS):
        files = sorted(str(p) for p in out.glob(f"{split}-*.tfrecord.gz"))
        for record in tf.data.TFRecordDataset(files, "GZIP"):
            e = decode_example(record.numpy())
            rows.append((e[USER_ID], e[ITEM_ID], e[TIMESTAMP], code, tuple(e[HISTORY])))
    return rows


def positions(records: list[dict[str, Any]]) -> list[tuple[str, str, int, int]]:
    """(user, item, timestamp, split code) of every position of the records."""
    return [
        (r[USER_ID], item, stamp, code)
        for r in records
        for item, stamp, code in zip(r[ITEM_IDS], r[TIMESTAMPS], r[SPLIT_CODES], strict=True)
    ]


def log_rows(log: Path) -> set[tuple[str, str, int]]:
    """The log's distinct valid (user, item, timestamp) rows, read independently."""
    rows = set()
    for line in log.read_text().splitlines()[1:]:
        user, item, stamp, _ = line.split(",")
        if stamp.isdigit():
            rows.add((user, item, int(stamp)))
    return rows


def test_records_are_the_schema_encoding(runs: dict) -> None:
    for out, _ in runs.values():
        records = raw_records(out)
        assert records
        for data in records:
            assert (
                encode_example(decode_example(data, SEQUENCE_FEATURES), SEQUENCE_FEATURES) == data
            )


def test_every_accepted_row_appears_once_in_protocol_order(runs: dict, log: Path) -> None:
    out, stats = runs[3]
    records = sequences(out)
    users = [r[USER_ID] for r in records]
    assert len(users) == len(set(users))  # one record per user, over all shards
    rows = positions(records)
    assert len(rows) == stats["accepted"] == sum(stats["splits"].values())
    assert Counter((u, i, t) for u, i, t, _ in rows) == Counter(log_rows(log))
    assert stats["duplicates"] > 0 and stats["rejected"] == 1
    ties = 0
    for r in records:
        events = list(zip(r[TIMESTAMPS], r[ITEM_IDS], strict=True))
        assert events == sorted(events)  # (timestamp, item id string)
        ties += sum(a[0] == b[0] for a, b in itertools.pairwise(events))
    assert ties > 10  # the tie order is exercised


def test_split_codes_and_histories_match_the_per_row_files(runs: dict) -> None:
    for out, _ in runs.values():
        records = sequences(out)
        rows = split_rows(out)
        assert Counter(positions(records)) == Counter(row[:4] for row in rows)
        # Each per-row example's history is the record's items before it, cut to length.
        expected = {}
        for r in records:
            for k, (item, stamp) in enumerate(zip(r[ITEM_IDS], r[TIMESTAMPS], strict=True)):
                past = tuple(r[ITEM_IDS][max(0, k - HISTORY_LENGTH) : k])
                expected[(r[USER_ID], item, stamp)] = past
        assert {row[:3]: row[4] for row in rows} == expected


def test_split_codes_follow_the_protocol(runs: dict) -> None:
    records = sequences(runs[1][0])
    test_from, validation_from = CUTOFF - 86_400, CUTOFF - 2 * 86_400
    for r in records:
        codes, stamps = r[SPLIT_CODES], r[TIMESTAMPS]
        if protocol(runs) == "time_window":
            assert codes == [
                2 if t >= test_from else 1 if t >= validation_from else 0 for t in stamps
            ]
        elif len(codes) >= 5:  # preprocess.min_user_interactions
            assert codes == [0] * (len(codes) - 2) + [1, 2]
        else:
            assert codes == [0] * len(codes)
    if protocol(runs) == "time_window":  # users with several test positions are exercised
        assert any(r[SPLIT_CODES].count(2) > 1 for r in records)


def test_records_do_not_depend_on_the_shard_count_or_the_run(
    runs: dict, tmp_path: Path, log: Path
) -> None:
    one, three = (sorted(raw_records(runs[n][0])) for n in (1, 3))
    assert one == three
    out = runs[3][0]
    files = sorted(out.glob(f"{SEQUENCES}-*"))
    assert [p.name for p in files] == [
        f"{SEQUENCES}-{i:05d}-of-00003.tfrecord.gz" for i in range(3)
    ]
    again, _ = preprocess(tmp_path, log, protocol(runs), 3)
    for path in files:
        assert (again / path.name).read_bytes() == path.read_bytes()


def length_bucket(n: int) -> str:
    """Users' length bucket as stats.json names it: 1, 2-3, 4-7, ..."""
    low = 1 << (n.bit_length() - 1)
    return "1" if low == 1 else f"{low}-{2 * low - 1}"


def test_stats_count_the_records_and_reconcile(runs: dict) -> None:
    for out, stats in runs.values():
        records = sequences(out)
        lengths = [len(r[ITEM_IDS]) for r in records]
        counted: dict[str, int] = defaultdict(int)
        for n in lengths:
            counted[length_bucket(n)] += 1
        saved = json.loads((out / "stats.json").read_text())
        assert saved["sequences"] == stats["sequences"]
        assert saved["sequences"] == {
            "users": len(records),
            "positions": sum(lengths),
            "users_by_length": dict(
                sorted(counted.items(), key=lambda kv: int(kv[0].split("-")[0]))
            ),
        }
        check_reconciled(saved)
        for key, change in (("positions", 1), ("users", -1)):
            tampered = copy.deepcopy(saved)
            tampered["sequences"][key] += change
            with pytest.raises(ReconciliationError, match="sequence records"):
                check_reconciled(tampered)
        tampered = copy.deepcopy(saved)
        bucket = next(iter(tampered["sequences"]["users_by_length"]))
        tampered["sequences"]["users_by_length"][bucket] += 1
        with pytest.raises(ReconciliationError, match="sequence records"):
            check_reconciled(tampered)
