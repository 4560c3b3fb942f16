"""Item side files (genres, title): read, joined into item_features.parquet, and used to reject
interactions with items the catalog does not know.

Formats: a delimited file (header or columns by index) or JSON Lines with an id, a title and a
genres column (one separated string, or a JSON list), and the MovieLens presets: 100K `u.item`
(latin-1, 19 genre flag columns named by `u.genre`), 1M/10M `movies.dat` (`id::title::genres`)
and ml-latest `movies.csv` (`movieId,title,genres`).
"""

import csv
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import apache_beam as beam
from apache_beam.typehints import no_annotations

from beam_jobs.records import UNKNOWN_ITEM, Rejection, rejection
from recsys.core import storage
from recsys.core.config import DataConfig, ItemsConfig
from recsys.core.errors import DataError
from recsys.core.schema import ITEM_ID

log = logging.getLogger(__name__)

REJECTED = "rejected"
ItemFeatures = tuple[tuple[str, ...], str]  # (genres, title)
NO_FEATURES: ItemFeatures = ((), "")

ML100K_GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
    "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance",
    "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
ML100K_FLAGS_FROM = 5  # id|title|release date|video release date|IMDb URL|19 flags
NO_GENRES = "(no genres listed)"  # ml-latest's placeholder
# The side file a MovieLens preset reads next to its ratings file.
PRESET_ITEMS = {
    "movielens-100k": ("u.item", "movielens-100k"),
    "movielens-1m": ("movies.dat", "movielens-dat"),
    "movielens-10m": ("movies.dat", "movielens-dat"),
    "movielens-latest": ("movies.csv", "movielens-latest"),
}


def preset_side_file(
    source: str, ratings_files: list[str], presets: Mapping[str, tuple[str, str]]
) -> tuple[str, str] | None:
    """(path, format) of a MovieLens preset's side file next to its ratings file, if present."""
    if source in presets and ratings_files:
        name, fmt = presets[source]
        path = storage.sibling(ratings_files[0], name)
        if storage.file_size(path) is not None:
            return path, fmt
    return None


def item_source(data: DataConfig, ratings_files: list[str]) -> ItemsConfig | None:
    """The item side file to read: data.items, else a MovieLens preset's file if present."""
    if data.items is not None:
        if not data.items.path:
            raise DataError("data.items.path is required when data.items is set")
        return data.items
    found = preset_side_file(data.source, ratings_files, PRESET_ITEMS)
    return ItemsConfig(path=found[0], format=found[1]) if found else None  # type: ignore[arg-type]


