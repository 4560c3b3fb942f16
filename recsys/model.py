"""The two-tower retrieval model (TensorFlow Recommenders).

Ids are turned into integer indices outside the towers (in tf.data for training, in the
serving module for export) so the towers are plain numeric graphs that XLA can compile.
Index layout of both vocabularies: `[0, oov_buckets)` are hashed out-of-vocabulary buckets,
then the vocabulary file's ids in order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

import recsys  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from recsys.config import ModelConfig
from recsys.errors import StageNotReadyError

USER_INDEX = "user_index"
ITEM_INDEX = "item_index"
ITEM_LOG_PROB = "item_log_prob"


class Tower(tf.keras.Model):
    """One tower: `normalize(MLP(E[index]))`.

    E is a (vocabulary + oov) x d embedding table, the MLP is ReLU layers ending in a linear
    projection (or nothing), and the output is L2-normalised so that the dot product of two
    tower outputs is their cosine similarity.
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int,
        hidden_dims: Sequence[int] = (),
        l2: float = 0.0,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.hidden_dims = list(hidden_dims)
        self.l2 = l2
        regularizer = tf.keras.regularizers.l2(l2) if l2 > 0 else None
        self.embedding = tf.keras.layers.Embedding(
            vocab_size, embedding_dim, embeddings_regularizer=regularizer, name="embedding"
        )
        self.mlp = [
            tf.keras.layers.Dense(
                units,
                activation="relu" if i < len(self.hidden_dims) - 1 else None,
                name=f"dense_{i}",
            )
            for i, units in enumerate(self.hidden_dims)
        ]

    def call(self, indices: tf.Tensor) -> tf.Tensor:
        x = self.embedding(indices)
        for layer in self.mlp:
            x = layer(x)
        return tf.math.l2_normalize(tf.cast(x, tf.float32), axis=-1)

    def get_config(self) -> dict[str, object]:
        return {
            "vocab_size": self.vocab_size,
            "embedding_dim": self.embedding_dim,
            "hidden_dims": self.hidden_dims,
            "l2": self.l2,
            "name": self.name,
        }


