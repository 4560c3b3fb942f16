"""Vocabularies of the TRAIN split: vocab/{users,items}.txt and item_features.parquet.

Order is train count descending, then id ascending, so the same data always gives the same
files (and the same embedding row for each id). Ids seen fewer than `preprocess.vocab_min_count`
times in train are left out: the model maps them to its out-of-vocabulary buckets.
"""

from collections.abc import Iterable, Mapping
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.typehints import no_annotations

VOCAB_DIR = "vocab"
USERS_FILE = "users.txt"
ITEMS_FILE = "items.txt"
ITEM_FEATURES_FILE = "item_features.parquet"
ITEM_FEATURES_SCHEMA = pa.schema(
    [
        ("item_id", pa.string()),
        ("train_count", pa.int64()),
        ("genres", pa.list_(pa.string())),
        ("title", pa.string()),
    ]
)


def ranked(counts: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """(id, count) pairs by count descending, then id ascending."""
    return sorted(counts, key=lambda pair: (-pair[1], pair[0]))


def write_vocab(
    counts: Iterable[tuple[str, int]], path: Path, min_count: int = 1
) -> list[tuple[str, int]]:
    """Write ranked ids seen at least `min_count` times, one per line; returns the ranking."""
    ranking = [pair for pair in ranked(counts) if pair[1] >= min_count]
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{id_}\n" for id_, _ in ranking)
    path.write_text(text, encoding="utf-8")
    return ranking


def write_user_vocab(counts: list[tuple[str, int]], out_dir: str, min_count: int = 1) -> int:
    """vocab/users.txt; returns the number of users."""
    return len(write_vocab(counts, Path(out_dir) / VOCAB_DIR / USERS_FILE, min_count))


def write_item_vocab(
    counts: list[tuple[str, int]],
    out_dir: str,
    min_count: int = 1,
    features: Mapping[str, tuple[tuple[str, ...], str]] | None = None,
) -> int:
    """vocab/items.txt and item_features.parquet in the same order; returns the number of items.

    `features` maps item id -> (genres, title) from the item side file; items without a row
    there (or with no side file) get no genres and an empty title.
    """
    ranking = write_vocab(counts, Path(out_dir) / VOCAB_DIR / ITEMS_FILE, min_count)
    features = features or {}
    side = [features.get(id_, ((), "")) for id_, _ in ranking]
    table = pa.table(
        {
            "item_id": [id_ for id_, _ in ranking],
            "train_count": [n for _, n in ranking],
            "genres": [list(genres) for genres, _ in side],
            "title": [title for _, title in side],
        },
        schema=ITEM_FEATURES_SCHEMA,
    )
    pq.write_table(table, Path(out_dir) / ITEM_FEATURES_FILE)
    return len(ranking)


class BuildVocabularies(beam.PTransform):
    """(user, train rows) and (item, train rows) pairs -> the vocabulary files; outputs the
    number of users and of items, one element each."""

    def __init__(
        self, out_dir: str, min_count: int = 1, item_features: beam.PCollection | None = None
    ) -> None:
        super().__init__()
        self._out = out_dir
        self._min = min_count
        self._features = item_features

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(
        self, counts: tuple[beam.PCollection, beam.PCollection]
    ) -> tuple[beam.PCollection, beam.PCollection]:
        user_counts, item_counts = counts
        users = (
            user_counts
            | "AllUsers" >> beam.combiners.ToList()
            | "WriteUsers" >> beam.Map(write_user_vocab, self._out, self._min)
        )
        features = beam.pvalue.AsDict(self._features) if self._features is not None else None
        items = (
            item_counts
            | "SumItems" >> beam.CombinePerKey(sum)
            | "AllItems" >> beam.combiners.ToList()
            | "WriteItems" >> beam.Map(write_item_vocab, self._out, self._min, features=features)
        )
        return users, items
