"""Sequence encoders of the query tower: the user's recent items -> one vector.

`mean` (`masked_mean` over the item table) ignores order. `transformer` is causal
self-attention over the ordered history, as in SASRec (Kang & McAuley, 2018):

    ids are right-aligned so the latest item sits at position L-1 (a position = recency)
    x_t   = sqrt(d) V[h_t] + P[t]                        (V: the item table, P: learned positions)
    (a window narrower than L takes P's last slots, so the latest item always has P[L-1])
    (`encoder_positions: relative`: no P; each attention adds a learned bias b[t - s] per head
    and distance to its scores, recsys/model/attention.py)
    block = x + Drop(MHA(LN(x), mask)) ; x + Drop(FFN(LN(x)))   (pre-LN, FFN = ReLU(xW1)W2)
    mask  = {(t, s): s <= t and h_s is an item} (plus t = s, so no row is empty)
    out_t = LN(block^k(x))_t,                             encoder(h) = out_{L-1} 1[|h| > 0]

Output t depends on items at positions <= t only (causal), padding never enters a real
position's output, and an empty history encodes to the zero vector like the mean.

`gru` is a recurrence over the same ordered history, as in GRU4Rec (Hidasi et al., 2016):

    ids stay left-aligned: h_1 .. h_n are the n = |h| items, oldest first, then PAD
    x_t   = Drop(V[h_t]) ;  s_t = GRU(s_{t-1}, x_t),  s_0 = 0   (Keras GRU, units d)
    encoder(h) = LN(s_n) 1[n > 0]                         (PAD steps masked: s carries over)

Order matters through the recurrence (no positions), s_n sees h_1 .. h_n only, and padding
never updates the state, so the same items give the same vector whatever the fill.

One causal pass (training): every encoder also has `sequence(ids)`, which takes a window of
right-aligned ids (PAD first) and returns the output at every position t, computed from the
items at positions <= t only: the transformer's causal mask, the GRU's state after step t, and
for mean pooling the prefix mean `sum_{s<=t} V[h_s] / |{s<=t: h_s is an item}|` (prefix
sums). Position t's output is what `call` returns for the history h_1 .. h_t (for the
transformer with relative positions; with absolute ones a prefix sits at the window's slots,
not at its end), so a whole sequence trains every position at the cost of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tensorflow as tf

from recsys.core.config import ModelConfig
from recsys.model.attention import RelativeAttention


@dataclass(frozen=True)
class EncoderSpec:
    """Which history encoder a query tower uses, and its shape (layers, heads: transformer)."""

    kind: str = "mean"
    layers: int = 2
    heads: int = 1
    dropout: float = 0.2
    positions: str = "absolute"  # transformer: absolute slot embeddings, or relative bias

    @classmethod
    def from_config(cls, config: ModelConfig) -> EncoderSpec:
        """The encoder settings of a `ModelConfig`."""
        return cls(
            config.query_encoder,
            config.encoder_layers,
            config.encoder_heads,
            config.encoder_dropout,
            config.encoder_positions,
        )


def right_align(ids: tf.Tensor) -> tf.Tensor:
    """[n, L] ids left-aligned and PAD (-1)-filled -> the same ids ending at position L-1."""
    length = tf.shape(ids)[1]
    valid = tf.reduce_sum(tf.cast(ids >= 0, tf.int32), axis=1, keepdims=True)
    # Row r's position t reads source column t - (L - valid_r); negative columns are padding.
    source = tf.range(length)[None, :] - (length - valid)
    gathered = tf.gather(ids, tf.maximum(source, 0), axis=1, batch_dims=1)
    return tf.where(source >= 0, gathered, tf.constant(-1, ids.dtype))


def prefix_mean(embedding: tf.keras.layers.Layer, ids: tf.Tensor) -> tf.Tensor:
    """[n, L, d]: at each position, the mean of the item vectors at positions <= t (0: none)."""
    valid = ids >= 0
    vectors = embedding(tf.where(valid, ids, tf.zeros_like(ids)))
    mask = tf.cast(valid, vectors.dtype)[..., None]
    sums = tf.cumsum(vectors * mask, axis=1)
    counts = tf.cumsum(mask, axis=1)
    return sums / tf.maximum(counts, tf.ones([], vectors.dtype))


class TransformerEncoder(tf.keras.layers.Layer):
    """Causal self-attention over an item sequence (see the module docstring for the maths)."""

    def __init__(
        self,
        item_embedding: tf.keras.layers.Embedding,
        max_length: int,
        dim: int,
        num_layers: int = 2,
        num_heads: int = 1,
        dropout: float = 0.2,
        relative: bool = False,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        self.item_embedding = item_embedding
        self.scale = math.sqrt(dim)
        # Relative: no slot embeddings; each block's attention has a bias per distance.
        self.positions = None
        if not relative:
            self.positions = self.add_weight(
                name="positions",
                shape=(max_length, dim),
                initializer=tf.keras.initializers.RandomNormal(stddev=0.02),
            )
        self.dropout = tf.keras.layers.Dropout(dropout)
        distance = max_length if relative else None
        self.blocks = [
            _Block(dim, num_heads, dropout, distance, name=f"block_{i}") for i in range(num_layers)
        ]
        self.norm = tf.keras.layers.LayerNormalization(epsilon=1e-6, name="final_norm")

    def _inputs(
        self, ids: tf.Tensor, training: bool | None
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """Embedded right-aligned ids, their [n, L, 1] validity mask, the [n, L, L] attend mask."""
        valid = ids >= 0
        x = self.item_embedding(tf.where(valid, ids, tf.zeros_like(ids)))
        mask = tf.cast(valid, x.dtype)[..., None]
        x = x * self.scale
        length = tf.shape(ids)[1]
        if self.positions is not None:
            # The last `length` slot embeddings: the latest item keeps slot L-1's whatever
            # the window's width, so a history trimmed of its padding encodes the same.
            positions = self.positions[tf.shape(self.positions)[0] - length :]
            x = x + tf.cast(positions, x.dtype)[None]
        x = x * mask
        causal = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)
        eye = tf.cast(tf.eye(length), tf.bool)
        attend = tf.logical_or(tf.logical_and(causal[None], valid[:, None, :]), eye[None])
        return self.dropout(x, training=training), mask, attend

    def sequence(self, ids: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        """[n, L, d] per-position outputs of right-aligned ids (PAD = -1 at the start)."""
        x, mask, attend = self._inputs(ids, training)
        for block in self.blocks:
            x = block(x, attend, training=training) * mask
        return self.norm(x) * mask

    def call(self, ids: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        """[n, d]: the output at the latest item of each left-aligned, PAD-filled history.

        Equals `sequence(right_align(ids))[:, -1]`, but the last block computes only the
        latest position (its keys and values still cover every position): ~half the cost.
        """
        x, mask, attend = self._inputs(right_align(ids), training)
        for block in self.blocks[:-1]:
            x = block(x, attend, training=training) * mask
        last = self.blocks[-1](x, attend, training=training, latest_only=True)
        return self.norm(last)[:, 0] * mask[:, -1]


class GRUEncoder(tf.keras.layers.Layer):
    """A GRU over the ordered history, read at the latest item (see the module docstring)."""

    def __init__(
        self,
        item_embedding: tf.keras.layers.Embedding,
        dim: int,
        dropout: float = 0.2,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        self.item_embedding = item_embedding
        self.dropout = tf.keras.layers.Dropout(dropout)
        # Defaults only (tanh, sigmoid, reset_after, no recurrent dropout): Keras picks cuDNN
        # on a GPU when the mask allows it and the generic kernel otherwise (and on CPU).
        # Every step's state is returned (the weights do not depend on it): `call` reads the
        # last item's, `sequence` all of them.
        self.gru = tf.keras.layers.GRU(dim, return_sequences=True, name="gru")
        self.norm = tf.keras.layers.LayerNormalization(epsilon=1e-6, name="final_norm")

    def _states(self, ids: tf.Tensor, training: bool | None) -> tuple[tf.Tensor, tf.Tensor]:
        """[n, L, d] states after each step and the [n, L] validity of `ids` (PAD steps skip)."""
        valid = ids >= 0
        x = self.item_embedding(tf.where(valid, ids, tf.zeros_like(ids)))
        x = self.dropout(x * tf.cast(valid, x.dtype)[..., None], training=training)
        some = tf.reduce_any(valid, axis=1, keepdims=True)
        # An all-masked row sends the whole batch to the slow kernel (cuDNN rejects it): an
        # empty history runs one step on a zero input instead, and is zeroed by the caller.
        first = tf.range(tf.shape(ids)[1])[None, :] == 0
        steps = tf.logical_or(valid, tf.logical_and(first, tf.logical_not(some)))
        return self.gru(x, mask=steps, training=training), valid

    def call(self, ids: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        """[n, d]: the final state over each left-aligned, PAD-filled history (0 if empty)."""
        states, valid = self._states(ids, training)
        count = tf.reduce_sum(tf.cast(valid, tf.int32), axis=1)
        # Normalised per step before the gather: the layer norm is always built on [n, L, d].
        state = tf.gather(self.norm(states), tf.maximum(count - 1, 0), axis=1, batch_dims=1)
        return state * tf.cast(count > 0, state.dtype)[:, None]

    def sequence(self, ids: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        """[n, L, d] per-position outputs of right-aligned ids (PAD = -1 at the start).

        PAD steps come first and leave the zero initial state unchanged, so position t holds
        the state after the items up to t; PAD positions output 0. (On a GPU, cuDNN takes
        only masks whose PAD steps come last: this path runs the generic kernel there.)
        """
        states, valid = self._states(ids, training)
        return self.norm(states) * tf.cast(valid, states.dtype)[..., None]


class _Block(tf.keras.layers.Layer):
    """One pre-LN transformer block: `x + Drop(MHA(LN x))`, then `x + Drop(FFN(LN x))`."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        dropout: float,
        max_distance: int | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        self.attention_norm = tf.keras.layers.LayerNormalization(epsilon=1e-6)
        if max_distance is None:
            self.attention = tf.keras.layers.MultiHeadAttention(
                num_heads, key_dim=dim // num_heads, dropout=dropout
            )
        else:
            self.attention = RelativeAttention(
                num_heads, dim // num_heads, max_distance, dropout=dropout
            )
        self.ffn_norm = tf.keras.layers.LayerNormalization(epsilon=1e-6)
        self.ffn_in = tf.keras.layers.Dense(dim, activation="relu")
        self.ffn_out = tf.keras.layers.Dense(dim)
        self.dropout = tf.keras.layers.Dropout(dropout)

    def call(
        self,
        x: tf.Tensor,
        attend: tf.Tensor,
        training: bool | None = None,
        latest_only: bool = False,
    ) -> tf.Tensor:
        """[n, L, d] -> [n, L, d]; with `latest_only`, [n, 1, d]: the last position only."""
        h = self.attention_norm(x)
        if latest_only:
            x, query, attend = x[:, -1:], h[:, -1:], attend[:, -1:]
        else:
            query = h
        x = x + self.dropout(
            self.attention(query, h, attention_mask=attend, training=training), training=training
        )
        h = self.ffn_out(self.dropout(self.ffn_in(self.ffn_norm(x)), training=training))
        return x + self.dropout(h, training=training)