class TwoTowerModel(tfrs.Model):
    """In-batch sampled-softmax retrieval.

    For a batch of (user, item) pairs with query vectors q_i and candidate vectors c_j the
    logits are `s_ij = q_i . c_j / temperature`, minus `log Q(j)` (the item's sampling
    probability) when logQ correction is on, and the loss is the softmax cross-entropy of the
    diagonal; other rows' items that equal the positive are masked (accidental hits).
    The logged `loss` is the mean per example over the epoch.
    """

    def __init__(self, query_tower: Tower, candidate_tower: Tower, config: ModelConfig) -> None:
        super().__init__()
        self.query_tower = query_tower
        self.candidate_tower = candidate_tower
        self.config = config
        self.task = tfrs.tasks.Retrieval(
            temperature=config.temperature,
            remove_accidental_hits=config.remove_accidental_hits,
        )
        self.loss_tracker = tf.keras.metrics.Mean(name="loss")

    @property
    def metrics(self) -> list[tf.keras.metrics.Metric]:
        return [self.loss_tracker]

    def compute_loss(self, features: dict[str, tf.Tensor], training: bool = False) -> tf.Tensor:
        query = self.query_tower(features[USER_INDEX])
        candidates = self.candidate_tower(features[ITEM_INDEX])
        log_q = features.get(ITEM_LOG_PROB) if self.config.logq_correction else None
        return self.task(
            query,
            candidates,
            candidate_sampling_probability=None if log_q is None else tf.exp(log_q),
            candidate_ids=features[ITEM_INDEX] if self.config.remove_accidental_hits else None,
            compute_metrics=False,
            compute_batch_metrics=False,
        )

    def _step(self, features: dict[str, tf.Tensor], train: bool) -> dict[str, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = self.compute_loss(features, training=train)
            total = loss + tf.add_n(self.losses) if self.losses else loss
        if train:
            grads = tape.gradient(total, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        batch = tf.cast(tf.shape(features[ITEM_INDEX])[0], tf.float32)
        self.loss_tracker.update_state(loss / batch, sample_weight=batch)
        return {"loss": self.loss_tracker.result()}

    def train_step(self, features: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return self._step(features, train=True)

    def test_step(self, features: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return self._step(features, train=False)


def read_vocab(path: Path) -> list[str]:
    """One id per line, in index order."""
    return path.read_text(encoding="utf-8").splitlines()


def string_lookup(vocab: Sequence[str], oov_buckets: int) -> tf.keras.layers.StringLookup:
    """Raw id string -> index, unknown ids hashed into the first `oov_buckets` indices."""
    return tf.keras.layers.StringLookup(
        vocabulary=list(vocab), num_oov_indices=oov_buckets, mask_token=None
    )


@dataclass
class TrainedModel:
    """A trained pair of towers with the vocabularies that index them."""

    users: list[str]
    items: list[str]
    config: ModelConfig
    query_tower: Tower
    candidate_tower: Tower

    @classmethod
    def build(cls, users: list[str], items: list[str], config: ModelConfig) -> TrainedModel:
        """Fresh (untrained) towers sized for the vocabularies."""
        oov = config.oov_buckets
        query = Tower(
            len(users) + oov,
            config.embedding_dim,
            config.hidden_dims,
            config.l2_regularization,
            name="query_tower",
        )
        cand = Tower(
            len(items) + oov,
            config.embedding_dim,
            config.hidden_dims,
            config.l2_regularization,
            name="candidate_tower",
        )
        query(tf.zeros([1], tf.int64))
        cand(tf.zeros([1], tf.int64))
        return cls(users, items, config, query, cand)

    def user_lookup(self) -> tf.keras.layers.StringLookup:
        return string_lookup(self.users, self.config.oov_buckets)

    def item_lookup(self) -> tf.keras.layers.StringLookup:
        return string_lookup(self.items, self.config.oov_buckets)

    def item_indices(self) -> np.ndarray:
        """Indices of the catalog's items (vocabulary order), OOV buckets excluded."""
        oov = self.config.oov_buckets
        return np.arange(oov, oov + len(self.items), dtype=np.int64)

    def item_embeddings(self, batch_size: int = 65536) -> np.ndarray:
        """[num_items, d] float32 candidate vectors in vocabulary order."""
        idx = self.item_indices()
        parts = [
            self.candidate_tower(idx[i : i + batch_size]).numpy()
            for i in range(0, len(idx), batch_size)
        ]
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros((0, 0), np.float32)

    def user_embeddings(self, user_ids: Sequence[str], batch_size: int = 65536) -> np.ndarray:
        """[len(user_ids), d] float32 query vectors for raw user ids (unknown ids hashed)."""
        lookup = self.user_lookup()
        parts = []
        for i in range(0, len(user_ids), batch_size):
            indices = lookup(tf.constant(list(user_ids[i : i + batch_size])))
            parts.append(self.query_tower(indices).numpy())
        dim = (
            self.config.embedding_dim
            if not self.config.hidden_dims
            else self.config.hidden_dims[-1]
        )
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros((0, dim), np.float32)

    def save(self, path: Path) -> None:
        """Weights (TF checkpoints), vocabularies and model config under `path`."""
        path.mkdir(parents=True, exist_ok=True)
        (path / "users.txt").write_text("\n".join(self.users) + "\n", encoding="utf-8")
        (path / "items.txt").write_text("\n".join(self.items) + "\n", encoding="utf-8")
        (path / "model.json").write_text(json.dumps(self.config.model_dump(), indent=2))
        self.query_tower.save_weights(str(path / "query" / "weights"))
        self.candidate_tower.save_weights(str(path / "candidate" / "weights"))

    @classmethod
    def load(cls, path: Path) -> TrainedModel:
        """Rebuild the towers saved by `save` and restore their weights."""
        if not (path / "model.json").is_file():
            raise StageNotReadyError(f"no trained model at {path}: run `recsys train` first")
        config = ModelConfig.model_validate(json.loads((path / "model.json").read_text()))
        model = cls.build(read_vocab(path / "users.txt"), read_vocab(path / "items.txt"), config)
        model.query_tower.load_weights(str(path / "query" / "weights")).expect_partial()
        model.candidate_tower.load_weights(str(path / "candidate" / "weights")).expect_partial()
        return model
