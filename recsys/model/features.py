"""Side-feature tables: per-row token indices of item features (genres, title) and user features.

Each table is built from the Beam job's Parquet side files in vocabulary order, baked into a
tower as a constant (see `layers.bake_features`), and saved beside the weights as
`<STEM>.npz` + `<STEM>.json`. A token carried by one row only is dropped: it would be just
another id.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Self

import numpy as np
import pyarrow.parquet as pq

from recsys.core.schema import GENRES, ITEM_FEATURES, USER_ID
from recsys.item_tokens import MAX_GENRES, PAD, TOKENIZERS, token_matrix
from recsys.model.layers import Baked

ITEM_FEATURE_COLUMNS = tuple(f.name for f in ITEM_FEATURES)


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
        np.savez(path / f"{self.STEM}.npz", allow_pickle=False, **self.ids)
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
