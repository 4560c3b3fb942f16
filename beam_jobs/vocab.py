"""Vocabularies of the TRAIN split: vocab/{users,items}.txt, item_features.parquet and, with a
user side file, user_features.parquet.

Order is train count descending, then id ascending, so the same data always gives the same
files (and the same embedding row for each id). Ids seen fewer than `preprocess.vocab_min_count`
times in train are left out: the model maps them to its out-of-vocabulary buckets.
"""

from collections.abc import Iterable, Mapping
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.typehints import no_annotations

from beam_jobs import columnar as col
from beam_jobs.split import COUNT, COUNTS_SCHEMA, ID, sum_counts
from recsys.core.layout import DataFile
from recsys.core.schema import GENRES, TITLE

VOCAB_DIR = DataFile.VOCAB
USERS_FILE = "users.txt"
ITEMS_FILE = "items.txt"
ITEM_FEATURES_FILE = DataFile.ITEM_FEATURES
USER_FEATURES_FILE = DataFile.USER_FEATURES
USER_ID_COLUMN = "user_id"
ITEM_FEATURES_SCHEMA = pa.schema(
    [
        ("item_id", pa.string()),
        ("train_count", pa.int64()),
        (GENRES, pa.list_(pa.string())),
        (TITLE, pa.string()),
    ]
)


def ranked(counts: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """(id, count) pairs by count descending, then id ascending."""
    return sorted(counts, key=lambda pair: (-pair[1], pair[0]))


def ranked_table(counts: pa.Table, min_count: int = 1) -> pa.Table:
    """An (id, count) table ranked like `ranked`, without ids seen fewer than min_count times.

    Arrow sorts strings by UTF-8 bytes, which is code point order: the order of `ranked`.
    """
    kept = counts.filter(pc.greater_equal(counts.column(COUNT), min_count))
    return kept.sort_by([(COUNT, "descending"), (ID, "ascending")])


def write_ids(ranking: pa.Table, path: Path) -> int:
    """Write a ranking's ids one per line; returns their number."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = ranking.column(ID).to_pylist()
    path.write_text("".join(f"{id_}\n" for id_ in ids), encoding="utf-8")
    return len(ids)


def write_user_vocab(
    parts: list[bytes],
    out_dir: str,
    min_count: int = 1,
    features: Mapping[str, tuple[str | None, ...]] | None = None,
    feature_names: tuple[str, ...] = (),
) -> int:
    """vocab/users.txt (and user_features.parquet in the same order when a user file is
    given) from per-shard (user, train rows) tables; returns the number of users."""
    ranking = ranked_table(col.concat_ipc(parts, COUNTS_SCHEMA), min_count)
    count = write_ids(ranking, Path(out_dir) / VOCAB_DIR / USERS_FILE)
    if feature_names:
        write_user_features(ranking.column(ID).to_pylist(), features or {}, feature_names, out_dir)
    return count


def write_user_features(
    users: list[str],
    features: Mapping[str, tuple[str | None, ...]],
    names: tuple[str, ...],
    out_dir: str,
) -> None:
    """user_features.parquet: user_id and one string column per side-file feature (null when
    the user has no row), in vocab order."""
    missing = (None,) * len(names)
    rows = [features.get(user, missing) for user in users]
    columns: dict[str, list[str | None]] = {USER_ID_COLUMN: list(users)}
    for k, name in enumerate(names):
        columns[name] = [row[k] for row in rows]
    schema = pa.schema([(name, pa.string()) for name in columns])
    pq.write_table(pa.table(columns, schema=schema), Path(out_dir) / USER_FEATURES_FILE)


def write_item_vocab(
    parts: list[bytes],
    out_dir: str,
    min_count: int = 1,
    features: Mapping[str, tuple[tuple[str, ...], str]] | None = None,
) -> int:
    """vocab/items.txt and item_features.parquet in the same order; returns the number of items.

    `parts` are per-shard (item, train rows) tables, summed here. `features` maps item id ->
    (genres, title) from the item side file; items without a row there (or with no side file)
    get no genres and an empty title.
    """
    ranking = ranked_table(col.from_ipc(sum_counts(parts)), min_count)
    write_ids(ranking, Path(out_dir) / VOCAB_DIR / ITEMS_FILE)
    ids = ranking.column(ID).to_pylist()
    features = features or {}
    side = [features.get(id_, ((), "")) for id_ in ids]
    table = pa.table(
        {
            "item_id": ids,
            "train_count": ranking.column(COUNT).combine_chunks(),
            GENRES: [list(genres) for genres, _ in side],
            TITLE: [title for _, title in side],
        },
        schema=ITEM_FEATURES_SCHEMA,
    )
    pq.write_table(table, Path(out_dir) / ITEM_FEATURES_FILE)
    return len(ids)


class BuildVocabularies(beam.PTransform):
    """Per-shard (user, train rows) and (item, train rows) tables -> the vocabulary files (and
    item/user feature files); outputs the number of users and of items, one element each."""

    def __init__(
        self,
        out_dir: str,
        min_count: int = 1,
        item_features: beam.PCollection | None = None,
        user_features: beam.PCollection | None = None,
        user_feature_names: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self._out = out_dir
        self._min = min_count
        self._features = item_features
        self._user_features = user_features
        self._user_names = user_feature_names

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(
        self, counts: tuple[beam.PCollection, beam.PCollection]
    ) -> tuple[beam.PCollection, beam.PCollection]:
        user_counts, item_counts = counts
        as_dict = beam.pvalue.AsDict
        user_side = as_dict(self._user_features) if self._user_features is not None else None
        users = (
            user_counts
            | "AllUsers" >> beam.combiners.ToList()
            | "WriteUsers"
            >> beam.Map(
                write_user_vocab,
                self._out,
                self._min,
                features=user_side,
                feature_names=self._user_names,
            )
        )
        features = as_dict(self._features) if self._features is not None else None
        items = (
            item_counts
            | "AllItems" >> beam.combiners.ToList()
            | "WriteItems" >> beam.Map(write_item_vocab, self._out, self._min, features=features)
        )
        return users, items
