"""Vocabularies of the TRAIN split: vocab/{users,items}.txt and item_features.parquet.

Order is train count descending, then id ascending, so the same data always gives the same
files (and the same embedding row for each id).
"""

from collections.abc import Iterable
from operator import itemgetter
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.typehints import no_annotations

VOCAB_DIR = "vocab"
USERS_FILE = "users.txt"
ITEMS_FILE = "items.txt"
ITEM_FEATURES_FILE = "item_features.parquet"


def ranked(counts: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """(id, count) pairs by count descending, then id ascending."""
    return sorted(counts, key=lambda pair: (-pair[1], pair[0]))


def write_vocab(counts: Iterable[tuple[str, int]], path: Path) -> list[tuple[str, int]]:
    """Write ranked ids one per line; returns the ranking."""
    ranking = ranked(counts)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{id_}\n" for id_, _ in ranking)
    path.write_text(text, encoding="utf-8")
    return ranking


def write_user_vocab(counts: list[tuple[str, int]], out_dir: str) -> int:
    """vocab/users.txt; returns the number of users."""
    return len(write_vocab(counts, Path(out_dir) / VOCAB_DIR / USERS_FILE))


def write_item_vocab(counts: list[tuple[str, int]], out_dir: str) -> int:
    """vocab/items.txt and item_features.parquet in the same order; returns the number of items."""
    ranking = write_vocab(counts, Path(out_dir) / VOCAB_DIR / ITEMS_FILE)
    table = pa.table(
        {
            "item_id": pa.array([id_ for id_, _ in ranking], pa.string()),
            "train_count": pa.array([n for _, n in ranking], pa.int64()),
        }
    )
    pq.write_table(table, Path(out_dir) / ITEM_FEATURES_FILE)
    return len(ranking)


class BuildVocabularies(beam.PTransform):
    """Train interactions -> the vocabulary files; outputs (user count, item count), one each."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self._out = out_dir

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, train: beam.PCollection) -> tuple[beam.PCollection, beam.PCollection]:
        users = (
            train
            | "UserIds" >> beam.Map(itemgetter(0))
            | "CountUsers" >> beam.combiners.Count.PerElement()
            | "AllUsers" >> beam.combiners.ToList()
            | "WriteUsers" >> beam.Map(write_user_vocab, self._out)
        )
        items = (
            train
            | "ItemIds" >> beam.Map(itemgetter(1))
            | "CountItems" >> beam.combiners.Count.PerElement()
            | "AllItems" >> beam.combiners.ToList()
            | "WriteItems" >> beam.Map(write_item_vocab, self._out)
        )
        return users, items
