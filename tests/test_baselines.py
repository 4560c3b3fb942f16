"""EASE and ALS baselines on constructed matrices with known answers."""

from __future__ import annotations

import numpy as np

from recsys import baselines


def _blocks() -> np.ndarray:
    """Two user groups with disjoint tastes: items 0-4 and items 5-9."""
    x = np.zeros((40, 10), dtype=np.float32)
    rng = np.random.default_rng(0)
    for u in range(40):
        block = range(0, 5) if u < 20 else range(5, 10)
        x[u, rng.choice(list(block), 3, replace=False)] = 1
    return x


def test_interaction_matrix_is_binary() -> None:
    x = baselines.interaction_matrix(np.array([0, 0, 1]), np.array([2, 2, 0]), 2, 3)
    assert x.tolist() == [[0, 0, 1], [1, 0, 0]]


def test_ease_matches_closed_form_and_recommends_within_block() -> None:
    x = _blocks()
    b = baselines.ease_weights(x, l2=1.0)
    assert np.allclose(np.diag(b), 0)
    # Closed form from the paper: B = I - P diagMat(1/diag(P)), P = (X^T X + l2 I)^-1.
    p = np.linalg.inv(x.T @ x + np.eye(10))
    expected = np.eye(10) - p / np.diag(p)[None, :]
    np.testing.assert_allclose(b, expected, atol=1e-5)
    scores = baselines.ease_scores(x, b)(np.array([0, 39]))
    assert scores[0, :5].mean() > scores[0, 5:].mean()
    assert scores[1, 5:].mean() > scores[1, :5].mean()


def test_als_recovers_the_block_structure() -> None:
    x = _blocks()
    _, items = baselines.als_factors(x, factors=4, reg=0.1, alpha=10.0, iterations=10)
    scores = baselines.als_scores(x, items, reg=0.1, alpha=10.0)(np.arange(40))
    own = np.concatenate([scores[:20, :5].ravel(), scores[20:, 5:].ravel()]).mean()
    other = np.concatenate([scores[:20, 5:].ravel(), scores[20:, :5].ravel()]).mean()
    assert own > other + 0.3


def test_sparse_input_gives_the_dense_results() -> None:
    x = _blocks()
    rows, cols = np.nonzero(x)
    xs = baselines.sparse_interactions(
        np.r_[rows, rows[:3]], np.r_[cols, cols[:3]], *x.shape
    )  # repeated pairs collapse to one
    np.testing.assert_array_equal(xs.toarray(), x)
    np.testing.assert_allclose(baselines.ease_weights(xs, 1.0), baselines.ease_weights(x, 1.0))
    b = baselines.ease_weights(x, 1.0)
    rows_ = np.array([3, 0, 39])
    np.testing.assert_allclose(
        baselines.ease_scores(xs, b)(rows_), baselines.ease_scores(x, b)(rows_), atol=1e-6
    )
    dense = baselines.als_factors(x, factors=4, reg=0.1, alpha=10.0, iterations=3)
    thin = baselines.als_factors(xs, factors=4, reg=0.1, alpha=10.0, iterations=3)
    for a, c in zip(dense, thin, strict=True):
        np.testing.assert_allclose(a, c, atol=1e-5)
