"""Negatives beyond the batch: a shared pool per batch, or the whole catalog.

Mixed negative sampling (Yang et al., WWW 2020): besides the B in-batch candidates (drawn,
in effect, from the unigram distribution p), M items are drawn per batch from a sampler r
(uniform over the catalog, or r = p) and shared by every query. Item j's expected count among
the candidates is then `B p(j) + M r(j)`, and the logQ correction subtracts its log from
every column, in-batch or pooled:

    s_ij = q_i . c_j / T - log(B p(j) + M r(j))

(M = 0 gives the in-batch correction up to a constant, which the softmax ignores). Pool
columns equal to a query's positive are masked like accidental hits. With `full`, every
catalog row is a candidate and the loss is the exact softmax over the catalog, as SASRec
trains: `loss_i = logsumexp_j (q_i . c_j / T) - q_i . c_{y_i} / T`, with no correction.

With `sampled` (sampled softmax, Jean et al. 2015), each query's candidates are its own
positive and the shared pool of M items only (no other query's positive), every column
corrected by its expected count in the pool, `log(M r(j))`:

    s_ij = q_i . c_j / T - log(M r(j))
    loss_i = logsumexp([s_i,y_i, s_i,p_1 .. s_i,p_M]) - s_i,y_i

Its cost per query is M columns whatever the catalog or batch size.
"""

from __future__ import annotations

import tensorflow as tf

from recsys.losses import MIN_FLOAT


def sample_pool(
    count: int, log_probs: tf.Tensor, first: int, sampler: str, seed: tf.Tensor | None = None
) -> tf.Tensor:
    """[count] int64 row indices in [first, len(log_probs)): uniform, or by `exp(log_probs)`."""
    rows = tf.shape(log_probs, out_type=tf.int64)[0]
    if sampler == "uniform":
        return tf.random.uniform([count], first, rows, dtype=tf.int64)
    # Inverse CDF: O(count log n), where tf.random.categorical costs O(count x n).
    cdf = tf.cumsum(tf.exp(tf.cast(log_probs[first:], tf.float64)))
    u = tf.random.uniform([count], 0.0, 1.0, dtype=tf.float64) * cdf[-1]
    picked = tf.searchsorted(cdf, u, side="right")
    return first + tf.minimum(tf.cast(picked, tf.int64), rows - first - 1)


def mixture_log_q(
    log_p: tf.Tensor, batch: tf.Tensor | int, pool: int, sampler: str, catalog: int
) -> tf.Tensor:
    """`log(B p(j) + M r(j))` per candidate column, r uniform over `catalog` items or r = p."""
    p = tf.exp(tf.cast(log_p, tf.float32))
    b = tf.cast(batch, tf.float32)
    r = p if sampler == "popularity" else tf.fill(tf.shape(p), 1.0 / catalog)
    return tf.math.log(b * p + float(pool) * r)


def sampled_softmax_loss(
    query: tf.Tensor,
    positives: tf.Tensor,
    pool: tf.Tensor,
    labels: tf.Tensor,
    pool_ids: tf.Tensor,
    temperature: float,
    log_q_positive: tf.Tensor | None = None,
    log_q_pool: tf.Tensor | None = None,
) -> tf.Tensor:
    """Summed sampled-softmax cross-entropy: query i against its positive and the pool.

    `query` [n, d], `positives` [n, d] (row i: query i's item `labels[i]`), `pool` [M, d]
    (items `pool_ids`); pool columns holding a query's own item are masked (accidental hits).
    """
    query = tf.cast(query, tf.float32)
    inv_t = 1.0 / float(temperature)
    positive = tf.reduce_sum(query * tf.cast(positives, tf.float32), axis=1) * inv_t
    negative = tf.matmul(query, tf.cast(pool, tf.float32), transpose_b=True) * inv_t
    if log_q_positive is not None and log_q_pool is not None:
        positive -= tf.cast(log_q_positive, tf.float32)
        negative -= tf.cast(log_q_pool, tf.float32)[None, :]
    hit = tf.equal(tf.cast(labels, tf.int64)[:, None], tf.cast(pool_ids, tf.int64)[None, :])
    negative += tf.cast(hit, tf.float32) * MIN_FLOAT
    logits = tf.concat([positive[:, None], negative], axis=1)
    return tf.reduce_sum(tf.reduce_logsumexp(logits, axis=1) - positive)


def pool_log_q(log_p: tf.Tensor, pool: int, sampler: str, catalog: int) -> tf.Tensor:
    """`log(M r(j))`: item j's expected count in a pool of M draws from the sampler r."""
    if sampler == "popularity":
        return tf.math.log(float(pool)) + tf.cast(log_p, tf.float32)
    return tf.fill(tf.shape(log_p), tf.math.log(float(pool) / catalog))


def full_softmax_loss(
    query: tf.Tensor, catalog: tf.Tensor, labels: tf.Tensor, temperature: float
) -> tf.Tensor:
    """Summed exact softmax cross-entropy of each query's label row over all catalog rows."""
    logits = tf.matmul(tf.cast(query, tf.float32), tf.cast(catalog, tf.float32), transpose_b=True)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits / temperature)
    return tf.reduce_sum(losses)
