"""Exact numpy top-K: recsys.topk.ExactNumpyTopK vs the whole-row argpartition it replaced.

The reference is serving_export/ann.py's former `exact_top_k` (argpartition of every whole
score row, then a stable sort of the k): both return identical ids (checked). Queries
and items are random normal float32 vectors; best of two interleaved rounds each.

Usage:
    .venv/bin/python benchmarks/topk_exact.py [--items 10000 200000] [--queries 1000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from recsys.core.tf_env import set_tf_env

set_tf_env()

import numpy as np

from recsys.topk import ExactNumpyTopK

_SCORE_BUDGET = 1 << 25


def whole_row_top_k(items: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """The replaced reference: argpartition of whole rows, then a stable sort of the k."""
    k = min(k, len(items))
    step = max(1, _SCORE_BUDGET // max(len(items), 1))
    parts = []
    for start in range(0, len(queries), step):
        scores = queries[start : start + step] @ items.T
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
        parts.append(np.take_along_axis(top, order, axis=1))
    return np.concatenate(parts)


def best_of(rounds: int, runs: dict[str, Callable[[], np.ndarray]]) -> dict[str, float]:
    """Best wall time of each run over interleaved rounds; asserts the answers are equal."""
    times: dict[str, float] = {}
    answers: dict[str, np.ndarray] = {}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            answers[name] = run()
            times[name] = min(times.get(name, float("inf")), time.perf_counter() - start)
    first, *rest = answers.values()
    assert all((first == other).all() for other in rest), "implementations disagree"
    return times


def main() -> None:
    """Print one line per catalog size: both timings and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, nargs="+", default=[10_000, 200_000])
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for n_items in args.items:
        items = rng.normal(size=(n_items, 64)).astype(np.float32)
        queries = rng.normal(size=(args.queries, 64)).astype(np.float32)
        times = best_of(
            2,
            {
                "whole-row argpartition": lambda i=items, q=queries: whole_row_top_k(i, q, args.k),
                "recsys.topk": lambda i=items, q=queries: ExactNumpyTopK(i)(q, args.k)[1],
            },
        )
        ref, new = times["whole-row argpartition"], times["recsys.topk"]
        print(
            f"{args.queries} queries x {n_items} items, k={args.k}: whole-row argpartition "
            f"{ref * 1e3:.0f} ms, recsys.topk {new * 1e3:.0f} ms, ratio {ref / new:.1f}x, "
            "ids identical"
        )


if __name__ == "__main__":
    main()
