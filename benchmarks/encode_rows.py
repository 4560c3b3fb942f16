"""Rows per query-tower call: users encoded per second and the call's peak RSS growth.

`TrainedModel.query_embeddings` encodes users in chunks of `encode_rows()` rows (the budget
`recsys.model.trained.ENCODE_ELEMENTS` over one row's [history_length, width] activations).
This script times the same users at several chunk sizes on a saved model, the shipped budget
among them, and samples the process's RSS during each pass, so the budget is chosen by speed
and memory side by side. Random histories over the model's own catalog; one process, the
chunk sizes in the order given, each after one warm-up call.

    .venv/bin/python benchmarks/encode_rows.py --model RUN/model --users 131072 \\
        --rows 2621 5242 10485 65536 --out benchmarks/results/encode_rows.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from recsys.core.memory import release_memory, resident_bytes
from recsys.model import TrainedModel


def peak_during(call: Any) -> tuple[float, int]:
    """Seconds `call()` took and the highest RSS sampled (every 5 ms) while it ran."""
    peak, done = [resident_bytes()], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], resident_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    return seconds, max(peak[0], resident_bytes())


def main() -> None:
    """Time and sample each chunk size; print a table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a run's model/ folder")
    parser.add_argument("--users", type=int, default=131072)
    parser.add_argument("--rows", type=int, nargs="+", default=[2621, 5242, 10485, 65536])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = TrainedModel.load(args.model)
    cfg = model.config
    rng = np.random.default_rng(0)
    users = np.arange(args.users) % len(model.users) + cfg.oov_buckets
    length = max(cfg.history_length, 1)
    hist = rng.integers(cfg.oov_buckets, cfg.oov_buckets + len(model.items), (args.users, length))
    model.query_embeddings(users[:1000], hist[:1000], 1000)  # traces and warms the tower
    rows_out = []
    for rows in dict.fromkeys([*args.rows, model.encode_rows()]):  # the shipped size always
        release_memory()
        base = resident_bytes()
        seconds, peak = peak_during(lambda r=rows: model.query_embeddings(users, hist, r))
        rows_out.append(
            {
                "rows": rows,
                "shipped": rows == model.encode_rows(),
                "users_per_second": round(args.users / seconds),
                "peak_rss_growth_mib": (peak - base) >> 20,
            }
        )
        print(rows_out[-1], flush=True)
    report = {
        "command": "benchmarks/encode_rows.py " + " ".join(sys.argv[1:]),
        "model": {
            "query_encoder": cfg.query_encoder,
            "history_length": cfg.history_length,
            "embedding_dim": cfg.embedding_dim,
            "users": len(model.users),
            "items": len(model.items),
        },
        "users": args.users,
        "results": rows_out,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
