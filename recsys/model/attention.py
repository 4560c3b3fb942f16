"""Causal self-attention with a learned bias per distance (relative positions).

The one adapter to a non-public tf_keras hook: `MultiHeadAttention._compute_attention`, which
its docstring offers for overriding ("Users can override this function for customized
attention implementation"). The projections stay Keras' (same variables, same checkpoint
keys as `MultiHeadAttention`); only the score computation is ours:

    a_ts = softmax_s( q_t . k_s / sqrt(d_k) + b_h[t - s] )      (masked: s <= t, s an item)

with one learned bias per head and distance 0 .. max_distance - 1 (T5's relative attention
bias, without buckets). Scores then depend on how far back an item is, never on its slot in
the window, so a prefix encoded inside a longer window gives exactly the vector it gets
encoded alone at the end of a window: what one-pass training needs to match the per-prefix
query that serving computes. tests/test_relative_attention.py fails loudly if a tf_keras
upgrade stops routing `call` through the hook.
"""

from __future__ import annotations

import math

import tensorflow as tf


class RelativeAttention(tf.keras.layers.MultiHeadAttention):
    """`MultiHeadAttention` whose scores add a learned bias per head and distance.

    Queries are the last T of the S key positions (T = S, or T = 1 when only the latest
    position is computed), so query t sits at key position S - T + t.
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        max_distance: int,
        dropout: float = 0.0,
        **kwargs: object,
    ) -> None:
        super().__init__(num_heads, key_dim=key_dim, dropout=dropout, **kwargs)
        self.max_distance = max_distance
        self.head_scale = 1.0 / math.sqrt(float(key_dim))
        self.distance_bias = self.add_weight(
            name="distance_bias", shape=(num_heads, max_distance), initializer="zeros"
        )
        self.score_dropout = tf.keras.layers.Dropout(dropout)

    def _compute_attention(
        self,
        query: tf.Tensor,
        key: tf.Tensor,
        value: tf.Tensor,
        attention_mask: tf.Tensor | None = None,
        training: bool | None = None,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """[B, T, N, H] projected queries against [B, S, N, H] keys and values."""
        scores = tf.einsum("bsnh,btnh->bnts", key, query * self.head_scale)
        t, s = tf.shape(query)[1], tf.shape(key)[1]
        distance = (s - t + tf.range(t))[:, None] - tf.range(s)[None, :]
        distance = tf.clip_by_value(distance, 0, self.max_distance - 1)
        bias = tf.gather(tf.cast(self.distance_bias, scores.dtype), distance, axis=1)
        scores += bias[None]  # [1, N, T, S]
        if attention_mask is not None:
            # Masked scores get the dtype's lowest value (a mixed-precision safe -inf).
            floor = tf.cast(scores.dtype.min, scores.dtype)
            scores = tf.where(attention_mask[:, None], scores, floor)
        weights = tf.nn.softmax(scores, axis=-1)
        dropped = self.score_dropout(weights, training=training)
        return tf.einsum("bnts,bsnh->btnh", dropped, value), weights
