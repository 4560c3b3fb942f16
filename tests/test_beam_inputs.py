"""Each input format through the whole pipeline: Parquet (file, folder), MovieLens u.data, globs."""

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from beam_jobs.pipeline import run_preprocess
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.errors import DataError
from recsys.core.layout import SUCCESS, end_of_day_utc
from recsys.core.schema import decode_example

RUN_DATE = dt.date(2026, 1, 5)
T = end_of_day_utc(RUN_DATE) - 86400
Row = tuple[str, str, int, float]


def config(data: dict[str, Any], **preprocess: Any) -> RecsysConfig:
    """A config for `data` (path filled in) and preprocess settings."""
    return parse_config({"data": {"path": "unused", **data}, "preprocess": preprocess})


def split_rows(out: Path, split: str) -> list[Row]:
    """A split's examples, decoded with recsys.core.schema.decode_example, sorted."""
    files = sorted(str(p) for p in out.glob(f"{split}-*.tfrecord.gz"))
    records = tf.data.TFRecordDataset(files, compression_type="GZIP")
    # (user, item, timestamp, weight): the history feature has its own tests.
    return sorted(tuple(decode_example(r.numpy()).values())[:4] for r in records)  # type: ignore[misc]


def rejected(out: Path) -> list[dict]:
    """Every record of rejected/*.jsonl."""
    return [
        json.loads(line)
        for path in sorted((out / "rejected").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def user_log(user: str, n: int, start: int = 0) -> list[tuple[str, str, int, float]]:
    """n interactions of one user, one a minute from T + start, item ids i0.. ."""
    return [(user, f"i{k}", T + start + 60 * k, float(k % 5 + 1)) for k in range(n)]


def test_parquet_file_with_mapped_columns_and_ms(tmp_path: Path) -> None:
    rows = user_log("u1", 5) + user_log("u2", 2)
    table = pa.table(
        {
            "who": [r[0] for r in rows],
            "what": [int(r[1][1:]) for r in rows],  # integer item ids become strings
            "when_ms": [r[2] * 1000 + 999 for r in rows],
            "stars": [r[3] for r in rows],
            "ignored": ["x"] * len(rows),
        }
    )
    path = tmp_path / "log.parquet"
    pq.write_table(table, path)
    data = {
        "source": "parquet",
        "timestamp_unit": "ms",
        "columns": {"user_id": "who", "item_id": "what", "timestamp": "when_ms", "weight": "stars"},
    }
    stats = run_preprocess(config(data), path, tmp_path / "out", RUN_DATE)
    assert stats["splits"] == {"train": 5, "validation": 1, "test": 1}
    expected = [(u, i[1:], t, w) for u, i, t, w in rows]
    assert split_rows(tmp_path / "out", "test") == [expected[4]]
    assert split_rows(tmp_path / "out", "validation") == [expected[3]]
    assert split_rows(tmp_path / "out", "train") == sorted(expected[:3] + expected[5:])


def test_parquet_folder_of_two_files_rejects_the_later_duplicate(tmp_path: Path) -> None:
    folder = tmp_path / "raw"
    folder.mkdir()
    first = user_log("u1", 6)
    second = [*user_log("u2", 3), first[2], ("u3", "i1", T + 86400, 1.0)]
    for name, rows in (("part-0.parquet", first), ("part-1.parquet", second)):
        pq.write_table(pa.table(dict(zip(["user_id", "item_id", "timestamp", "weight"],
                                         map(list, zip(*rows, strict=True)), strict=True))),
                       folder / name)  # fmt: skip
    (folder / SUCCESS).write_text("")  # a marker from the producer is not input
    out = tmp_path / "out"
    stats = run_preprocess(
        config({"source": "parquet"}, max_rejected_fraction=0.5), folder, out, RUN_DATE
    )
    assert [Path(f["path"]).name for f in stats["input_files"]] == [
        "part-0.parquet",
        "part-1.parquet",
    ]
    assert stats["input_rows"] == 11 == sum(stats["splits"].values()) + stats["rejected"]
    assert {(Path(r["file"]).name, r["row"], r["reason"]) for r in rejected(out)} == {
        ("part-1.parquet", 4, "duplicate"),
        ("part-1.parquet", 5, "after_run_date"),
    }
    dup = next(r for r in rejected(out) if r["reason"] == "duplicate")
    assert json.loads(dup["raw"]) == {"user_id": "u1", "item_id": "i2", "timestamp": T + 120,
                                      "weight": 3.0}  # fmt: skip
    assert stats["splits"] == {"train": 7, "validation": 1, "test": 1}


def test_movielens_folder_reads_only_u_data(tmp_path: Path) -> None:
    folder = tmp_path / "ml-100k"
    folder.mkdir()
    rows = user_log("196", 5) + user_log("22", 1)
    (folder / "u.data").write_text("".join(f"{u}\t{i[1:]}\t{int(w)}\t{t}\n" for u, i, t, w in rows))
    # u.item (latin-1, genre flags named by u.genre) is joined automatically; item 9 is unknown.
    flags = {"0": "0|1|0", "1": "1|0|1"}
    items = "".join(
        f"{j}|Caf\xe9 {j} (1995)|01-Jan-1995||http://x|{flags.get(str(j), '0|0|0')}\n"
        for j in range(5)
    )
    (folder / "u.item").write_bytes(items.encode("latin-1"))
    (folder / "u.genre").write_text("unknown|0\nAction|1\nAdventure|2\n\n")
    (folder / "u.data").write_text((folder / "u.data").read_text() + f"22\t9\t3\t{T}\n")
    cfg = parse_config({"data": {"source": "movielens-100k", "path": str(folder)},
                        "preprocess": {"max_rejected_fraction": 0.5}})  # fmt: skip
    out = tmp_path / "out"
    stats = run_preprocess(cfg, folder, out, RUN_DATE)
    assert stats["input_rows"] == 7 and stats["eval_users"] == 1
    assert stats["rejected_by_reason"] == {"unknown_item": 1}
    assert split_rows(out, "test") == [("196", "4", T + 240, 5.0)]  # the rating is the weight
    assert (out / "vocab" / "users.txt").read_text().splitlines() == ["196", "22"]
    features = pq.read_table(out / "item_features.parquet").to_pylist()
    by_id = {f["item_id"]: f for f in features}
    assert [f["item_id"] for f in features] == (out / "vocab" / "items.txt").read_text().split()
    assert by_id["0"]["genres"] == ["Action"] and by_id["0"]["title"] == "Caf\xe9 0 (1995)"
    assert by_id["1"]["genres"] == ["unknown", "Adventure"]
    assert by_id["2"]["genres"] == []
    assert (out / SUCCESS).is_file()


def test_glob_of_delimited_files(tmp_path: Path) -> None:
    for part, rows in enumerate((user_log("a", 3), user_log("b", 3, start=30))):
        lines = ["user;item;ts"] + [f"{u};{i};{t}" for u, i, t, _ in rows]
        (tmp_path / f"log-{part}.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "notes.md").write_text("not matched by the glob\n")
    data = {
        "source": "csv",
        "delimiter": ";",
        "columns": {"user_id": "user", "item_id": "item", "timestamp": "ts"},
    }
    cfg = config(data, min_user_interactions=3)
    stats = run_preprocess(cfg, tmp_path / "log-*.txt", tmp_path / "out", RUN_DATE)
    assert len(stats["input_files"]) == 2 and stats["input_rows"] == 6
    assert split_rows(tmp_path / "out", "test") == [
        ("a", "i2", T + 120, 1.0),
        ("b", "i2", T + 150, 1.0),
    ]


@pytest.mark.parametrize("source", ["csv", "parquet"])
def test_empty_folder_is_a_data_error(tmp_path: Path, source: str) -> None:
    with pytest.raises(DataError, match="no input files"):
        run_preprocess(config({"source": source}), tmp_path, tmp_path / "out", RUN_DATE)
