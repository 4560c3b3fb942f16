"""The in-batch sampled-softmax loss, computed in row blocks that stay in the CPU's caches.

The loss is the one `tfrs.tasks.Retrieval` computes (temperature, logQ correction, accidental
hits, labels on the diagonal, SUM reduction), to float rounding:

    s_ij = q_i . c_j / T  -  log Q_j  (+ MIN_FLOAT where j != i holds the same item as i)
    loss = sum_i  logsumexp_j s_ij  -  s_ii

TFRS materialises the whole [queries x candidates] logits matrix several times over (scores,
one-hot labels, softmax, its gradient): at batch 8192 that is 256 MiB per pass, so the step is
bound by memory traffic. Here the queries are taken `block_rows` at a time: each block's
logits, softmax and gradient contributions are computed while the block is cache-resident,
and the gradients (`dL/dq = (P - Y) C / T`, `dL/dc = (P - Y)^T Q / T`) are accumulated in the
same pass, so the backward pass costs nothing extra. Measured on the 2-core CPU at batch 8192
(docs/BENCHMARKS.md): a train step 1.7x faster than with XLA's fused TFRS task, 2.7x faster
than with the TFRS task without XLA. XLA cannot compile the block loop (dynamic shapes): the
model uses the TFRS task when the step is XLA-compiled.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

MIN_FLOAT = float(np.finfo(np.float32).min / 100.0)
"""What TFRS adds to the logits of accidental hits (tfrs.layers.loss.MIN_FLOAT)."""

BLOCK_ROWS = 512
"""Queries per block: 512 x 8192 float32 logits = 16 MiB (fastest of 256-2048 measured)."""


def in_batch_softmax_loss(
    query: tf.Tensor,
    candidates: tf.Tensor,
    temperature: float = 1.0,
    log_q: tf.Tensor | None = None,
    candidate_ids: tf.Tensor | None = None,
    block_rows: int = BLOCK_ROWS,
) -> tf.Tensor:
    """Summed softmax cross-entropy of each query's diagonal candidate, in row blocks.

    `query` [n, d] and `candidates` [m, d] (m >= n; row i of candidates is query i's
    positive, further rows are extra negatives such as other replicas' candidates) are float32.
    `log_q` [m] is subtracted from the logits (logQ correction); with `candidate_ids` [m],
    columns j != i whose id equals candidate i's are masked out (accidental hits). Gradients
    flow to `query` and `candidates` only.
    """
    return softmax_loss(query, candidates, None, temperature, log_q, candidate_ids, block_rows)


def softmax_loss(
    query: tf.Tensor,
    candidates: tf.Tensor,
    labels: tf.Tensor | None = None,
    temperature: float = 1.0,
    log_q: tf.Tensor | None = None,
    candidate_ids: tf.Tensor | None = None,
    block_rows: int = BLOCK_ROWS,
) -> tf.Tensor:
    """Summed softmax cross-entropy of column `labels[i]` for each query i, in row blocks.

    `labels` [n] int (None: the diagonal, labels[i] = i). With the whole catalog as
    `candidates` and item indices as labels this is the exact (full) softmax, computed
    without ever holding the [n x catalog] logits of more than one block of rows.
    Accidental hits (`candidate_ids`): columns j != labels[i] holding the id of column
    labels[i] are masked out.
    """
    query = tf.convert_to_tensor(query, tf.float32)
    candidates = tf.convert_to_tensor(candidates, tf.float32)
    inv_t = 1.0 / float(temperature)
    bias = None if log_q is None else -tf.cast(tf.convert_to_tensor(log_q), tf.float32)
    ids = None if candidate_ids is None else tf.convert_to_tensor(candidate_ids)
    if labels is None:
        labels = tf.range(tf.shape(query)[0], dtype=tf.int64)
    labels = tf.cast(labels, tf.int64)
    return _blocked(query, candidates, labels, bias, ids, inv_t, block_rows)


def _blocked(
    query: tf.Tensor,
    candidates: tf.Tensor,
    labels: tf.Tensor,
    bias: tf.Tensor | None,
    ids: tf.Tensor | None,
    inv_t: float,
    block_rows: int,
) -> tf.Tensor:
    @tf.custom_gradient
    def loss_fn(q: tf.Tensor, c: tf.Tensor) -> tuple[tf.Tensor, object]:
        n = tf.shape(q)[0]
        m = tf.shape(c)[0]
        columns = tf.range(m, dtype=tf.int64)

        def block(lo: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            """Loss of rows [lo, lo + block_rows), their dq and their share of dc."""
            qb = q[lo : lo + block_rows]
            positives = labels[lo : lo + block_rows]
            logits = tf.matmul(qb, c, transpose_b=True) * inv_t
            if bias is not None:
                logits += bias[None, :]
            if ids is not None:
                hit = tf.equal(tf.gather(ids, positives)[:, None], ids[None, :])
                hit = tf.logical_and(hit, tf.not_equal(positives[:, None], columns[None, :]))
                logits += tf.cast(hit, tf.float32) * MIN_FLOAT
            top = tf.stop_gradient(tf.reduce_max(logits, axis=1, keepdims=True))
            exp = tf.exp(logits - top)
            total = tf.reduce_sum(exp, axis=1, keepdims=True)
            positive = tf.gather(logits, positives, axis=1, batch_dims=1)
            loss = tf.reduce_sum(tf.math.log(total[:, 0]) + top[:, 0] - positive)
            # dL/dlogits = softmax - one-hot(label); the one-hot part is subtracted below.
            probs = exp / total
            return loss, tf.matmul(probs, c), tf.matmul(probs, qb, transpose_a=True)

        starts = tf.range(0, n, block_rows)
        count = tf.shape(starts)[0]
        dq_parts = tf.TensorArray(tf.float32, size=count, infer_shape=False)

        def body(
            i: tf.Tensor, loss: tf.Tensor, dq: tf.TensorArray, dc: tf.Tensor
        ) -> tuple[tf.Tensor, tf.Tensor, tf.TensorArray, tf.Tensor]:
            block_loss, block_dq, block_dc = block(starts[i])
            return i + 1, loss + block_loss, dq.write(i, block_dq), dc + block_dc

        _, loss, dq_parts, dc = tf.while_loop(
            lambda i, *_: i < count,
            body,
            (tf.constant(0), tf.constant(0.0), dq_parts, tf.zeros_like(c)),
            parallel_iterations=1,
        )
        # Minus the positives' one-hot: row i of dq loses c[labels[i]], and row labels[i] of
        # dc loses q_i (summed when several queries share a label).
        dq = (dq_parts.concat() - tf.gather(c, labels)) * inv_t
        dc = (dc - tf.math.unsorted_segment_sum(q, labels, m)) * inv_t

        def grad(upstream: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            return upstream * dq, upstream * dc

        return loss, grad

    return loss_fn(query, candidates)
