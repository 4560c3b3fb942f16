"""Sample serving requests: what verification sends and what the warmup records replay.

One place builds the inputs of every signature (raw features or serialized tf.Examples), so
the warmup records, the fresh-process verification and the tests exercise the same shapes,
including the awkward ones: unknown and empty ids, empty and over-long histories, k outside
[1, max_k].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from recsys.core import schema
from recsys.core.schema import GENRES, HISTORY, ITEM_ID, TITLE, USER_ID
from recsys.model import TrainedModel
from serving_export.signatures import CANDIDATE, EXAMPLES, RETRIEVAL, SIGNATURE, K

MAX_KNOWN_SAMPLE = 64
# Several unknown ids so that more than one OOV bucket is exercised; "" is a real request too.
UNKNOWN_USER_IDS = (*(f"__recsys_verify_unknown_{i}__" for i in range(8)), "")
UNKNOWN_ITEM_IDS = (*(f"__recsys_verify_unknown_item_{i}__" for i in range(4)), "")


def sample_users(model: TrainedModel, given: Sequence[str] | None = None) -> list[str]:
    """Sample ids to verify with: `given` (or up to 64 vocabulary users) plus unknown ids."""
    if given is None:
        given = _spread(model.users)
    vocab = set(model.users)
    return list(given) + [uid for uid in UNKNOWN_USER_IDS if uid not in vocab]


@dataclass(frozen=True)
class ItemRequests:
    """Rows of candidate-model requests: raw item ids with their raw genres and titles."""

    ids: list[str]
    genres: list[list[str]]
    titles: list[str]

    def rows(self, index: Sequence[int]) -> ItemRequests:
        """The requests at positions `index`, in that order."""
        return ItemRequests(
            [self.ids[i] for i in index],
            [self.genres[i] for i in index],
            [self.titles[i] for i in index],
        )

    def features(self) -> dict[str, list[Any]]:
        """Raw feature values by feature name (`TrainedModel.candidate_embeddings` input)."""
        return {GENRES: self.genres, TITLE: self.titles}


def sample_items(model: TrainedModel) -> ItemRequests:
    """Up to 64 catalog items spread over the vocabulary, plus unknown and empty item ids.

    Their features cycle through: none (the catalog's are used), the item's own (rebuilt from
    the model's token tables), another item's with noise (case, punctuation, repeats, unknown
    and empty entries: a changed item), and oversized ones. Unknown ids are cold-start items.
    """
    vocab = set(model.items)
    ids = _spread(model.items) + [i for i in UNKNOWN_ITEM_IDS if i not in vocab]
    position = {item: i for i, item in enumerate(model.items)}
    catalog = max(len(model.items), 1)
    genres: list[list[str]] = []
    titles: list[str] = []
    for row, item in enumerate(ids):
        variant = row % 4
        source = position.get(item, row % catalog)  # unknown ids borrow an item's features
        own = _catalog_tokens(model, (source * 5 + 3) % catalog if variant == 2 else source)
        if variant == 0:
            genres.append([])
            titles.append("")
        elif variant == 1:
            genres.append(own[GENRES])
            titles.append(" ".join(own[TITLE]).title())
        elif variant == 2:
            genres.append(["", *own[GENRES], " never-seen-genre ", *own[GENRES][:1]])
            titles.append(f"{' '.join(own[TITLE]).upper()}: The Ünseen-Sequel (2031)!")
        else:
            genres.append([f"g{j}" for j in range(40)] + own[GENRES])
            titles.append(" ".join(f"w{j}" for j in range(100)) + " " + " ".join(own[TITLE]))
    return ItemRequests(ids, genres, titles)


def _catalog_tokens(model: TrainedModel, row: int) -> dict[str, list[str]]:
    """The tokens a catalog item's baked feature tables hold (none past the catalog)."""
    features = model.item_features
    out: dict[str, list[str]] = {GENRES: [], TITLE: []}
    for name, ids in features.ids.items():
        if row < len(ids):
            out[name] = [features.vocab[name][i] for i in ids[row] if i >= 0]
    return out


def sample_histories(model: TrainedModel, n: int) -> list[list[str]]:
    """Deterministic histories for n sample users: empty, short, over-long, with unknown ids."""
    items = model.items
    longest = model.config.history_length + 3  # longer than kept: truncation is checked too
    histories = []
    for row in range(n):
        size = (0, 1, 3, longest)[row % 4]
        history = [items[(row * 7 + j * 3) % len(items)] for j in range(size)] if items else []
        if row % 5 == 2:
            history.append(f"__recsys_verify_unknown_item_{row}__")
        histories.append(history)
    return histories


def sample_ks(max_k: int, n: int) -> list[int]:
    """n requested k values: negative, 0, 1, mid, the maximum and above it, cycled."""
    values = (-5, 0, 1, max(1, max_k // 2), max_k, max_k + 50)
    return [values[i % len(values)] for i in range(n)]


def padded(histories: Sequence[Sequence[str]]) -> np.ndarray:
    """[n, longest] object array of UTF-8 bytes, right-padded with b"" as clients do."""
    width = max((len(h) for h in histories), default=0)
    out = np.full((len(histories), width), b"", dtype=object)
    for row, history in enumerate(histories):
        out[row, : len(history)] = [h.encode("utf-8") for h in history]
    return out


def strings(values: Sequence[str]) -> np.ndarray:
    """[n] object array of UTF-8 bytes (what a DT_STRING tensor holds)."""
    out = np.empty(len(values), dtype=object)
    out[:] = [v.encode("utf-8") for v in values]
    return out


def tf_example(features: dict[str, Any]) -> bytes:
    """A serialized tf.Example holding only `features`, typed by `recsys.core.schema.FEATURES`."""
    from tensorflow.core.example import example_pb2

    kinds = {f.name: f.kind for f in schema.FEATURES + schema.ITEM_FEATURES}
    example = example_pb2.Example()
    for name, value in features.items():
        feature = example.features.feature[name]
        kind = kinds[name]
        if kind in ("bytes", "bytes_list"):
            values = value if kind == "bytes_list" else [value]
            feature.bytes_list.value.extend(v.encode("utf-8") for v in values)
        elif kind == "int64":
            feature.int64_list.value.append(int(value))
        else:
            feature.float_list.value.append(float(value))
    return example.SerializeToString(deterministic=True)


def query_examples(user_ids: Sequence[str], histories: Sequence[Sequence[str]]) -> np.ndarray:
    """Serialized tf.Examples of (user_id, history) pairs, as TFX-style clients send them."""
    out = np.empty(len(user_ids), dtype=object)
    out[:] = [
        tf_example({USER_ID: u, HISTORY: list(h)}) for u, h in zip(user_ids, histories, strict=True)
    ]
    return out


def item_examples(items: ItemRequests) -> np.ndarray:
    """Serialized tf.Examples each holding one item's item_id, genres and title."""
    out = np.empty(len(items.ids), dtype=object)
    out[:] = [
        tf_example({ITEM_ID: i, GENRES: g, TITLE: t})
        for i, g, t in zip(items.ids, items.genres, items.titles, strict=True)
    ]
    return out


def request_inputs(
    name: str,
    signature: str,
    user_ids: Sequence[str],
    histories: Sequence[Sequence[str]],
    items: ItemRequests,
    ks: Sequence[int],
) -> dict[str, np.ndarray]:
    """The named input arrays of one signature call of model `name` on the given samples."""
    raw = signature == SIGNATURE
    if name == CANDIDATE:
        if not raw:
            return {EXAMPLES: item_examples(items)}
        return {
            ITEM_ID: strings(items.ids),
            GENRES: padded(items.genres),
            TITLE: strings(items.titles),
        }
    inputs = (
        {USER_ID: strings(user_ids), HISTORY: padded(histories)}
        if raw
        else {EXAMPLES: query_examples(user_ids, histories)}
    )
    if name == RETRIEVAL:
        inputs[K] = np.asarray(ks, dtype=np.int32)
    return inputs


def _spread(ids: Sequence[str]) -> list[str]:
    if not ids:
        return []
    spread = np.linspace(0, len(ids) - 1, num=min(MAX_KNOWN_SAMPLE, len(ids)))
    return [ids[i] for i in np.unique(spread.astype(np.int64))]
