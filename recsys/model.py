"""The two-tower retrieval model (TensorFlow Recommenders).

Ids are turned into integer indices outside the towers (in tf.data for training, in the
serving module for export) so the towers are plain numeric graphs that XLA can compile.
Index layout of both vocabularies: `[0, oov_buckets)` are hashed out-of-vocabulary buckets,
then the vocabulary file's ids in order. Variable-length inputs (a user's history, an item's
genres and title tokens) are dense int matrices padded with PAD (-1), pooled with a masked
mean, so an empty list pools to the zero vector.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Self

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from recsys.core.config import ModelConfig
from recsys.core.errors import ConfigError, DataError, StageNotReadyError
from recsys.core.layout import ModelFile
from recsys.core.schema import GENRES, ITEM_FEATURES, USER_ID
from recsys.item_tokens import MAX_GENRES, PAD, TOKENIZERS, token_matrix
from recsys.losses import in_batch_softmax_loss

USER_INDEX = "user_index"
ITEM_INDEX = "item_index"
HISTORY_INDEX = "history_index"
ITEM_LOG_PROB = "item_log_prob"
ITEM_FEATURE_COLUMNS = tuple(f.name for f in ITEM_FEATURES)


def feature_index(name: str) -> str:
    """Key of an item feature's [n, width] token-index matrix in the candidate tower's input."""
    return f"{name}_index"


def masked_mean(embedding: tf.keras.layers.Layer, ids: tf.Tensor) -> tf.Tensor:
    """`sum_j 1[ids_j >= 0] E[ids_j] / max(1, #valid)` over the last axis of `ids`."""
    valid = ids >= 0
    vectors = embedding(tf.where(valid, ids, tf.zeros_like(ids)))
    mask = tf.cast(valid, vectors.dtype)[..., None]
    count = tf.maximum(tf.reduce_sum(mask, axis=-2), tf.ones([], vectors.dtype))
    return tf.reduce_sum(vectors * mask, axis=-2) / count


def _mlp(hidden_dims: Sequence[int]) -> list[tf.keras.layers.Layer]:
    """ReLU layers ending in a linear projection (an empty list: no MLP)."""
    return [
        tf.keras.layers.Dense(
            units, activation="relu" if i < len(hidden_dims) - 1 else None, name=f"dense_{i}"
        )
        for i, units in enumerate(hidden_dims)
    ]


def _output(x: tf.Tensor, normalize: bool = True) -> tf.Tensor:
    """A tower's float32 output, L2-normalised unless `model.normalize` is false."""
    x = tf.cast(x, tf.float32)
    return tf.math.l2_normalize(x, axis=-1) if normalize else x


def _embedding(rows: int, dim: int, l2: float, name: str) -> tf.keras.layers.Embedding:
    regularizer = tf.keras.regularizers.l2(l2) if l2 > 0 else None
    return tf.keras.layers.Embedding(rows, dim, embeddings_regularizer=regularizer, name=name)


Baked = dict[str, tuple[np.ndarray, int]]
"""Feature name -> (constant [rows, width] token-index table, token vocabulary size)."""


def _bake_features(tower: tf.keras.Model, features: Baked | None, dim: int, l2: float) -> None:
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
        tower.feature_embeddings[name] = _embedding(max(size, 1), dim, l2, f"{name}_embedding")