def _text_lines(path: str, encoding: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of a file; a line not in `encoding` is read as latin-1 (never fails)."""
    with storage.open_input(path) as fh:
        for n, data in enumerate(fh, start=1):
            try:
                text = data.decode(encoding)
            except UnicodeDecodeError:
                text = data.decode("latin-1")
            text = text.rstrip("\r\n")
            if text.strip():
                yield n, text


def _genres(value: Any, separator: str) -> tuple[str, ...]:
    if value is None:
        return ()
    parts = value if isinstance(value, list) else str(value).split(separator)
    genres = (str(g).strip() for g in parts)
    return tuple(dict.fromkeys(g for g in genres if g and g != NO_GENRES))


def read_items(cfg: ItemsConfig) -> Iterator[tuple[str, ItemFeatures]]:
    """(item id, (genres, title)) per row of the side file; rows without an id are skipped."""
    path = cfg.path or ""
    if storage.file_size(path) is None:
        raise DataError(f"item file not found: {path} (data.items.path)")
    if cfg.format == "movielens-100k":
        rows = _ml100k_items(path)
    elif cfg.format == "movielens-dat":
        rows = (
            (f[0], (_genres(f[2], "|"), f[1]))
            for _, line in _text_lines(path, "utf-8")
            if len(f := line.split("::")) == 3
        )
    elif cfg.format == "movielens-latest":
        rows = _delimited_items(path, ItemsConfig(path=path, id_column="movieId"))
    elif cfg.format == "jsonl":
        rows = _jsonl_items(path, cfg)
    else:
        rows = _delimited_items(path, cfg)
    skipped = 0
    for item_id, features in rows:
        item_id = item_id.strip()
        if item_id and item_id.isprintable():
            yield item_id, features
        else:
            skipped += 1
    if skipped:
        log.warning("%s: skipped %d item row(s) without a usable id", path, skipped)


def _ml100k_items(path: str) -> Iterator[tuple[str, ItemFeatures]]:
    genre_file = storage.sibling(path, "u.genre")
    names = list(ML100K_GENRES)
    if storage.file_size(genre_file) is not None:
        pairs = [line.rsplit("|", 1) for _, line in _text_lines(genre_file, "latin-1")]
        names = [
            name for name, _ in sorted((p for p in pairs if len(p) == 2), key=lambda p: int(p[1]))
        ]
    for _, line in _text_lines(path, "latin-1"):
        fields = line.split("|")
        flags = fields[ML100K_FLAGS_FROM:]
        genres = tuple(name for name, flag in zip(names, flags, strict=False) if flag == "1")
        yield fields[0], (genres, fields[1] if len(fields) > 1 else "")


def _delimited_items(path: str, cfg: ItemsConfig) -> Iterator[tuple[str, ItemFeatures]]:
    delimiter = "\t" if cfg.delimiter in ("tab", "\\t") else cfg.delimiter
    lines = (text for _, text in _text_lines(path, cfg.encoding))
    reader = csv.reader(lines, delimiter=delimiter)
    header = None
    if cfg.header:
        header = [h.strip().removeprefix("\ufeff") for h in next(reader, [])]
    for fields in reader:
        names = header or [str(i) for i in range(len(fields))]
        row = dict(zip(names, fields, strict=False))
        yield _features(row, cfg)


def _jsonl_items(path: str, cfg: ItemsConfig) -> Iterator[tuple[str, ItemFeatures]]:
    for n, line in _text_lines(path, cfg.encoding):
        try:
            row = json.loads(line)
        except ValueError:
            log.warning("%s line %d: not JSON, skipped", path, n)
            continue
        if isinstance(row, dict):
            yield _features(row, cfg)


def _features(row: Mapping[str, Any], cfg: ItemsConfig) -> tuple[str, ItemFeatures]:
    item_id = row.get(cfg.id_column)
    title = row.get(cfg.title_column) if cfg.title_column else None
    genres = row.get(cfg.genres_column) if cfg.genres_column else None
    return (
        "" if item_id is None else str(item_id),
        (_genres(genres, cfg.genres_separator), "" if title is None else str(title).strip()),
    )


def unknown_item(file: str, row: int, raw: str) -> Rejection:
    """The rejection of an interaction whose item is not in the item file."""
    return rejection(file, row, ITEM_ID, UNKNOWN_ITEM, raw)


class ReadItems(beam.PTransform):
    """The item side file as a PCollection of (item id, (genres, title)); one row per id."""

    def __init__(self, cfg: ItemsConfig) -> None:
        super().__init__()
        self._cfg = cfg

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection:
        merge = self._cfg.merge_rows
        return (
            pbegin
            | "ItemFile" >> beam.Create([self._cfg])
            | "ReadItemRows" >> beam.FlatMap(read_items)
            | "ByItem" >> beam.GroupByKey()
            | "OneRow" >> beam.MapTuple(lambda item, rows: (item, one_row(rows, merge)))
        )


def one_row(rows: Iterable[ItemFeatures], merge: bool) -> ItemFeatures:
    """An item's features from its rows: the smallest row, or (`merge`) every row's genres
    and the smallest non-empty title."""
    # Sorted, never in arrival order: Beam does not keep the file's order of a group.
    ordered = sorted(rows)
    if not merge:
        return ordered[0]
    genres = tuple(dict.fromkeys(g for row_genres, _ in ordered for g in row_genres))
    return genres, min((title for _, title in ordered if title), default="")
