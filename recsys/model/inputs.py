"""The towers' input contract: index keys, id -> index lookups, padded histories.

Index layout of every id table: `[0, oov_buckets)` are hashed out-of-vocabulary buckets, then
the vocabulary file's ids in order. Ids are looked up outside the towers (tf.data, serving
modules), so the towers are numeric graphs XLA can compile. Variable-length inputs are dense
int matrices right-padded with PAD (-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tensorflow as tf

from recsys.item_tokens import PAD

USER_INDEX = "user_index"
ITEM_INDEX = "item_index"
HISTORY_INDEX = "history_index"
ITEM_LOG_PROB = "item_log_prob"
# One-pass training batches: [windows, L] right-aligned item inputs (HISTORY_INDEX) and the
# item each position must predict (TARGET_INDEX), PAD where a position trains nothing.
TARGET_INDEX = "target_index"


def feature_index(name: str) -> str:
    """Key of an item feature's [n, width] token-index matrix in the candidate tower's input."""
    return f"{name}_index"


def read_vocab(path: Path) -> list[str]:
    """One id per line, in index order."""
    return path.read_text(encoding="utf-8").splitlines()


def string_lookup(vocab: Sequence[str], oov_buckets: int) -> tf.keras.layers.StringLookup:
    """Raw id string -> index, unknown ids hashed into the first `oov_buckets` indices."""
    # A numpy object array, not a list: Keras converts a 1M-id list ~20x slower (35 s vs 1.6 s).
    vocabulary: np.ndarray | list[str] = np.asarray(list(vocab), dtype=object) if len(vocab) else []
    return tf.keras.layers.StringLookup(
        vocabulary=vocabulary, num_oov_indices=oov_buckets, mask_token=None
    )


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