class QueryTower(tf.keras.Model):
    """`q = normalize(MLP(U[u] + mean_{j in H(u)} V[j] + sum_f A_f[a_f(u)]))`.

    U is the (users + oov) x d user table; H(u) the user's last `history_length` items (index
    PAD ignored; an empty history adds the zero vector); V is the candidate tower's item table
    when `item_embedding` is given (shared), else the tower's own table of `num_items` rows.
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
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        self.history_length = history_length
        self.normalize = normalize
        # Attribute names are checkpoint keys: `embedding` as in the first (ids-only) towers.
        self.embedding = _embedding(num_users, embedding_dim, l2, "embedding")
        self.shares_item_embedding = item_embedding is not None
        self.history_embedding = None
        if history_length:
            self.history_embedding = item_embedding or _embedding(
                num_items, embedding_dim, l2, "history_embedding"
            )
        if features:  # only then: towers without user features keep their checkpoint keys
            _bake_features(self, features, embedding_dim, l2)
        self.mlp = _mlp(hidden_dims)

    def call(self, inputs: dict[str, tf.Tensor]) -> tf.Tensor:
        x = self.embedding(inputs[USER_INDEX])
        if self.history_embedding is not None and HISTORY_INDEX in inputs:
            x = x + masked_mean(self.history_embedding, inputs[HISTORY_INDEX])
        for name in getattr(self, "feature_names", ()):
            ids = tf.gather(self.feature_ids[name], inputs[USER_INDEX])
            x = x + masked_mean(self.feature_embeddings[name], ids)
        for layer in self.mlp:
            x = layer(x)
        return _output(x, self.normalize)

    def get_config(self) -> dict[str, object]:
        # Rebuilt from model.json by TrainedModel.load, never from a Keras config.
        return {"name": self.name}


class CandidateTower(tf.keras.Model):
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
        self.embedding = _embedding(num_items, embedding_dim, l2, "embedding")
        _bake_features(self, features, embedding_dim, l2)
        self.mlp = _mlp(hidden_dims)

    def call(self, inputs: tf.Tensor | dict[str, tf.Tensor]) -> tf.Tensor:
        given = inputs if isinstance(inputs, dict) else {ITEM_INDEX: inputs}
        indices = given[ITEM_INDEX]
        x = self.embedding(indices)
        for name in self.feature_names:
            ids = given.get(feature_index(name))
            if ids is None:
                ids = tf.gather(self.feature_ids[name], indices)
            x = x + masked_mean(self.feature_embeddings[name], ids)
        for layer in self.mlp:
            x = layer(x)
        return _output(x, self.normalize)

    def get_config(self) -> dict[str, object]:
        return {"name": self.name}


def gather_global_candidates(*tensors: tf.Tensor) -> list[tf.Tensor]:
    """Under several replicas, every replica's rows gathered, this replica's rows first.

    In-batch negatives then come from the global batch. Rolling the local rows first keeps the
    positives on the diagonal (what tfrs.tasks.Retrieval's labels assume); the softmax does not
    depend on the order of the other columns. ReplicaContext.all_gather is differentiable: the
    gradient reaching another replica's candidates is summed back to that replica.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return list(tensors)
    # Input tensors straight from the dataset iterator carry no device under a multi-worker
    # strategy; all_gather needs one (it is its destination): copy them under the step's.
    tensors = tuple(t if t.device else tf.identity(t) for t in tensors)
    sizes = ctx.all_gather(tf.shape(tensors[0])[:1], axis=0)
    offset = tf.reduce_sum(sizes[: ctx.replica_id_in_sync_group])
    # A roll, not a gather: its gradient stays dense, which all_gather's gradient needs.
    return [tf.roll(ctx.all_gather(t, axis=0), shift=-offset, axis=0) for t in tensors]


class TwoTowerModel(tfrs.Model):
    """In-batch sampled-softmax retrieval over the global batch.

    For a batch of (query, item) pairs with query vectors q_i and candidate vectors c_j (all
    replicas' candidates under a distribution strategy) the logits are
    `s_ij = q_i . c_j / temperature - log Q(j)` (logQ correction on), other columns holding the
    positive item are masked (accidental hits), optionally only the top `num_hard_negatives`
    negatives are kept, and the loss is the softmax cross-entropy of the positive, summed over
    the replica's queries (so gradients summed over replicas equal one-device gradients).
    Logits and loss are float32 whatever the towers' precision. The logged `loss` is the mean
    per example over the epoch.
    """

    def __init__(
        self,
        query_tower: QueryTower,
        candidate_tower: CandidateTower,
        config: ModelConfig,
    ) -> None:
        super().__init__()
        self.query_tower = query_tower
        self.candidate_tower = candidate_tower
        self.config = config
        self.task = tfrs.tasks.Retrieval(
            temperature=config.temperature,
            remove_accidental_hits=config.remove_accidental_hits,
            num_hard_negatives=config.num_hard_negatives,
        )
        self.loss_tracker = tf.keras.metrics.Mean(name="loss")

    @property
    def metrics(self) -> list[tf.keras.metrics.Metric]:
        return [self.loss_tracker]

    def compute_loss(self, features: dict[str, tf.Tensor], training: bool = False) -> tf.Tensor:
        query_inputs = {k: features[k] for k in (USER_INDEX, HISTORY_INDEX) if k in features}
        query = self.query_tower(query_inputs, training=training)
        candidates = self.candidate_tower(features[ITEM_INDEX], training=training)
        candidates, ids, log_q = gather_global_candidates(
            candidates, features[ITEM_INDEX], features[ITEM_LOG_PROB]
        )
        log_q = log_q if self.config.logq_correction else None
        ids = ids if self.config.remove_accidental_hits else None
        if self.config.num_hard_negatives is None and not self.jit_compile:
            # The task's loss in cache-sized row blocks (recsys/losses.py): ~2x faster on CPU.
            # Its loop has dynamic shapes XLA cannot compile; under XLA the task is fused.
            return in_batch_softmax_loss(query, candidates, self.config.temperature, log_q, ids)
        return self.task(
            query,
            candidates,
            candidate_sampling_probability=None if log_q is None else tf.exp(log_q),
            candidate_ids=ids,
            compute_metrics=False,
            compute_batch_metrics=False,
        )

    def _step(self, features: dict[str, tf.Tensor], train: bool) -> dict[str, tf.Tensor]:
        loss_scaling = isinstance(self.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        with tf.GradientTape() as tape:
            loss = self.compute_loss(features, training=train)
            # Regularisation is added on every replica and the gradients are summed: 1/R each.
            total = loss + tf.add_n(self.losses) / replicas if self.losses else loss
            # TFRS's own train_step never scales the loss, so float16 gradients underflow.
            scaled = self.optimizer.get_scaled_loss(total) if train and loss_scaling else total
        if train:
            grads = tape.gradient(scaled, self.trainable_variables)
            if loss_scaling:
                grads = self.optimizer.get_unscaled_gradients(grads)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        batch = tf.cast(tf.shape(features[ITEM_INDEX])[0], tf.float32)
        self.loss_tracker.update_state(loss / batch, sample_weight=batch)
        return {"loss": self.loss_tracker.result()}

    def train_step(self, features: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        with _replica_device():
            return self._step(features, train=True)

    def test_step(self, features: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        with _replica_device():
            return self._step(features, train=False)


def _replica_device() -> contextlib.AbstractContextManager[object]:
    """Pin the step to the worker's device under a one-device-per-worker multi-worker strategy.

    There, replica tensors carry no device, and all_gather (and its gradient) derive their
    destination from the tensor's device: "destinations can not be empty" otherwise.
    """
    strategy = tf.distribute.get_strategy()
    devices = strategy.extended.worker_devices if strategy.num_replicas_in_sync > 1 else ()
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and len(devices) == 1:
        return tf.device(devices[0])
    return contextlib.nullcontext()


def read_vocab(path: Path) -> list[str]:
    """One id per line, in index order."""
    return path.read_text(encoding="utf-8").splitlines()


def string_lookup(vocab: Sequence[str], oov_buckets: int) -> tf.keras.layers.StringLookup:
    """Raw id string -> index, unknown ids hashed into the first `oov_buckets` indices."""
    # A numpy object array, not a list: Keras converts a 1M-id list ~20x slower (35 s vs 1.6 s).
    vocabulary = np.asarray(list(vocab), dtype=object) if len(vocab) else []
    return tf.keras.layers.StringLookup(
        vocabulary=vocabulary, num_oov_indices=oov_buckets, mask_token=None
    )


@dataclass
class FeatureTables:
    """Per-row token indices of each side feature, in vocabulary order (items or users).

    `ids[name]` is [rows, width] int32 padded with PAD; `vocab[name]` lists the tokens.
    """

    ids: dict[str, np.ndarray] = field(default_factory=dict)
    vocab: dict[str, list[str]] = field(default_factory=dict)
    STEM: ClassVar[str] = ""

    def token_ids(self, name: str, per_row: Sequence[Sequence[str]]) -> np.ndarray:
        """[n, width] indices of tokenised rows, as the trained table would hold them."""
        return token_matrix(per_row, self.vocab[name], self.ids[name].shape[1])

    def baked(self, oov: int) -> Baked:
        """The towers' tables: OOV-bucket rows (no tokens) first, then the vocabulary's."""
        return {
            name: (
                np.concatenate([np.full((oov, ids.shape[1]), PAD, np.int32), ids]),
                len(self.vocab[name]),
            )
            for name, ids in self.ids.items()
        }

    def save(self, path: Path) -> None:
        """`<STEM>.npz` (index matrices) and `<STEM>.json` (token vocabularies)."""
        np.savez(path / f"{self.STEM}.npz", **self.ids)
        (path / f"{self.STEM}.json").write_text(json.dumps(self.vocab), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> Self:
        """What `save` wrote; empty for a model saved without these features."""
        if not (path / f"{cls.STEM}.json").is_file():
            return cls()
        with np.load(path / f"{cls.STEM}.npz", allow_pickle=False) as npz:
            ids = {name: npz[name] for name in npz.files}
        return cls(ids, json.loads((path / f"{cls.STEM}.json").read_text(encoding="utf-8")))


def _shared_vocab(tokens: Sequence[Sequence[str]]) -> list[str]:
    """Tokens of at least two rows, most frequent first (a token of one row is just an id)."""
    counts = Counter(t for toks in tokens for t in set(toks))
    return sorted((t for t, c in counts.items() if c >= 2), key=lambda t: (-counts[t], t))


@dataclass
class ItemFeatures(FeatureTables):
    """Per-item token indices of each item feature (genres, title), in item-vocabulary order."""

    STEM: ClassVar[str] = "item_features"

    @classmethod
    def from_parquet(cls, path: Path, items: Sequence[str], max_title_tokens: int) -> ItemFeatures:
        """Genres (list or '|'-separated) and title tokens of `items`; absent columns skipped."""
        import pyarrow.parquet as pq

        if not path.is_file():
            return cls()
        columns = [c for c in ITEM_FEATURE_COLUMNS if c in pq.read_schema(path).names]
        if not columns:
            return cls()
        table = pq.read_table(path, columns=["item_id", *columns]).to_pydict()
        row = {item: i for i, item in enumerate(table["item_id"])}
        tokens: dict[str, list[list[str]]] = {}
        for name in columns:
            tokenize = TOKENIZERS[name]
            tokens[name] = [tokenize(table[name][row[i]]) if i in row else [] for i in items]
        features = cls()
        for name, per_item in tokens.items():
            vocab = _shared_vocab(per_item)
            if not vocab:
                continue
            width = MAX_GENRES if name == GENRES else max_title_tokens
            features.ids[name] = token_matrix(per_item, vocab, width)
            features.vocab[name] = vocab
        return features


USER_FEATURE_BUCKETS = 10
"""Numeric user features (e.g. age) become this many quantile buckets, `q0` to `q9`."""


@dataclass
class UserFeatures(FeatureTables):
    """Per-user token of each user side feature (one per column), in user-vocabulary order.

    A text column's token is its value; a numeric column's (every value a number, more distinct
    values than buckets) is its quantile bucket over the users. Values of one user only are
    dropped like rare item tokens.
    """

    STEM: ClassVar[str] = "user_features"

    @classmethod
    def from_parquet(cls, path: Path, users: Sequence[str]) -> UserFeatures:
        """Tokens of `users` from the Beam job's user_features.parquet (absent file: none)."""
        import pyarrow.parquet as pq

        if not path.is_file():
            return cls()
        table = pq.read_table(path).to_pydict()
        row = {user: i for i, user in enumerate(table.pop(USER_ID))}
        features = cls()
        for name, values in table.items():
            tokens = _user_tokens([values[row[u]] if u in row else None for u in users])
            vocab = _shared_vocab(tokens)
            if vocab:
                features.ids[name] = token_matrix(tokens, vocab, 1)
                features.vocab[name] = vocab
        return features


def _user_tokens(values: Sequence[str | None]) -> list[list[str]]:
    """One token list per user: the stripped value, or its quantile bucket if numeric."""
    text = [v.strip() if isinstance(v, str) and v.strip() else None for v in values]
    present = [v for v in text if v is not None]
    try:
        numbers = np.array([float(v) for v in present])
    except ValueError:
        numbers = None
    if numbers is None or len(np.unique(numbers)) <= USER_FEATURE_BUCKETS:
        return [[v] if v is not None else [] for v in text]
    edges = np.quantile(numbers, np.linspace(0, 1, USER_FEATURE_BUCKETS + 1)[1:-1])
    return [
        [f"q{int(np.searchsorted(edges, float(v), side='right'))}"] if v is not None else []
        for v in text
    ]


def pad_histories(
    histories: Sequence[Sequence[str | bytes]],
    lookup: tf.keras.layers.StringLookup,
    length: int,
) -> np.ndarray:
    """[n, length] int64 item indices of each history's last `length` ids, PAD-filled.

    Empty ids ("" is the serving signature's padding) are dropped; unknown ids hash to OOV.
    """
    kept = [
        [h for h in hist if h not in ("", b"")][-length:] if length else [] for hist in histories
    ]
    lens = np.array([len(h) for h in kept], dtype=np.int64)
    out = np.full((len(kept), length), PAD, dtype=np.int64)
    flat = [h for hist in kept for h in hist]
    if flat:
        flat = [h.decode("utf-8") if isinstance(h, bytes) else h for h in flat]
        rows = np.repeat(np.arange(len(kept)), lens)
        cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
        out[rows, cols] = lookup(tf.constant(flat)).numpy()
    return out


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
            if name not in (features or {}):
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
        batch_size: int = 65536,
    ) -> np.ndarray:
        """[len(user_ids), d] float32 query vectors for raw user ids and their item histories.

        Unknown user ids hash to OOV buckets; `histories` (oldest first, one per user; None:
        all empty) keep their last `history_length` ids, unknown item ids hashing to OOV.
        """
        if histories is not None and len(histories) != len(user_ids):
            raise ValueError(f"{len(histories)} histories for {len(user_ids)} users")
        users, items = self.user_lookup(), self.item_lookup()
        parts = []
        for i in range(0, len(user_ids), batch_size):
            ids = list(user_ids[i : i + batch_size])
            inputs = {USER_INDEX: users(tf.constant(ids, tf.string))}
            if self.config.history_length:
                hist = histories[i : i + batch_size] if histories is not None else [[]] * len(ids)
                inputs[HISTORY_INDEX] = tf.constant(
                    pad_histories(hist, items, self.config.history_length)
                )
            parts.append(self.query_tower(inputs).numpy())
        return (
            np.concatenate(parts).astype(np.float32)
            if parts
            else np.zeros((0, self.output_dim), np.float32)
        )

    def save(self, path: Path) -> None:
        """Weights (TF checkpoints), vocabularies, item features and model config under `path`."""
        path.mkdir(parents=True, exist_ok=True)
        (path / "users.txt").write_text("\n".join(self.users) + "\n", encoding="utf-8")
        (path / "items.txt").write_text("\n".join(self.items) + "\n", encoding="utf-8")
        (path / ModelFile.CONFIG).write_text(json.dumps(self.config.model_dump(), indent=2))
        self.item_features.save(path)
        self.user_features.save(path)
        self.query_tower.save_weights(str(path / "query" / "weights"))
        self.candidate_tower.save_weights(str(path / "candidate" / "weights"))

    @classmethod
    def load(cls, path: Path) -> TrainedModel:
        """Rebuild the towers saved by `save` and restore their weights."""
        if not (path / ModelFile.CONFIG).is_file():
            raise StageNotReadyError(f"no trained model at {path}: run `recsys train` first")
        raw = json.loads((path / ModelFile.CONFIG).read_text())
        # Models saved before a feature existed were trained without it: keep it off.
        for key, off in _ADDED_OFF.items():
            raw.setdefault(key, off)
        config = ModelConfig.model_validate(raw)
        model = cls.build(
            read_vocab(path / "users.txt"),
            read_vocab(path / "items.txt"),
            config,
            ItemFeatures.load(path),
            UserFeatures.load(path),
        )
        for name, tower in (("query", model.query_tower), ("candidate", model.candidate_tower)):
            status = tower.load_weights(str(path / name / "weights"))
            try:
                status.assert_existing_objects_matched()
            except AssertionError as exc:
                raise DataError(
                    f"{path / name}: checkpoint does not match the {name} tower rebuilt from "
                    f"model.json ({str(exc)[:300]}); retrain or re-export the model"
                ) from None
            status.expect_partial()  # optimizer slots are not needed to serve or warm start
        return model


_ADDED_OFF = {
    "history_length": 0,
    "item_features": False,
    "normalize": True,
    "user_features": False,
}
"""ModelConfig keys added after the first saved models, with the value that means 'absent'
(models saved before `normalize` existed were always normalised)."""


def _dummy_query(config: ModelConfig) -> dict[str, tf.Tensor]:
    inputs = {USER_INDEX: tf.zeros([1], tf.int64)}
    if config.history_length:
        inputs[HISTORY_INDEX] = tf.fill([1, config.history_length], tf.constant(PAD, tf.int64))
    return inputs


def _map_rows(
    target: tf.Variable, source: np.ndarray, new: Sequence[str], old: Sequence[str], oov: int
) -> int:
    """Copy `source` rows into `target` by id (OOV buckets by position); returns rows copied."""
    value = target.numpy()
    old_oov = source.shape[0] - len(old)
    shared = min(oov, old_oov)
    value[:shared] = source[:shared]
    position = {t: i for i, t in enumerate(old)}
    pairs = np.array(
        [(oov + i, old_oov + position[t]) for i, t in enumerate(new) if t in position], np.int64
    ).reshape(-1, 2)
    value[pairs[:, 0]] = source[pairs[:, 1]]
    target.assign(value)
    return len(pairs)


def warm_start(model: TrainedModel, previous: TrainedModel) -> dict[str, int]:
    """Initialise `model` from `previous`: embedding rows mapped by id, MLP layers copied.

    Ids in both vocabularies keep their trained rows, new ids keep their fresh rows, removed
    ids are dropped. Dense layers are copied when their shapes match (same architecture).
    Returns how many rows each table took over.
    """
    oov = model.config.oov_buckets
    if model.output_dim != previous.output_dim:
        raise ConfigError(
            f"training.warm_start_from: the previous model's output width "
            f"{previous.output_dim} differs from this config's {model.output_dim}"
        )
    if model.config.embedding_dim != previous.config.embedding_dim:
        raise ConfigError(
            f"training.warm_start_from: model.embedding_dim {model.config.embedding_dim} "
            f"differs from the previous model's {previous.config.embedding_dim}"
        )
    q, pq_ = model.query_tower, previous.query_tower
    c, pc = model.candidate_tower, previous.candidate_tower
    copied = {
        "users": _map_rows(
            q.embedding.embeddings,
            pq_.embedding.embeddings.numpy(),
            model.users,
            previous.users,
            oov,
        ),
        "items": _map_rows(
            c.embedding.embeddings,
            pc.embedding.embeddings.numpy(),
            model.items,
            previous.items,
            oov,
        ),
    }
    if (
        q.history_embedding is not None
        and not q.shares_item_embedding
        and pq_.history_embedding is not None
    ):
        copied["history_items"] = _map_rows(
            q.history_embedding.embeddings,
            pq_.history_embedding.embeddings.numpy(),
            model.items,
            previous.items,
            oov,
        )
    for tower, old, new_vocab, old_vocab in (
        (c, pc, model.item_features.vocab, previous.item_features.vocab),
        (q, pq_, model.user_features.vocab, previous.user_features.vocab),
    ):
        for name, layer in getattr(tower, "feature_embeddings", {}).items():
            if name in getattr(old, "feature_embeddings", {}):
                copied[name] = _map_rows(
                    layer.embeddings,
                    old.feature_embeddings[name].embeddings.numpy(),
                    new_vocab[name],
                    old_vocab[name],
                    0,
                )
    for tower, old in ((q, pq_), (c, pc)):
        for layer, old_layer in zip(tower.mlp, old.mlp, strict=False):
            if [w.shape for w in layer.weights] == [w.shape for w in old_layer.weights]:
                layer.set_weights(old_layer.get_weights())
    return copied
