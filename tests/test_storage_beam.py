"""The Beam job reading its raw input from S3 and GCS servers on 127.0.0.1.

Same files, local or in a bucket: the job's output is byte-identical except where it names
the input's location (stats.json's input files, the `file` of rejected rows).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from beam_jobs.inputs import list_input_files
from beam_jobs.pipeline import run_preprocess
from recsys.core import storage
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.errors import DataError
from recsys.core.layout import SUCCESS
from recsys.synthetic import write_csv
from tests.conftest import SMALL, SMALL_DATE
from tests.object_stores import ObjectStore

RUN_DATE = dt.date(2026, 1, 4)
DAY = 86_400


def _upload(local: Path, uri: str) -> None:
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        storage.write_bytes(f"{uri}/{path.relative_to(local).as_posix()}", path.read_bytes())


def output_files(out: Path, input_root: str) -> dict[str, bytes]:
    """Every output file's bytes, with the input's location written as `<input>`.

    Rejected rows are compared as one sorted set: their shard is a hash of their file's name.
    """
    files = {}
    rejected: list[bytes] = []
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != SUCCESS):
        data = path.read_bytes().replace(input_root.encode(), b"<input>")
        if path.parent.name == "rejected":
            rejected += data.splitlines()
        else:
            files[path.relative_to(out).as_posix()] = data
    files["rejected"] = b"\n".join(sorted(rejected))
    stats = json.loads(files.pop("stats.json"))
    stats.pop("fingerprint")  # of the input files' names and sizes: another name, another print
    files["stats.json"] = json.dumps(stats, sort_keys=True).encode()
    return files


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory: pytest.TempPathFactory) -> tuple[RecsysConfig, Path]:
    """SMALL's log as day-partitioned Parquet (`date=YYYY-MM-DD/part-0.parquet`), one bad row."""
    root = tmp_path_factory.mktemp("events")
    config = parse_config(SMALL)
    log = write_csv(config.data.synthetic, root.parent / "log.csv")
    table = pa_csv.read_csv(log)
    days = table["timestamp"].to_numpy() // DAY
    for day in sorted(set(days.tolist())):
        part = table.filter(pa.array(days == day))
        folder = root / f"date={dt.datetime.fromtimestamp(day * DAY, dt.UTC).date()}"
        folder.mkdir()
        pq.write_table(part, folder / "part-0.parquet")
    bad = pa.table({"user_id": ["u-bad"], "item_id": [None], "timestamp": [1767225600],
                    "weight": [1.0]}, schema=table.schema)  # fmt: skip
    pq.write_table(bad, root / "date=2026-01-01" / "part-1.parquet")
    (root / "_SUCCESS").write_text("")  # a marker other tools leave: not input
    config = parse_config({**SMALL, "data": {"source": "parquet", "path": str(root)},
                           "preprocess": {"max_rejected_fraction": 0.5}})  # fmt: skip
    return config, root


def test_day_partitions_in_a_bucket_are_read_up_to_the_run_date(
    store: ObjectStore, partitioned: tuple[RecsysConfig, Path], tmp_path: Path
) -> None:
    config, root = partitioned
    uri = f"{store.new_bucket()}/events"
    _upload(root, uri)
    listed = list_input_files(uri, "parquet", RUN_DATE)
    local = list_input_files(root, "parquet", RUN_DATE)
    assert [f.path.replace(uri, str(root)) for f in listed] == [f.path for f in local]
    assert [f.bytes for f in listed] == [f.bytes for f in local]
    assert {p.split("/")[-2] for p in (f.path for f in listed)} == {
        "date=2026-01-01", "date=2026-01-02", "date=2026-01-03", "date=2026-01-04",
    }  # fmt: skip

    reference = run_preprocess(config, root, tmp_path / "local", RUN_DATE)
    remote_config = config.with_input(uri)
    remote = run_preprocess(remote_config, uri, tmp_path / "bucket", RUN_DATE)
    assert remote["rejected_by_reason"] == reference["rejected_by_reason"] == {"missing_field": 1}
    assert remote["splits"] == reference["splits"]
    assert output_files(tmp_path / "bucket", uri) == output_files(tmp_path / "local", str(root))


def test_csv_with_item_file_in_a_bucket_and_glob(
    store: ObjectStore, small_csv: Path, tmp_path: Path
) -> None:
    raw = small_csv.parent
    (raw / "items.csv").write_text("item_id,title,genres\n" + "".join(
        f"{i},Item {i},g{n % 3}\n" for n, i in enumerate(sorted(
            {line.split(",")[1] for line in small_csv.read_text().splitlines()[1:]}))
    ))  # fmt: skip
    uri = f"{store.new_bucket()}/raw"
    _upload(raw, uri)
    data = {"source": "csv", "items": {"path": f"{uri}/items.csv"}}
    config = parse_config({**SMALL, "data": {**data, "path": f"{uri}/inter*.csv"}})
    date = dt.date.fromisoformat(SMALL_DATE)
    remote = run_preprocess(config, f"{uri}/inter*.csv", tmp_path / "bucket", date)
    local_data = {"source": "csv", "items": {"path": str(raw / "items.csv")}}
    local_config = parse_config({**SMALL, "data": {**local_data, "path": str(small_csv)}})
    reference = run_preprocess(local_config, small_csv, tmp_path / "local", date)
    assert remote["input_files"][0]["path"] == f"{uri}/interactions.csv"
    assert remote["splits"] == reference["splits"]
    assert output_files(tmp_path / "bucket", uri) == output_files(tmp_path / "local", str(raw))
    assert (tmp_path / "bucket" / "item_features.parquet").is_file()


def test_a_missing_input_in_a_bucket_is_named(store: ObjectStore) -> None:
    bucket = store.new_bucket()
    with pytest.raises(DataError, match=f"input not found: {bucket}/nothing"):
        list_input_files(f"{bucket}/nothing", "csv")
    with pytest.raises(DataError, match="no input files"):
        list_input_files(f"{bucket}/nothing*.csv", "csv")
