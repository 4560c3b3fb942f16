"""Object storage costs: staging a data folder through the local copy, and Parquet reads.

    .venv/bin/python benchmarks/storage.py --rows 1000000 --out benchmarks/results/storage.json

Starts moto's S3 server and fake-gcs-server on 127.0.0.1 (tests/object_stores.py) and measures
1. the Beam job's data folder for a synthetic log of `--rows` rows: the time to publish it to
   the bucket (recsys.core.mirror push: upload, marker last) and to pull it into an empty local
   copy (what a stage on another machine pays before it trains), next to the Beam job's own
   time for the same folder;
2. reading a Parquet file of `--rows` rows from S3 batch by batch, through pyarrow's S3 file
   system (what beam_jobs.readers uses) and through Beam's FileSystems (boto3), best of
   `--repeats`.
Loopback servers measure the clients' overhead, not a network: a real bucket adds latency
and bandwidth limits to both sides of each comparison alike.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from beam_jobs.pipeline import run_preprocess
from recsys.core import mirror, storage
from recsys.core.config import parse_config
from tests.object_stores import gcs_server, s3_server

START = 1_767_225_600  # 2026-01-01
DAYS = 30


def log_table(rows: int, seed: int = 0) -> pa.Table:
    """`rows` interactions of 20K users and 5K items over 30 days."""
    rng = np.random.default_rng(seed)
    return pa.table({
        "user_id": pa.array([f"u{u}" for u in rng.integers(0, 20_000, rows)]),
        "item_id": pa.array([f"i{i}" for i in rng.integers(0, 5_000, rows)]),
        "timestamp": START + rng.integers(0, 86_400 * DAYS, rows),
        "weight": np.ones(rows),
    })  # fmt: skip


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def staging(store: object, data_dir: Path, scratch: Path) -> dict[str, float]:
    """Publish the data folder under a fresh bucket's workdir, then pull it elsewhere."""
    uri = f"{store.new_bucket()}/work"  # type: ignore[attr-defined]
    local = scratch / f"push-{store.scheme}"  # type: ignore[attr-defined]
    shutil.copytree(data_dir, local / "data" / data_dir.name)
    start = time.perf_counter()
    mirror.Mirror(uri, local).push()
    push = time.perf_counter() - start
    start = time.perf_counter()
    mirror.Mirror(uri, scratch / f"pull-{store.scheme}").pull()
    pull = time.perf_counter() - start
    return {"push_seconds": round(push, 2), "pull_seconds": round(pull, 2)}


def parquet_reads(uri: str, repeats: int) -> dict[str, float]:
    """Best time to read every batch of one Parquet object, by pyarrow's S3 and by Beam's."""
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    FileSystems.set_options(PipelineOptions([]))

    def through_pyarrow() -> int:
        return sum(
            b.num_rows for b in pq.ParquetFile(storage.open_random_access(uri)).iter_batches()
        )

    def through_beam() -> int:
        with FileSystems.open(uri) as fh:
            return sum(b.num_rows for b in pq.ParquetFile(fh).iter_batches())

    best = {}
    for name, read in (("pyarrow_fs", through_pyarrow), ("beam_filesystems", through_beam)):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            read()
            times.append(time.perf_counter() - start)
        best[f"{name}_seconds"] = round(min(times), 3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="recsys-storage-bench-") as tmp:
        scratch = Path(tmp)
        table = log_table(args.rows)
        log = scratch / "log.parquet"
        pq.write_table(table, log)
        config = parse_config({"data": {"source": "parquet", "path": str(log)}})
        date = dt.date(2026, 1, DAYS)
        data_dir = scratch / "data" / date.isoformat()
        stats = run_preprocess(config, log, data_dir, date)
        result: dict[str, object] = {
            "rows": args.rows,
            "data_folder_mb": round(folder_bytes(data_dir) / 1e6, 1),
            "beam_seconds": round(stats["pipeline_seconds"], 1),
            "parquet_mb": round(log.stat().st_size / 1e6, 1),
        }
        with s3_server(scratch) as s3, gcs_server(scratch) as gcs:
            os.environ.update(s3.env)
            os.environ.update(gcs.env)
            for store in (s3, gcs):
                result[store.scheme] = staging(store, data_dir, scratch)
            uri = f"{s3.new_bucket()}/log.parquet"
            storage.write_bytes(uri, log.read_bytes())
            result["s3_parquet_read"] = parquet_reads(uri, args.repeats)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
