"""Classic baselines scored by the same exact evaluator as the two-tower model.

All work on a binary user x item interaction matrix X (users in evaluation order, items in
catalog order; a numpy array or a scipy.sparse CSR matrix for large catalogs) and return a
`recsys.evaluation.ScoreFn`.

- Popularity: s_ui = count_i (see `recsys.evaluation.popularity_scores`).
- EASE (Steck, 2019): B = I - P diagMat(1 / diag(P)) with P = (X^T X + lambda I)^-1, so that
  diag(B) = 0; scores S = X B.
- ALS for implicit feedback (Hu, Koren, Volinsky, 2008): confidence c_ui = 1 + alpha x_ui,
  alternating closed-form solves x_u = (Y^T C_u Y + reg I)^-1 Y^T C_u p_u; scores S = X_f Y^T.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from scipy import sparse

# The matrix every baseline starts from, defined once beside the data readers.
from recsys.data_io import sparse_interactions as sparse_interactions
from recsys.evaluation import ScoreFn

Matrix = Any
"""A dense numpy array or a scipy.sparse CSR matrix (rows: users, columns: items)."""


def interaction_matrix(
    rows: np.ndarray, cols: np.ndarray, num_rows: int, num_cols: int
) -> np.ndarray:
    """A dense binary float32 matrix with ones at (rows, cols); duplicates collapse to one."""
    x = np.zeros((num_rows, num_cols), dtype=np.float32)
    x[rows, cols] = 1.0
    return x


def ease_weights(x: Matrix, l2: float) -> np.ndarray:
    """EASE's item-item matrix B (items x items, zero diagonal) for regularisation `l2`."""
    gram = x.T @ x
    gram = (gram.toarray() if sparse.issparse(gram) else gram).astype(np.float64)
    gram[np.diag_indices_from(gram)] += l2
    p = np.linalg.inv(gram)
    b = -p / np.diag(p)[None, :]
    np.fill_diagonal(b, 0.0)
    return b.astype(np.float32)


def ease_scores(history: Matrix, b: np.ndarray) -> ScoreFn:
    """EASE scores for the users whose known items are the rows of `history`."""
    return lambda rows: np.asarray(history[rows] @ b)


def als_factors(
    x: Matrix,
    factors: int = 64,
    reg: float = 0.1,
    alpha: float = 10.0,
    iterations: int = 15,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Implicit ALS user and item factors (conjugate-free exact solves; fine up to ~10K items)."""
    rng = np.random.default_rng(seed)
    users = rng.normal(0, 0.01, (x.shape[0], factors))
    items = rng.normal(0, 0.01, (x.shape[1], factors))
    for _ in range(iterations):
        users = _als_solve(x, items, reg, alpha)
        items = _als_solve(_transpose(x), users, reg, alpha)
    return users.astype(np.float32), items.astype(np.float32)


def _transpose(x: Matrix) -> Matrix:
    return x.T.tocsr() if sparse.issparse(x) else x.T


def _row_items(x: Matrix) -> Iterator[np.ndarray]:
    """Each row's nonzero column indices."""
    if sparse.issparse(x):
        x = x.tocsr()
        for r in range(x.shape[0]):
            yield x.indices[x.indptr[r] : x.indptr[r + 1]]
    else:
        for row in x:
            yield np.nonzero(row)[0]


def _als_solve(x: Matrix, fixed: np.ndarray, reg: float, alpha: float) -> np.ndarray:
    """One half-step: each row's factors given the other side's (Hu et al. eq. 4)."""
    k = fixed.shape[1]
    yty = fixed.T @ fixed
    out = np.zeros((x.shape[0], k))
    for u, idx in enumerate(_row_items(x)):
        if not len(idx):
            continue
        y = fixed[idx]
        # Only observed items differ from Y^T Y: Y^T (C_u - I) Y = alpha * y^T y.
        a = yty + alpha * (y.T @ y) + reg * np.eye(k)
        out[u] = np.linalg.solve(a, (1 + alpha) * y.sum(axis=0))
    return out


def als_scores(history: Matrix, items: np.ndarray, reg: float, alpha: float) -> ScoreFn:
    """ALS scores for users given as `history` rows (folded in against fixed item factors)."""
    users = _als_solve(history, items.astype(np.float64), reg, alpha).astype(np.float32)
    return lambda rows: users[rows] @ items.T
