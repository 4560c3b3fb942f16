"""Exact top-K evaluation at catalog scale: 100K users x 200K items, chunked, bounded memory.

Random unit vectors (d=64) for users and items, a random target and 30 excluded items per
user (the shape of a leave-last-out test split); `recsys.evaluation.evaluate` ranks the whole
catalog for every user in batches (at most 256 MiB of scores in flight). Also times the
sampled path (`sample_rows` + the 95% interval) at 10K users. Runs in a child process so
its peak RSS (ru_maxrss) is this job's alone; compare it with the 100K x 200K float32 score
matrix an unchunked evaluation would hold (80 GB).

Usage:
    nice .venv/bin/python benchmarks/eval_scale.py --users 100000 --items 200000 \\
        --out benchmarks/results/eval_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

from recsys import evaluation as ev
from recsys.core.config import EvaluationConfig


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def run(users: int, items: int, dim: int, sample: int) -> dict:
    """Time the exact evaluation of every user, then of a sample with its interval."""
    rng = np.random.default_rng(0)
    queries, candidates = _unit(rng, users, dim), _unit(rng, items, dim)
    targets = rng.integers(0, items, users)
    exclude = [rng.choice(items, 30, replace=False) for _ in range(users)]
    exclude = [e[e != t] for e, t in zip(exclude, targets, strict=True)]
    data = ev.EvalSet([f"u{u}" for u in range(users)], targets, exclude, items)
    config = EvaluationConfig()
    start = time.perf_counter()
    full = ev.evaluate(ev.dot_product_scores(queries, candidates), data, config)
    seconds = time.perf_counter() - start
    rows = np.sort(rng.choice(users, sample, replace=False))
    part = ev.EvalSet(
        [data.users[r] for r in rows], targets[rows], [exclude[r] for r in rows], items, users
    )
    start = time.perf_counter()
    sampled = ev.evaluate(ev.dot_product_scores(queries[rows], candidates), part, config)
    sample_seconds = time.perf_counter() - start
    threads, batch = ev.batch_plan(users, items, config.user_batch_size)
    return {
        "users": users,
        "items": items,
        "dim": dim,
        "seconds": round(seconds, 1),
        "users_per_second": round(users / seconds),
        "scores_per_second": round(users * items / seconds),
        "threads": threads,
        "users_per_batch": batch,
        "recall_at_10": full.metrics["recall_at_10"],
        "sample_users": sample,
        "sample_seconds": round(sample_seconds, 1),
        "sample_recall_at_10": sampled.metrics["recall_at_10"],
        "sample_recall_at_10_ci95": list(sampled.intervals["recall_at_10"]),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "unchunked_scores_gib": round(users * items * 4 / 2**30, 1),
    }


def main() -> int:
    """Run once and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--sample", type=int, default=10_000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    load = os.getloadavg()
    result = run(args.users, args.items, args.dim, args.sample)
    result |= {
        "command": " ".join(sys.argv),
        "load_average_start": [round(x, 2) for x in load],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
