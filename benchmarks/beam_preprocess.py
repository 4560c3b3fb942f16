"""Benchmark of the Beam preprocessing job against a naive per-element Beam pipeline and a
plain pyarrow + TFRecord script (no Beam), on generated interaction logs.

    .venv/bin/python benchmarks/beam_preprocess.py --rows 1000000 10000000 --rounds 3 1

Each variant runs in a fresh child process (so peak memory is its own ru_maxrss, and the
TensorFlow/Beam imports are paid equally and not timed); the variants run interleaved in
rounds (ours, naive, plain, ours, ...) so that load from other processes hits them alike,
and ratios are taken within a round. All three do the same work: read Parquet, validate,
drop exact duplicates, leave-last-out split per user with a 20-item history, serialise
tf.train.Example (ours with beam_jobs.examples, byte-identical to the other two's
recsys.core.schema.encode_example) and write gzip TFRecords at level 6. Results are printed as JSON
lines and as a markdown table (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUN_DATE = dt.date(2026, 1, 31)
HISTORY = 20
MIN_INTERACTIONS = 5
FILES = 8  # input parts: one file is read by one worker


def generate(rows: int, folder: Path, seed: int = 0) -> Path:
    """`rows` interactions (users ~ rows/20, power-law items) as FILES Parquet parts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    users = max(10, rows // 20)
    items = max(10, rows // 100)
    start = int(dt.datetime(2026, 1, 1, tzinfo=dt.UTC).timestamp())
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // FILES)
    for part in range(FILES):
        n = min(per_file, rows - part * per_file)
        if n <= 0:
            break
        item = np.minimum(rng.zipf(1.3, n), items) - 1
        table = pa.table(
            {
                "user_id": pa.array(np.char.add("u", rng.integers(0, users, n).astype(str))),
                "item_id": pa.array(np.char.add("i", item.astype(str))),
                "timestamp": rng.integers(start, start + 30 * 86_400, n),
                "weight": rng.integers(1, 6, n).astype(np.float64),
            }
        )
        pq.write_table(table, folder / f"part-{part:03d}.parquet")
    return folder


# --- variant 1: our job -----------------------------------------------------------------------


def run_ours(data: Path, out: Path) -> int:
    """beam_jobs.run_preprocess with the default runner."""
    from beam_jobs.pipeline import run_preprocess
    from recsys.core.config import parse_config

    config = parse_config(
        {
            "data": {"source": "parquet", "path": str(data)},
            "preprocess": {"history_length": HISTORY, "num_shards": 4},
        }
    )
    stats = run_preprocess(config, data, out, RUN_DATE)
    return stats["input_rows"]


# --- variant 2: naive per-element Beam --------------------------------------------------------


def run_naive(data: Path, out: Path) -> int:
    """ReadFromParquet (a dict per row) -> Map validate -> GroupByKey -> Map encode ->
    WriteToTFRecord, each step one Python call per element."""
    import apache_beam as beam
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    from beam_jobs.validation import parse_id, parse_timestamp, parse_weight
    from recsys.core.layout import end_of_day_utc
    from recsys.core.schema import encode_example

    cutoff = end_of_day_utc(RUN_DATE)

    def validate(row: dict[str, Any]) -> list[tuple[str, tuple[int, str, float]]]:
        try:
            ts = parse_timestamp(row["timestamp"])
            event = (
                parse_id(row["user_id"]),
                (ts, parse_id(row["item_id"]), parse_weight(row["weight"])),
            )
        except ValueError:
            return []
        return [event] if ts < cutoff else []

    def split(element: tuple[str, Any]) -> Any:
        user, events = element
        kept: list[tuple[int, str, float]] = []
        for e in sorted(events):
            if not kept or kept[-1][:2] != e[:2]:
                kept.append(e)
        n = len(kept)
        for i, (ts, item, w) in enumerate(kept):
            name = (
                "train"
                if n < MIN_INTERACTIONS or i < n - 2
                else ("validation" if i == n - 2 else "test")
            )
            history = [e[1] for e in kept[max(0, i - HISTORY) : i]]
            record = {
                "user_id": user,
                "item_id": item,
                "timestamp": ts,
                "weight": w,
                "history": history,
            }
            yield beam.pvalue.TaggedOutput(name, encode_example(record))

    rows = 0
    with beam.Pipeline(runner=FnApiRunner()) as p:
        parts = (
            p
            | beam.io.ReadFromParquet(str(data / "*.parquet"))
            | beam.FlatMap(validate)
            | beam.GroupByKey()
            | beam.FlatMap(split).with_outputs("train", "validation", "test")
        )
        for name in ("train", "validation", "test"):
            _ = parts[name] | f"W{name}" >> beam.io.WriteToTFRecord(
                str(out / name), file_name_suffix=".tfrecord.gz", num_shards=4,
                compression_type=CompressionTypes.GZIP,
            )  # fmt: skip
    import pyarrow.parquet as pq

    for f in data.glob("*.parquet"):
        rows += pq.ParquetFile(f).metadata.num_rows
    return rows


# --- variant 3: plain pyarrow + TFRecord writer (no Beam) --------------------------------------


def run_plain(data: Path, out: Path) -> int:
    """One process: pyarrow reads, validates and sorts; Python splits; one gzip writer per split."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from apache_beam.io.tfrecordio import _TFRecordUtil

    from recsys.core.layout import end_of_day_utc
    from recsys.core.schema import encode_example

    table = pa.concat_tables(pq.read_table(f) for f in sorted(data.glob("*.parquet")))
    rows = table.num_rows
    cutoff = end_of_day_utc(RUN_DATE)
    ok = pc.and_(
        pc.and_(pc.is_valid(table["user_id"]), pc.is_valid(table["item_id"])),
        pc.and_(pc.greater_equal(table["timestamp"], 0), pc.less(table["timestamp"], cutoff)),
    )
    table = table.filter(ok).sort_by(
        [("user_id", "ascending"), ("timestamp", "ascending"), ("item_id", "ascending")]
    )
    users = table["user_id"].to_pylist()
    items = table["item_id"].to_pylist()
    times = table["timestamp"].to_pylist()
    weights = table["weight"].to_pylist()
    out.mkdir(parents=True, exist_ok=True)
    names = ("train", "validation", "test")
    # Records framed into memory buffers, compressed once at level 6 (as our sink does).
    files = {name: io.BytesIO() for name in names}
    start = 0
    total = len(users)
    while start < total:
        end = start
        while end < total and users[end] == users[start]:
            end += 1
        kept = []
        for k in range(start, end):
            if not kept or (times[kept[-1]], items[kept[-1]]) != (times[k], items[k]):
                kept.append(k)
        n = len(kept)
        for i, k in enumerate(kept):
            name = (
                "train"
                if n < MIN_INTERACTIONS or i < n - 2
                else ("validation" if i == n - 2 else "test")
            )
            history = [items[j] for j in kept[max(0, i - HISTORY) : i]]
            record = {"user_id": users[k], "item_id": items[k], "timestamp": times[k],
                      "weight": weights[k], "history": history}  # fmt: skip
            _TFRecordUtil.write_record(files[name], encode_example(record))
        start = end
    for name, buffer in files.items():
        with gzip.open(out / f"{name}.tfrecord.gz", "wb", compresslevel=6) as fh:
            fh.write(buffer.getbuffer())
    return rows


VARIANTS = {"ours": run_ours, "naive_per_element": run_naive, "plain_pyarrow": run_plain}


def child(variant: str, data: Path, out: Path) -> None:
    """Run one variant in this process and print its figures as one JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import apache_beam  # noqa: F401  (imports are not part of the timing)
    import tensorflow  # noqa: F401

    start = time.perf_counter()
    rows = VARIANTS[variant](data, out)
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "variant": variant,
        "rows": rows,
        "seconds": round(seconds, 2),
        "rows_per_s": round(rows / seconds),
        "peak_rss_mib": round(peak_kib / 1024),
    }
    print(json.dumps(result))


def run_child(variant: str, data: Path, out: Path) -> dict[str, Any]:
    """One variant in a fresh child process; its JSON result (peak RSS is the child's own)."""
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", variant, str(data), str(out)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{variant} on {data} failed (exit {proc.returncode})")
    return json.loads(lines[-1])


