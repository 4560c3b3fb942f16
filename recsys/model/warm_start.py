"""Warm start: initialise a new model's towers from a previous model's, row by id.

Ids in both vocabularies keep their trained rows, new ids keep their fresh rows, removed ids
are dropped; OOV buckets are copied by position; side-feature rows map by token; dense layers
(MLP, transformer blocks, the GRU) are copied when their shapes match, encoder positions
aligned at the latest item. A sequence encoder of another kind starts fresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from recsys.core.errors import ConfigError
from recsys.model.encoders import GRUEncoder, TransformerEncoder
from recsys.model.trained import TrainedModel


def map_rows(
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
        "items": map_rows(
            c.embedding.embeddings,
            pc.embedding.embeddings.numpy(),
            model.items,
            previous.items,
            oov,
        ),
    }
    # Either model may have no user table (model.user_embedding off): nothing to carry then.
    if q.embedding is not None and pq_.embedding is not None:
        users = pq_.embedding.embeddings.numpy()
        copied["users"] = map_rows(q.embedding.embeddings, users, model.users, previous.users, oov)
    if (
        q.history_embedding is not None
        and not q.shares_item_embedding
        and pq_.history_embedding is not None
    ):
        copied["history_items"] = map_rows(
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
                copied[name] = map_rows(
                    layer.embeddings,
                    old.feature_embeddings[name].embeddings.numpy(),
                    new_vocab[name],
                    old_vocab[name],
                    0,
                )
    for tower, old in ((q, pq_), (c, pc)):
        _copy_matching(tower.mlp, old.mlp)
    encoder, old_encoder = getattr(q, "encoder", None), getattr(pq_, "encoder", None)
    if encoder is not None and old_encoder is not None:
        copied["encoder_positions"] = copy_encoder(encoder, old_encoder)
    return copied


def _copy_matching(
    layers: Sequence[tf.keras.layers.Layer], old: Sequence[tf.keras.layers.Layer]
) -> None:
    """Copy each old layer's weights into the new one at the same place when shapes match."""
    for layer, old_layer in zip(layers, old, strict=False):
        if [w.shape for w in layer.weights] == [w.shape for w in old_layer.weights]:
            layer.set_weights(old_layer.get_weights())


Encoder = TransformerEncoder | GRUEncoder


def copy_encoder(encoder: Encoder, old: Encoder) -> int:
    """Layers and final norm copied when kinds and shapes match; positions aligned at the latest.

    Position L-1 is the latest item in both (right-aligned histories), so a changed
    `history_length` keeps the rows of the most recent min(L, L_old) positions. Returns them
    (0 for a GRU, which has none, and for encoders of different kinds, which share nothing).
    The item table is not touched here: it is mapped by id with the candidate tower's.
    """
    if type(encoder) is not type(old):
        return 0
    if isinstance(encoder, GRUEncoder):
        _copy_matching([encoder.gru, encoder.norm], [old.gru, old.norm])
        return 0
    if (encoder.positions is None) != (old.positions is None):
        _copy_matching([encoder.norm], [old.norm])
        return 0  # absolute and relative positions: the blocks attend differently
    if encoder.positions is None or old.positions is None:
        return _copy_relative_blocks(encoder, old)
    _copy_matching([*encoder.blocks, encoder.norm], [*old.blocks, old.norm])
    new, previous = encoder.positions, old.positions.numpy()
    if new.shape[1] != previous.shape[1]:
        return 0
    rows = min(new.shape[0], previous.shape[0])
    value = new.numpy()
    value[-rows:] = previous[-rows:]
    new.assign(value)
    return rows


def _copy_relative_blocks(encoder: TransformerEncoder, old: TransformerEncoder) -> int:
    """Blocks and final norm of relative-position encoders; each attention's bias per distance
    keeps the shortest min(L, L_old) distances. Returns how many distances were copied."""
    _copy_matching([encoder.norm], [old.norm])
    distances = 0
    for block, old_block in zip(encoder.blocks, old.blocks, strict=False):
        for weight, previous in zip(block.weights, old_block.weights, strict=True):
            if weight.shape == previous.shape:
                weight.assign(previous)
            elif weight is block.attention.distance_bias:
                distances = min(weight.shape[1], previous.shape[1])
                value = weight.numpy()
                value[:, :distances] = previous.numpy()[:, :distances]
                weight.assign(value)
    return distances
