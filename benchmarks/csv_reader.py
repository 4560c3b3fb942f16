"""Throughput of the delimited-text reader: read + validate a generated CSV into Arrow batches.

    .venv/bin/python benchmarks/csv_reader.py --rows 500000 --repeats 3

`beam_jobs.readers.read_batches` on one file, in-process (no Beam), best of `--repeats` runs.
Run it from two checkouts (before/after a change) back to back: the line-oriented reader
against the csv.reader-over-a-line-feed one it replaced (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path.cwd()))  # the checkout it is run from, not necessarily this one

from beam_jobs.readers import Bounds, read_batches, read_spec

try:
    from recsys.core.config import parse_config
except ImportError:  # a checkout from before the recsys.core move
    from recsys.config import parse_config  # type: ignore[no-redef]

START = 1_767_225_600  # 2026-01-01


def generate(path: Path, rows: int, seed: int = 0) -> None:
    """`rows` interactions: 20K users, 5K items, 30 days, a weight column."""
    rng = np.random.default_rng(seed)
    users, items = rng.integers(0, 20_000, rows), rng.integers(0, 5_000, rows)
    stamps = START + rng.integers(0, 86_400 * 30, rows)
    with path.open("w") as fh:
        fh.write("user_id,item_id,timestamp,weight\n")
        fh.writelines(f"u{u},i{i},{t},1.0\n" for u, i, t in zip(users, items, stamps, strict=True))


def main() -> None:
    """Generate the file, time the reader, print rows/s."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="csv-bench-") as tmp:
        path = Path(tmp) / "log.csv"
        generate(path, args.rows)
        spec = read_spec(parse_config({"data": {"source": "csv", "path": str(path)}}).data)
        bounds = Bounds(START + 86_400 * 40)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            batches = read_batches(str(path), 0, spec, bounds)
            rows = sum(b.num_rows for b in batches if not isinstance(b, dict))
            times.append(time.perf_counter() - start)
    best = min(times)
    print(f"rows {rows} best {best:.3f} s -> {rows / best:,.0f} rows/s; all {times}")


if __name__ == "__main__":
    main()
