"""Small building blocks shared by both towers: pooling, MLP, output, tables, baked features."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

Baked = dict[str, tuple[np.ndarray, int]]
"""Feature name -> (constant [rows, width] token-index table, token vocabulary size)."""


def masked_mean(embedding: tf.keras.layers.Layer, ids: tf.Tensor) -> tf.Tensor:
    """`sum_j 1[ids_j >= 0] E[ids_j] / max(1, #valid)` over the last axis of `ids`."""
    valid = ids >= 0
    vectors = embedding(tf.where(valid, ids, tf.zeros_like(ids)))
    mask = tf.cast(valid, vectors.dtype)[..., None]
    count = tf.maximum(tf.reduce_sum(mask, axis=-2), tf.ones([], vectors.dtype))
    return tf.reduce_sum(vectors * mask, axis=-2) / count


def mlp(hidden_dims: Sequence[int]) -> list[tf.keras.layers.Layer]:
    """ReLU layers ending in a linear projection (an empty list: no MLP)."""
    return [
        tf.keras.layers.Dense(
            units, activation="relu" if i < len(hidden_dims) - 1 else None, name=f"dense_{i}"
        )
        for i, units in enumerate(hidden_dims)
    ]


def tower_output(x: tf.Tensor, normalize: bool = True) -> tf.Tensor:
    """A tower's float32 output, L2-normalised unless `model.normalize` is false."""
    x = tf.cast(x, tf.float32)
    return tf.math.l2_normalize(x, axis=-1) if normalize else x


def embedding(rows: int, dim: int, l2: float, name: str) -> tf.keras.layers.Embedding:
    """A `rows x dim` table, L2-penalised when `l2` > 0."""
    regularizer = tf.keras.regularizers.l2(l2) if l2 > 0 else None
    return tf.keras.layers.Embedding(rows, dim, embeddings_regularizer=regularizer, name=name)


def bake_features(tower: tf.keras.Model, features: Baked | None, dim: int, l2: float) -> None:
    """Give `tower` each feature's token table (a non-trainable variable) and token embedding.

    The attribute and weight names are checkpoint keys (`feature_ids`, `feature_embeddings`).
    """
    tower.feature_names = sorted(features or {})
    tower.feature_ids = {}
    tower.feature_embeddings = {}
    for name in tower.feature_names:
        table, size = (features or {})[name]
        tower.feature_ids[name] = tower.add_weight(
            name=f"{name}_ids",
            shape=table.shape,
            dtype=tf.int32,
            initializer=tf.constant_initializer(table),
            trainable=False,
        )
        tower.feature_embeddings[name] = embedding(max(size, 1), dim, l2, f"{name}_embedding")
