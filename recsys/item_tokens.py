"""How raw item features become token indices: once in Python, once in the graph, the same.

Training bakes each catalog item's token indices into the candidate tower (`ItemFeatures`, from
item_features.parquet, in Python); the candidate SavedModel tokenises raw features of any item,
including items the model has never seen, inside the graph. Both follow these rules:

- genres: each value stripped of surrounding spaces; empty values dropped; matched exactly.
- title: lower-cased, split into runs of word characters (Python's Unicode `\\w+`: letters,
  digits, underscore; in RE2 terms `[\\p{L}\\p{N}_]+`), so "Toy Story (1995)" gives
  `toy`, `story`, `1995`.
- then: at most MAX_RAW_TOKENS raw tokens are read, tokens outside the feature's vocabulary are
  dropped, repeats are dropped (first occurrence kept) and the first `width` remain, padded with
  PAD. The tower pools a masked mean, so only the set of kept tokens matters.

The two tokenisers agree on every MovieLens title and on the Unicode cases tested
(tests/test_item_tokens.py); Python's `str.lower` uses full case mapping and TensorFlow simple
case mapping, which differ for a handful of characters (none seen in titles so far).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from recsys.core.schema import GENRES, TITLE

if TYPE_CHECKING:
    import tensorflow as tf

PAD = -1
"""Padding index of token matrices (masked out of the pooled mean)."""
MAX_GENRES = 8
"""Width of the genres matrix: genres kept per item."""
MAX_RAW_TOKENS = 64
"""Raw tokens read per item and feature: bounds the work an oversized request can cause."""

_WORD = re.compile(r"\w+", re.UNICODE)
_NON_WORD_RE2 = r"[^\p{L}\p{N}_]+"


def genre_tokens(value: object) -> list[str]:
    """Genre tokens of one raw value: a list of genres, or one '|'-separated string."""
    if value is None:
        return []
    parts = value if isinstance(value, (list, tuple)) else str(value).split("|")
    return [str(p).strip() for p in parts if p and str(p).strip()]


def title_tokens(value: object) -> list[str]:
    """Lower-cased word tokens of one raw title ('' or None: none)."""
    return _WORD.findall(str(value).lower()) if value else []


def token_matrix(per_item: Sequence[Sequence[str]], vocab: Sequence[str], width: int) -> np.ndarray:
    """[len(per_item), width] int32 vocabulary indices (unknown and repeated tokens dropped)."""
    index = {t: i for i, t in enumerate(vocab)}
    out = np.full((len(per_item), width), PAD, dtype=np.int32)
    for row, toks in enumerate(per_item):
        known = list(dict.fromkeys(index[t] for t in toks[:MAX_RAW_TOKENS] if t in index))
        out[row, : min(width, len(known))] = known[:width]
    return out


def graph_genre_tokens(genres: tf.Tensor | tf.RaggedTensor) -> tf.RaggedTensor:
    """In-graph `genre_tokens` of [n, m] genre lists ('' -padded dense, or ragged)."""
    import tensorflow as tf

    if not isinstance(genres, tf.RaggedTensor):
        genres = tf.RaggedTensor.from_tensor(genres)
    stripped = tf.ragged.map_flat_values(tf.strings.strip, genres)
    return tf.ragged.boolean_mask(stripped, tf.not_equal(stripped, ""))


def graph_title_tokens(titles: tf.Tensor) -> tf.RaggedTensor:
    """In-graph `title_tokens` of [n] titles (invalid UTF-8 bytes count as separators)."""
    import tensorflow as tf

    # tf.strings.lower stops at the first NUL byte: NULs (non-word characters anyway) go first.
    lowered = tf.strings.lower(tf.strings.regex_replace(titles, r"\x00", " "), encoding="utf-8")
    return tf.strings.split(tf.strings.regex_replace(lowered, _NON_WORD_RE2, " "))


def graph_token_matrix(
    tokens: tf.RaggedTensor, lookup: Callable[[tf.Tensor], tf.Tensor], width: int
) -> tf.Tensor:
    """In-graph `token_matrix`: `lookup` maps token strings to indices, -1 when unknown."""
    import tensorflow as tf

    ids = tf.ragged.map_flat_values(lookup, tokens[:, :MAX_RAW_TOKENS])
    dense = tf.cast(ids.to_tensor(default_value=PAD), tf.int32)  # [n, L], L <= MAX_RAW_TOKENS
    position = tf.range(tf.shape(dense)[1])
    earlier = position[None, :] < position[:, None]  # [L, L]: column j comes before row i
    repeat = tf.reduce_any(tf.equal(dense[:, :, None], dense[:, None, :]) & earlier[None], axis=2)
    kept = tf.ragged.boolean_mask(dense, (dense >= 0) & ~repeat)
    return kept[:, :width].to_tensor(default_value=PAD, shape=[None, width])


TOKENIZERS = {GENRES: genre_tokens, TITLE: title_tokens}
"""Item feature name -> its Python tokeniser (one raw value -> tokens)."""
GRAPH_TOKENIZERS = {GENRES: graph_genre_tokens, TITLE: graph_title_tokens}
"""Item feature name -> its graph tokeniser (a batch of raw values -> ragged tokens)."""
