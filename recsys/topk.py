"""One top-K interface with interchangeable implementations (TFRS' TopK idea).

Every implementation answers the same question with the same semantics: for each query
vector q, the k catalog rows i with the largest score s(q, i) = q . item_i (dot product,
float32), returned as ([q, k] scores, [q, k] item rows), each row ordered by score
descending, equal scores by lower item row (catalog order) first. k is capped at the catalog
size; padding a short answer (the serving signature's empty id and `pad_score`) is the
caller's job, never the implementation's.

- `ExactNumpyTopK`: brute force in query chunks (evaluation, ANN recall measurement);
- `exact_tf_top_k`: the same in a TensorFlow graph (the retrieval SavedModel);
- `IndexTopK`: a FAISS inner-product index (serving_export/ann.py); exact for a flat index
  or an IVF index probing every list, approximate otherwise.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import tensorflow as tf

# Scores per query chunk (float32: 32M = 128 MB): 1,000 queries against 1M items at once
# is a 4 GB score matrix, and argpartition copies it (measured: past 15 GB).
_SCORE_BUDGET = 1 << 25


class TopK(Protocol):
    """The k highest dot products of each query among a fixed catalog of item vectors."""

    def __call__(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """([q, k] float32 scores, [q, k] int64 item rows), best first, ties by lower row."""
        ...


def top_k_columns(scores: np.ndarray, k: int, block: int = 128) -> np.ndarray:
    """[rows, k] column indices of each row's k largest scores (unordered; ties arbitrary).

    Each row's top k lie in the (at most) k column blocks whose maxima are the k largest, so
    one pass computes every block's maximum and only those k blocks (k * block candidates)
    are partitioned, instead of partitioning whole catalog rows.
    """
    n, m = scores.shape
    k = min(k, m)
    if m <= 4 * k * block:  # small catalogs: a direct partition is as cheap
        return np.argpartition(-scores, k - 1, axis=1)[:, :k]
    starts = np.arange(0, m, block)
    maxima = np.maximum.reduceat(scores, starts, axis=1)  # [n, blocks], ragged last block
    blocks = np.argpartition(-maxima, k - 1, axis=1)[:, :k]  # [n, k]
    cols = (blocks[:, :, None] * block + np.arange(block)).reshape(n, k * block)
    inside = cols < m
    cols = np.where(inside, cols, 0)
    candidates = np.where(inside, np.take_along_axis(scores, cols, axis=1), -np.inf)
    best = np.argpartition(-candidates, k - 1, axis=1)[:, :k]
    return np.take_along_axis(cols, best, axis=1)


def ordered_top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The interface's answer from a [q, items] score matrix: best first, ties by lower row.

    A tie at the k-th place is resolved over the whole row (not just the partitioned k), so
    the lower rows win exactly as `tf.math.top_k` picks them.
    """
    k = min(k, scores.shape[1])
    if not k:
        return np.zeros((len(scores), 0), np.float32), np.zeros((len(scores), 0), np.int64)
    top = top_k_columns(scores, k)
    values = np.take_along_axis(scores, top, axis=1)
    kth = values.min(axis=1)
    # Rows with more scores >= the k-th than k have a tie across the cut: redo those rows.
    for r in np.flatnonzero(np.count_nonzero(scores >= kth[:, None], axis=1) > k):
        above = np.flatnonzero(scores[r] > kth[r])
        tied = np.flatnonzero(scores[r] == kth[r])[: k - len(above)]  # lower rows first
        top[r] = np.concatenate([above, tied])
    values = np.take_along_axis(scores, top, axis=1)
    order = np.lexsort((top, -values), axis=-1)  # score descending, then row ascending
    indices = np.take_along_axis(top, order, axis=1).astype(np.int64)
    return np.take_along_axis(values, order, axis=1).astype(np.float32), indices


class ExactNumpyTopK:
    """Brute-force dot products in query chunks of at most _SCORE_BUDGET scores."""

    def __init__(self, items: np.ndarray) -> None:
        self.items_t = np.ascontiguousarray(np.asarray(items, dtype=np.float32).T)

    def __call__(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """([q, k] scores, [q, k] item rows), best first, ties by lower row."""
        num_items = self.items_t.shape[1]
        k = min(k, num_items)
        queries = np.asarray(queries, dtype=np.float32)
        step = max(1, _SCORE_BUDGET // max(num_items, 1))
        parts = [
            ordered_top_k(queries[start : start + step] @ self.items_t, k)
            for start in range(0, len(queries), step)
        ]
        if not parts:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def exact_tf_top_k(
    queries: tf.Tensor, items: tf.Tensor, k: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """In-graph ([q, k] scores, [q, k] int32 item rows): `tf.math.top_k` of the dot products.

    tf.math.top_k orders equal values by lower index first: the interface's tie rule.
    """
    scores = tf.matmul(queries, items, transpose_b=True)
    top = tf.math.top_k(scores, k=tf.minimum(k, tf.shape(items)[0]), sorted=True)
    return top.values, top.indices


class ExactTFTopK:
    """`exact_tf_top_k` behind the numpy interface (the SavedModel's semantics, for tests)."""

    def __init__(self, items: np.ndarray) -> None:
        self.items = tf.constant(np.asarray(items, dtype=np.float32))

    def __call__(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """([q, k] scores, [q, k] item rows), best first, ties by lower row."""
        scores, indices = exact_tf_top_k(tf.constant(queries, tf.float32), self.items, k)
        return scores.numpy(), indices.numpy().astype(np.int64)


class IndexTopK:
    """A FAISS inner-product index (`index.search`) behind the interface."""

    def __init__(self, index: Any) -> None:
        self.index = index

    def __call__(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """([q, k] scores, [q, k] item rows) as the index finds them, best first."""
        k = min(k, self.index.ntotal)
        scores, rows = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        return scores.astype(np.float32), rows.astype(np.int64)
