"""Exact evaluation: constructed cases with hand-computed ranks and metrics."""

from __future__ import annotations

import numpy as np
import pytest

from recsys import evaluation as ev
from recsys.config import EvaluationConfig

CFG = EvaluationConfig(ks=[1, 2, 3], ndcg_k=2, mrr_k=3, coverage_k=1, user_batch_size=2)


def _rows(pairs: list[tuple[str, str]]) -> dict[str, np.ndarray]:
    return {
        "user_id": np.array([u.encode() for u, _ in pairs]),
        "item_id": np.array([i.encode() for _, i in pairs]),
    }


def test_eval_set_maps_targets_and_exclusions() -> None:
    catalog = ["a", "b", "c", "d"]
    data = ev.build_eval_set(
        catalog,
        _rows([("u1", "c"), ("u2", "zz")]),
        [_rows([("u1", "a"), ("u1", "c"), ("u2", "b")])],
    )
    assert data.targets.tolist() == [2, -1]  # unknown target item -> -1 (always a miss)
    assert sorted(data.exclude[0].tolist()) == [0]  # the target itself is never excluded
    assert data.exclude[1].tolist() == [1]


def test_ranks_metrics_and_exclusion_by_hand() -> None:
    scores = np.array(
        [
            [0.9, 0.8, 0.7, 0.1],  # u0: target 2; item 0 excluded -> rank 1
            [0.1, 0.2, 0.3, 0.4],  # u1: target 0 -> rank 3
            [0.5, 0.5, 0.5, 0.5],  # u2: ties broken by catalog order: target 2 -> 2
            [0.0, 0.0, 0.0, 0.0],
        ]
    )  # u3: target not in catalog -> miss
    data = ev.EvalSet(
        ["u0", "u1", "u2", "u3"],
        np.array([2, 0, 2, -1]),
        [np.array([0]), np.array([], np.int64), np.array([], np.int64), np.array([], np.int64)],
        num_items=4,
    )
    result = ev.evaluate(lambda rows: scores[rows], data, CFG)
    assert result.per_user["rank"].tolist() == [1, 3, 2, -1]
    m = result.metrics
    assert m["recall_at_1"] == 0.0
    assert m["recall_at_2"] == pytest.approx(1 / 4)
    assert m["recall_at_3"] == pytest.approx(2 / 4)
    assert m["ndcg_at_2"] == pytest.approx((1 / np.log2(3)) / 4)
    assert m["mrr_at_3"] == pytest.approx((1 / 2 + 1 / 3) / 4)
    # top-1 per user: u0 -> 1 (0 excluded), u1 -> 3, u2 -> 0, u3 -> 0: items {0, 1, 3}
    assert m["coverage_at_1"] == pytest.approx(3 / 4)
    assert m["eval_users"] == 4


def test_batching_does_not_change_results() -> None:
    rng = np.random.default_rng(0)
    users, items = rng.normal(size=(37, 8)), rng.normal(size=(50, 8))
    targets = rng.integers(0, 50, 37)
    exclude = [rng.choice(50, 5, replace=False) for _ in range(37)]
    exclude = [e[e != t] for e, t in zip(exclude, targets, strict=True)]
    data = ev.EvalSet([f"u{i}" for i in range(37)], targets, exclude, 50)
    score = ev.dot_product_scores(users, items)
    small = ev.evaluate(score, data, EvaluationConfig(ks=[5, 10], user_batch_size=4))
    big = ev.evaluate(score, data, EvaluationConfig(ks=[5, 10], user_batch_size=1000))
    assert small.metrics == big.metrics
    # Direct computation of recall@10 without batching.
    full = users @ items.T
    hits = 0
    for u in range(37):
        s = full[u].copy()
        s[exclude[u]] = -np.inf
        hits += int((s > s[targets[u]]).sum() < 10)
    assert big.metrics["recall_at_10"] == pytest.approx(hits / 37)


def test_popularity_scores_rank_by_count() -> None:
    data = ev.EvalSet(["u"], np.array([1]), [np.array([], np.int64)], 3)
    result = ev.evaluate(
        ev.popularity_scores(np.array([5, 9, 1])), data, EvaluationConfig(ks=[1], coverage_k=1)
    )
    assert result.per_user["rank"].tolist() == [0]


def test_large_catalog_evaluates_in_bounded_time() -> None:
    """100K items, 600 users with 300 exclusions each: vectorised masking, batch x catalog."""
    import time

    rng = np.random.default_rng(1)
    num_items, n = 100_000, 600
    items = rng.normal(size=(num_items, 16)).astype(np.float32)
    users = rng.normal(size=(n, 16)).astype(np.float32)
    targets = rng.integers(0, num_items, n)
    exclude = [rng.choice(num_items, 300, replace=False) for _ in range(n)]
    exclude = [e[e != t] for e, t in zip(exclude, targets, strict=True)]
    data = ev.EvalSet([f"u{i}" for i in range(n)], targets, exclude, num_items)
    start = time.perf_counter()
    result = ev.evaluate(
        ev.dot_product_scores(users, items), data, EvaluationConfig(user_batch_size=256)
    )
    assert time.perf_counter() - start < 30
    full = users[:5] @ items.T
    for u in range(5):
        full[u, exclude[u]] = -np.inf
        assert result.per_user["rank"][u] == int((full[u] > full[u, targets[u]]).sum())
