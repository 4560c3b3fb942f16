"""Exact evaluation: constructed cases with hand-computed ranks and metrics."""

from __future__ import annotations

import numpy as np
import pytest

from recsys import evaluation as ev
from recsys.core.config import EvaluationConfig

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


def test_large_catalog_is_exact_in_bounded_batches() -> None:
    """100K items, 600 users with 300 exclusions each: exact ranks, small score batches."""
    rng = np.random.default_rng(1)
    num_items, n = 100_000, 600
    items = rng.normal(size=(num_items, 16)).astype(np.float32)
    users = rng.normal(size=(n, 16)).astype(np.float32)
    targets = rng.integers(0, num_items, n)
    exclude = [rng.choice(num_items, 300, replace=False) for _ in range(n)]
    exclude = [e[e != t] for e, t in zip(exclude, targets, strict=True)]
    data = ev.EvalSet([f"u{i}" for i in range(n)], targets, exclude, num_items)
    score = ev.dot_product_scores(users, items)
    batches: list[int] = []

    def recording(rows: np.ndarray) -> np.ndarray:
        batches.append(len(rows))
        return score(rows)

    recording.returns_fresh_arrays = True  # type: ignore[attr-defined]
    result = ev.evaluate(recording, data, EvaluationConfig(user_batch_size=256))
    # Every user scored once, and all batches that can be in flight fit the score budget.
    assert sum(batches) == n
    in_flight = ev._MAX_THREADS * max(batches) * num_items * 5
    assert in_flight <= ev._SCORE_BYTES and max(batches) <= 256
    full = users[:5] @ items.T
    for u in range(5):
        full[u, exclude[u]] = -np.inf
        assert result.per_user["rank"][u] == int((full[u] > full[u, targets[u]]).sum())


def test_top_k_columns_match_a_full_partition() -> None:
    """Block-maxima top-k: same values as argpartition, with ties and a ragged last block."""
    rng = np.random.default_rng(2)
    scores = rng.normal(size=(40, 5_000)).astype(np.float32)
    scores[:, 100:400] = 3.0  # many exact ties at the top, spread over several blocks
    scores[5] = -np.inf  # a fully masked row
    scores[6, -3:] = 10.0  # the best items in the ragged last block
    for k in (1, 10, 50):
        got = ev.top_k_columns(scores, k, block=64)
        want = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        assert got.shape == (40, k)
        assert len(set(got[7].tolist())) == k  # distinct columns
        np.testing.assert_array_equal(
            np.sort(np.take_along_axis(scores, got, axis=1), axis=1),
            np.sort(np.take_along_axis(scores, want, axis=1), axis=1),
        )
    assert set(ev.top_k_columns(scores, 3, block=64)[6].tolist()) == {4_997, 4_998, 4_999}


def test_ranks_break_ties_by_catalog_order_in_large_rows() -> None:
    scores = np.zeros((2, 1_000), np.float32)
    scores[0, [3, 500, 900]] = 1.0  # target 500 ties with 3 (earlier) and 900 (later)
    scores[1, :] = np.arange(1_000, dtype=np.float32)  # no ties: target 10 has 989 above it
    data = ev.EvalSet(["a", "b"], np.array([500, 10]), [np.array([], np.int64)] * 2, 1_000)
    result = ev.evaluate(lambda rows: scores[rows], data, EvaluationConfig(ks=[2]))
    assert result.per_user["rank"].tolist() == [1, 989]
