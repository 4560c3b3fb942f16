"""The inference API: a trained pair of towers with the vocabularies and tables that index them.

`TrainedModel` builds fresh towers for a config, embeds raw user ids + histories and raw items
(ids, optionally their features) into vectors scored by dot product, and saves / loads itself
in the format of `recsys.model.storage`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tensorflow as tf

from recsys.core.config import ModelConfig
from recsys.item_tokens import PAD, TOKENIZERS
from recsys.model import storage
from recsys.model.encoders import EncoderSpec
from recsys.model.features import ItemFeatures, UserFeatures
from recsys.model.inputs import (
    HISTORY_INDEX,
    ITEM_INDEX,
    USER_INDEX,
    feature_index,
    pad_histories,
    read_vocab,
    string_lookup,
)
from recsys.model.towers import CandidateTower, QueryTower

# Rows per tower call: the query tower's largest activations are [rows, history_length, width]
# (attention adds [rows, heads, length, length]), and a fixed 65,536 rows held ~2.7 GB more
# while encoding. A budget of 2**25 elements per [rows, length, width] tensor (128 MiB in
# float32; 26,214 rows at length 20 and width 64) encoded more users per second than 65,536
# rows there, in ~0.1 GB (benchmarks/encode_rows.py, docs/BENCHMARKS.md).
ENCODE_ELEMENTS = 2**25
MAX_ENCODE_ROWS = 65_536


@dataclass
class TrainedModel:
    """A trained pair of towers with the vocabularies (and item features) that index them."""

    users: list[str]
    items: list[str]
    config: ModelConfig
    query_tower: QueryTower
    candidate_tower: CandidateTower
    item_features: ItemFeatures = field(default_factory=ItemFeatures)
    user_features: UserFeatures = field(default_factory=UserFeatures)
    _encode: Callable[[dict[str, tf.Tensor]], tf.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def build(
        cls,
        users: list[str],
        items: list[str],
        config: ModelConfig,
        item_features: ItemFeatures | None = None,
        user_features: UserFeatures | None = None,
    ) -> TrainedModel:
        """Fresh (untrained) towers sized for the vocabularies (under the current dtype policy)."""
        if config.user_embedding == "auto":
            raise ValueError("model.user_embedding 'auto' must be resolved before building")
        oov = config.oov_buckets
        item_features = item_features if config.item_features and item_features else ItemFeatures()
        user_features = user_features if config.user_features and user_features else UserFeatures()
        dims = (config.embedding_dim, config.hidden_dims, config.l2_regularization)
        cand = CandidateTower(
            len(items) + oov,
            *dims,
            features=item_features.baked(oov),
            normalize=config.normalize,
            name="candidate_tower",
        )
        query = QueryTower(
            len(users) + oov,
            *dims,
            history_length=config.history_length,
            item_embedding=cand.embedding if config.share_item_embeddings else None,
            num_items=len(items) + oov,
            normalize=config.normalize,
            features=user_features.baked(oov),
            encoder=EncoderSpec.from_config(config),
            user_embedding=config.user_embedding,
            history_mean=config.history_mean,
            name="query_tower",
        )
        query(_dummy_query(config))
        cand(tf.zeros([1], tf.int64))
        return cls(users, items, config, query, cand, item_features, user_features)

    def user_lookup(self) -> tf.keras.layers.StringLookup:
        return string_lookup(self.users, self.config.oov_buckets)

    def item_lookup(self) -> tf.keras.layers.StringLookup:
        return string_lookup(self.items, self.config.oov_buckets)

    @property
    def normalization(self) -> str:
        """What the towers' outputs are: "l2" (unit vectors, scores in [-1, 1]) or "none"."""
        return "l2" if self.config.normalize else "none"

    @property
    def output_dim(self) -> int:
        """Width of both towers' outputs."""
        hidden = self.config.hidden_dims
        return hidden[-1] if hidden else self.config.embedding_dim

    def encode_rows(self, columns: int | None = None) -> int:
        """Rows per query-tower call: ENCODE_ELEMENTS over one row's history activations
        (`columns` history slots; None: the whole `history_length`)."""
        width = self.config.history_length if columns is None else columns
        per_row = max(width, 1) * max(self.config.embedding_dim, 1)
        return max(64, min(MAX_ENCODE_ROWS, ENCODE_ELEMENTS // per_row))

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
        return (
            np.concatenate(parts).astype(np.float32)
            if parts
            else np.zeros((0, self.output_dim), np.float32)
        )

    def candidate_embeddings(
        self, item_ids: Sequence[str], features: Mapping[str, Sequence[object]] | None = None
    ) -> np.ndarray:
        """[n, d] candidate vectors of raw items: ids (unknown: an OOV bucket) and features.

        `features` maps GENRES / TITLE to one raw value per item (a genre list, a title). A
        value without tokens (None, [], "") takes the catalog's tokens for that id (none for an
        unknown id), so ids alone give the catalog's vectors; features the model was trained
        without are ignored. The candidate SavedModel computes the same in its graph.
        """
        if not item_ids:
            return np.zeros((0, self.output_dim), np.float32)
        indices = self.item_lookup()(tf.constant(list(item_ids), tf.string))
        inputs = {ITEM_INDEX: indices}
        for name, table in self.candidate_tower.feature_ids.items():
            if features is None or name not in features:
                continue
            tokens = [TOKENIZERS[name](value) for value in features[name]]
            given = np.array([bool(t) for t in tokens])[:, None]
            catalog = tf.gather(table, indices).numpy()
            ids = np.where(given, self.item_features.token_ids(name, tokens), catalog)
            inputs[feature_index(name)] = tf.constant(ids)
        return self.candidate_tower(inputs).numpy().astype(np.float32)

    def user_embeddings(
        self,
        user_ids: Sequence[str],
        histories: Sequence[Sequence[str | bytes]] | None = None,
        batch_size: int | None = None,
    ) -> np.ndarray:
        """[len(user_ids), d] float32 query vectors for raw user ids and their item histories.

        Unknown user ids hash to OOV buckets; `histories` (oldest first, one per user; None:
        all empty) keep their last `history_length` ids, unknown item ids hashing to OOV.
        """
        if histories is not None and len(histories) != len(user_ids):
            raise ValueError(f"{len(histories)} histories for {len(user_ids)} users")
        history = None
        if histories is not None and self.config.history_length:
            history = pad_histories(histories, self.item_lookup(), self.config.history_length)
        return self.query_embeddings(self.user_indices(user_ids), history, batch_size)

    def user_indices(self, user_ids: Sequence[str]) -> np.ndarray:
        """[len(user_ids)] int64 user-tower indices of raw ids (unknown ids: OOV buckets)."""
        ids = tf.constant(list(user_ids), tf.string) if len(user_ids) else tf.zeros([0], tf.string)
        return self.user_lookup()(ids).numpy()

    def query_embeddings(
        self,
        user_index: np.ndarray,
        history_index: np.ndarray | None = None,
        batch_size: int | None = None,
    ) -> np.ndarray:
        """[n, d] float32 query vectors of already looked-up inputs: user indices and
        [n, history_length] item-index histories (oldest first, PAD after; None: empty).

        Rows are encoded in groups of equal history width (the slots up to the last item),
        each trimmed to that width: every encoder ignores the PAD slots after the last item
        (tests/test_sequence_model.py), so on a log of short histories most of the padded
        work is skipped. `batch_size`: rows per tower call (default: `encode_rows`).
        """
        user_index = np.asarray(user_index, np.int64)
        out = np.zeros((len(user_index), self.output_dim), np.float32)
        for rows, width in history_groups(history_index, len(user_index)):
            step = batch_size or self.encode_rows(width)
            for i in range(0, len(rows), step):
                chunk = rows[i : i + step]
                inputs = {USER_INDEX: tf.constant(user_index[chunk], tf.int64)}
                if self.config.history_length:
                    if history_index is None:
                        hist = np.full((len(chunk), 1), PAD, np.int64)
                    else:
                        hist = history_index[chunk, : max(width, 1)]
                    inputs[HISTORY_INDEX] = tf.constant(hist, tf.int64)
                out[chunk] = self._query_graph()(inputs).numpy().astype(np.float32)
        return out

    def _query_graph(self) -> Callable[[dict[str, tf.Tensor]], tf.Tensor]:
        """The query tower for inference as one graph traced once for any rows and width:
        eager Keras calls took 1.6-1.8x as long (benchmarks/query_encoding.py)."""
        if self._encode is None:
            spec = {USER_INDEX: tf.TensorSpec([None], tf.int64)}
            if self.config.history_length:
                spec[HISTORY_INDEX] = tf.TensorSpec([None, None], tf.int64)
            tower = self.query_tower
            self._encode = tf.function(
                lambda inputs: tower(inputs, training=False), input_signature=[spec]
            )
        return self._encode

    def save(self, path: Path) -> None:
        """Weights (TF checkpoints), vocabularies, item features and model config under `path`."""
        storage.write_model(
            path,
            self.users,
            self.items,
            self.config,
            (self.item_features, self.user_features),
            self._towers(),
        )

    @classmethod
    def load(cls, path: Path) -> TrainedModel:
        """Rebuild the towers saved by `save` and restore their weights."""
        config = storage.read_config(path)
        model = cls.build(
            read_vocab(path / storage.USERS),
            read_vocab(path / storage.ITEMS),
            config,
            ItemFeatures.load(path),
            UserFeatures.load(path),
        )
        storage.restore_weights(path, model._towers())
        return model

    def _towers(self) -> dict[str, tf.keras.Model]:
        return {"query": self.query_tower, "candidate": self.candidate_tower}


def history_groups(history_index: np.ndarray | None, rows: int) -> list[tuple[np.ndarray, int]]:
    """(row indices, width) groups of the rows whose left-aligned histories end at the same
    slot (width: the slots up to the last item, 0 for an empty history), in row order."""
    if not rows:
        return []
    if history_index is None or not history_index.shape[-1]:
        return [(np.arange(rows), 0)]
    slots = np.arange(1, history_index.shape[1] + 1)
    width = np.max(np.where(history_index != PAD, slots[None, :], 0), axis=1)
    order = np.argsort(width, kind="stable")
    widths, starts = np.unique(width[order], return_index=True)
    bounds = [*starts[1:], len(order)]
    return [(order[lo:hi], int(w)) for w, lo, hi in zip(widths, starts, bounds, strict=True)]


def _dummy_query(config: ModelConfig) -> dict[str, tf.Tensor]:
    inputs = {USER_INDEX: tf.zeros([1], tf.int64)}
    if config.history_length:
        inputs[HISTORY_INDEX] = tf.fill([1, config.history_length], tf.constant(PAD, tf.int64))
    return inputs