def main() -> None:
    """Generate each size, run the variants interleaved in rounds, print JSON and tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument(
        "--rounds", type=int, nargs="+", default=[3], help="rounds per size (one, or one per size)"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--workdir", type=Path, default=None, help="where data and outputs go")
    parser.add_argument(
        "--child", nargs=3, metavar=("VARIANT", "DATA", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), Path(args.child[2]))
        return
    rounds = args.rounds * len(args.rows) if len(args.rounds) == 1 else args.rounds
    results = []
    with tempfile.TemporaryDirectory(prefix="beam-bench-", dir=args.workdir) as tmp:
        for rows, count in zip(args.rows, rounds, strict=True):
            data = generate(rows, Path(tmp) / f"data-{rows}")
            # Interleaved (ours, naive, plain, ours, ...): load from other processes on a
            # shared machine then hits every variant alike, and ratios are taken per round.
            for round_ in range(count):
                for variant in args.variants:
                    result = run_child(variant, data, Path(tmp) / f"out-{rows}-{variant}")
                    result["round"] = round_
                    results.append(result)
                    print(json.dumps(result), flush=True)
            shutil.rmtree(data, ignore_errors=True)
    print(table(results))


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: per size and variant the median rows/s and peak RSS over rounds, and the
    median over rounds of our rows/s divided by that variant's in the same round."""
    lines = ["| rows | variant | rounds | median s | median rows/s | peak RSS MiB (max) | "
             "ours / this (median of same-round ratios) |",
             "|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for rows in dict.fromkeys(r["rows"] for r in results):
        runs = [r for r in results if r["rows"] == rows]
        ours = {r["round"]: r["rows_per_s"] for r in runs if r["variant"] == "ours"}
        for variant in dict.fromkeys(r["variant"] for r in runs):
            mine = [r for r in runs if r["variant"] == variant]
            ratios = [ours[r["round"]] / r["rows_per_s"] for r in mine if r["round"] in ours]
            ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
            lines.append(
                f"| {rows:,} | {variant} | {len(mine)} | "
                f"{statistics.median(r['seconds'] for r in mine):.1f} | "
                f"{round(statistics.median(r['rows_per_s'] for r in mine)):,} | "
                f"{max(r['peak_rss_mib'] for r in mine):,} | {ratio} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
