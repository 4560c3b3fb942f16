"""The two towers: a query tower (user, history, user features) and a candidate tower (item,
item features), each ending in an optional MLP and an L2 normalisation."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from recsys.model.encoders import EncoderSpec, GRUEncoder, TransformerEncoder, prefix_mean
from recsys.model.inputs import HISTORY_INDEX, ITEM_INDEX, USER_INDEX, feature_index
from recsys.model.layers import Baked, bake_features, embedding, masked_mean, mlp, tower_output


class _Tower(tf.keras.Model):
    """What both towers end with: `normalize(MLP(x))` (attributes `mlp`, `normalize`)."""

    mlp: list[tf.keras.layers.Layer]
    normalize: bool

    def finish(self, x: tf.Tensor) -> tf.Tensor:
        """The MLP, then the float32 (L2-normalised) output."""
        for layer in self.mlp:
            x = layer(x)
        return tower_output(x, self.normalize)

    def get_config(self) -> dict[str, object]:
        # Rebuilt from model.json by TrainedModel.load, never from a Keras config.
        return {"name": self.name}


class QueryTower(_Tower):
    """`q = normalize(MLP(U[u] + enc(H(u)) + sum_f A_f[a_f(u)]))`.

    U is the (users + oov) x d user table (with `user_embedding` off there is none: the term
    is 0); H(u) the user's last `history_length` items (index PAD ignored; an empty history
    adds the zero vector); enc is `mean_{j in H(u)} V[j]`, or with
    `encoder` "transformer" causal self-attention over the ordered H(u) read at the latest item,
    with "gru" a GRU's final state over it (`recsys.model.encoders`), plus
    `mean_{j in H(u)} V[j]` when `history_mean` is on (order-free taste beside the ordered
    encoding; no extra weights); V is the candidate tower's
    item table when `item_embedding` is given (shared), else the tower's own table of
    `num_items` rows.
    For each user side feature f (age bucket, gender, occupation, ...) a_f(u) is the user's
    token, baked into the tower by user index like the candidate tower's item features (a user
    without one, or an out-of-vocabulary user, adds nothing).
    """

    def __init__(
        self,
        num_users: int,
        embedding_dim: int,
        hidden_dims: Sequence[int] = (),
        l2: float = 0.0,
        history_length: int = 0,
        item_embedding: tf.keras.layers.Embedding | None = None,
        num_items: int = 0,
        normalize: bool = True,
        features: Baked | None = None,
        encoder: EncoderSpec | None = None,
        user_embedding: bool = True,
        history_mean: bool = False,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        self.history_length = history_length
        self.history_mean = history_mean
        self.normalize = normalize
        self.embedding_dim = embedding_dim
        # Attribute names are checkpoint keys: `embedding` as in the first (ids-only) towers.
        self.embedding = (
            embedding(num_users, embedding_dim, l2, "embedding") if user_embedding else None
        )
        self.shares_item_embedding = item_embedding is not None
        self.history_embedding = None
        if history_length:
            self.history_embedding = item_embedding or embedding(
                num_items, embedding_dim, l2, "history_embedding"
            )
        # Only for a sequence encoder: mean-pooling towers keep their checkpoint keys.
        if history_length and encoder is not None and encoder.kind == "transformer":
            self.encoder = TransformerEncoder(
                self.history_embedding,
                history_length,
                embedding_dim,
                encoder.layers,
                encoder.heads,
                encoder.dropout,
                relative=encoder.positions == "relative",
                name="encoder",
            )
        elif history_length and encoder is not None and encoder.kind == "gru":
            self.encoder = GRUEncoder(
                self.history_embedding, embedding_dim, encoder.dropout, name="encoder"
            )
        if features:  # only then: towers without user features keep their checkpoint keys
            bake_features(self, features, embedding_dim, l2)
        self.mlp = mlp(hidden_dims)

    def call(self, inputs: dict[str, tf.Tensor], training: bool | None = None) -> tf.Tensor:
        users = inputs[USER_INDEX]
        if self.embedding is not None:
            x = self.embedding(users)
        else:
            x = tf.zeros([tf.shape(users)[0], self.embedding_dim], self.compute_dtype)
        if self.history_embedding is not None and HISTORY_INDEX in inputs:
            history = inputs[HISTORY_INDEX]
            encoder = getattr(self, "encoder", None)
            if encoder is None or self.history_mean:
                x = x + masked_mean(self.history_embedding, history)
            if encoder is not None:
                x = x + tf.cast(encoder(history, training=training), x.dtype)
        features = self._user_features(users)
        return self.finish(x if features is None else x + features)

    def sequence(self, inputs: dict[str, tf.Tensor], training: bool | None = None) -> tf.Tensor:
        """[n, L, d]: the query vector at every position of right-aligned history windows.

        Position t's vector is the query for the history up to t (one causal pass:
        `recsys.model.encoders`); user terms are the same at every position.
        """
        users, history = inputs[USER_INDEX], inputs[HISTORY_INDEX]
        shape = tf.concat([tf.shape(history), [self.embedding_dim]], 0)
        x = tf.zeros(shape, self.compute_dtype)
        if self.embedding is not None:
            x = x + self.embedding(users)[:, None, :]
        if self.history_embedding is not None:
            encoder = getattr(self, "encoder", None)
            if encoder is None or self.history_mean:
                x = x + prefix_mean(self.history_embedding, history)
            if encoder is not None:
                x = x + tf.cast(encoder.sequence(history, training=training), x.dtype)
        features = self._user_features(users)
        return self.finish(x if features is None else x + features[:, None, :])

    def _user_features(self, users: tf.Tensor) -> tf.Tensor | None:
        """[n, d]: the sum of the user's side-feature token vectors (None: no user features)."""
        total = None
        for name in getattr(self, "feature_names", ()):
            ids = tf.gather(self.feature_ids[name], users)
            vector = masked_mean(self.feature_embeddings[name], ids)
            total = vector if total is None else total + vector
        return total


class CandidateTower(_Tower):
    """`c = normalize(MLP(V[i] + sum_f mean_{t in F_f(i)} W_f[t]))`.

    V is the (items + oov) x d item table; for each item feature f (genres, title tokens) the
    per-item token indices F_f are a constant [items + oov, width] table baked into the tower
    (a non-trainable variable), so the whole catalog embeds from item indices alone. Called
    with a dict instead, `{ITEM_INDEX: i, feature_index(f): F_f}` supplies the token indices
    of some features (an item unknown to the catalog, or with new features); the others
    still come from the table.
    """

    def __init__(
        self,
        num_items: int,
        embedding_dim: int,
        hidden_dims: Sequence[int] = (),
        l2: float = 0.0,
        features: Baked | None = None,
        normalize: bool = True,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        self.normalize = normalize
        self.embedding = embedding(num_items, embedding_dim, l2, "embedding")
        bake_features(self, features, embedding_dim, l2)
        self.mlp = mlp(hidden_dims)

    def call(self, inputs: tf.Tensor | dict[str, tf.Tensor]) -> tf.Tensor:
        given = inputs if isinstance(inputs, dict) else {ITEM_INDEX: inputs}
        indices = given[ITEM_INDEX]
        x = self.embedding(indices)
        for name in self.feature_names:
            ids = given.get(feature_index(name))
            if ids is None:
                ids = tf.gather(self.feature_ids[name], indices)
            x = x + masked_mean(self.feature_embeddings[name], ids)
        return self.finish(x)
