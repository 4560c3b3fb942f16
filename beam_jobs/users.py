"""User side files (e.g. age, gender, occupation): read in Beam and joined, in vocabulary order,
into `user_features.parquet` next to `item_features.parquet`.

Formats: a delimited file (header, or columns by index) or JSON Lines, and the MovieLens
presets: 100K `u.user` (`id|age|gender|occupation|zip`) and 1M `users.dat`
(`id::gender::age::occupation::zip`). Values are kept as text (null when absent): the
model decides how to bucket them. Unlike items, users need no row in the side file: a log's
users are not limited to a known list, so a missing row gives nulls, not a rejection.
"""

import csv
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import apache_beam as beam
from apache_beam.typehints import no_annotations

from beam_jobs.items import _text_lines, preset_side_file
from recsys.core import storage
from recsys.core.config import DataConfig, UsersConfig
from recsys.core.errors import DataError

log = logging.getLogger(__name__)

UserFeatures = tuple[str | None, ...]  # values in the order of the feature names
ML100K_USER_COLUMNS = ("user_id", "age", "gender", "occupation", "zip_code")
ML1M_USER_COLUMNS = ("user_id", "gender", "age", "occupation", "zip_code")
ML_FEATURES = ("age", "gender", "occupation", "zip_code")
PRESET_USERS = {
    "movielens-100k": ("u.user", "movielens-100k"),
    "movielens-1m": ("users.dat", "movielens-dat"),
}


def user_source(data: DataConfig, ratings_files: list[str]) -> UsersConfig | None:
    """The user side file to read: data.users, else a MovieLens preset's file if present."""
    if data.users is not None:
        if not data.users.path:
            raise DataError("data.users.path is required when data.users is set")
        return data.users
    found = preset_side_file(data.source, ratings_files, PRESET_USERS)
    return UsersConfig(path=found[0], format=found[1]) if found else None  # type: ignore[arg-type]


def feature_names(cfg: UsersConfig) -> tuple[str, ...]:
    """The feature columns user_features.parquet will have, in order."""
    if cfg.format in ("movielens-100k", "movielens-dat"):
        return tuple(cfg.columns or ML_FEATURES)
    if cfg.columns is not None:
        return tuple(cfg.columns)
    if cfg.format == "jsonl":
        keys: dict[str, None] = {}
        for _, line in _text_lines(cfg.path or "", cfg.encoding):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                keys.update(dict.fromkeys(str(k) for k in row))
        return tuple(k for k in keys if k != cfg.id_column)
    return tuple(n for n in _header(cfg) if n != cfg.id_column)


def _header(cfg: UsersConfig) -> list[str]:
    for _, line in _text_lines(cfg.path or "", cfg.encoding):
        fields = next(csv.reader([line], delimiter=_delimiter(cfg)))
        if cfg.header:
            return [h.strip().removeprefix("\ufeff") for h in fields]
        return [str(i) for i in range(len(fields))]
    return []


def _delimiter(cfg: UsersConfig) -> str:
    return "\t" if cfg.delimiter in ("tab", "\\t") else cfg.delimiter


def read_users(cfg: UsersConfig, names: tuple[str, ...]) -> Iterator[tuple[str, UserFeatures]]:
    """(user id, feature values) per row of the side file; rows without an id are skipped."""
    path = cfg.path or ""
    if storage.file_size(path) is None:
        raise DataError(f"user file not found: {path} (data.users.path)")
    if cfg.format == "movielens-100k":
        rows = _split_rows(path, "|", ML100K_USER_COLUMNS, "latin-1")
    elif cfg.format == "movielens-dat":
        rows = _split_rows(path, "::", ML1M_USER_COLUMNS, "latin-1")
    elif cfg.format == "jsonl":
        rows = _jsonl_rows(path, cfg)
    else:
        rows = _delimited_rows(path, cfg)
    id_column = "user_id" if cfg.format.startswith("movielens") else cfg.id_column
    skipped = 0
    for row in rows:
        user = _text(row.get(id_column))
        if user and user.isprintable():
            yield user, tuple(_text(row.get(name)) for name in names)
        else:
            skipped += 1
    if skipped:
        log.warning("%s: skipped %d user row(s) without a usable id", path, skipped)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    text = (json.dumps(value) if isinstance(value, dict | list) else str(value)).strip()
    return text or None


def _split_rows(
    path: str, separator: str, columns: tuple[str, ...], encoding: str
) -> Iterator[Mapping[str, Any]]:
    for _, line in _text_lines(path, encoding):
        yield dict(zip(columns, line.split(separator), strict=False))


def _delimited_rows(path: str, cfg: UsersConfig) -> Iterator[Mapping[str, Any]]:
    lines = (text for _, text in _text_lines(path, cfg.encoding))
    reader = csv.reader(lines, delimiter=_delimiter(cfg))
    header = None
    if cfg.header:
        header = [h.strip().removeprefix("\ufeff") for h in next(reader, [])]
    for fields in reader:
        names = header or [str(i) for i in range(len(fields))]
        yield dict(zip(names, fields, strict=False))


def _jsonl_rows(path: str, cfg: UsersConfig) -> Iterator[Mapping[str, Any]]:
    for n, line in _text_lines(path, cfg.encoding):
        try:
            row = json.loads(line)
        except ValueError:
            log.warning("%s line %d: not JSON, skipped", path, n)
            continue
        if isinstance(row, dict):
            yield row


class ReadUsers(beam.PTransform):
    """The user side file as a PCollection of (user id, feature values); one row per id."""

    def __init__(self, cfg: UsersConfig, names: tuple[str, ...]) -> None:
        super().__init__()
        self._cfg = cfg
        self._names = names

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection:
        return (
            pbegin
            | "UserFile" >> beam.Create([self._cfg])
            | "ReadUserRows" >> beam.FlatMap(read_users, self._names)
            | "ByUser" >> beam.GroupByKey()
            # The smallest row of a repeated id, not the first: arrival order is not stable.
            | "OneRow" >> beam.MapTuple(lambda user, rows: (user, min(rows, key=_sort_key)))
        )


def _sort_key(row: UserFeatures) -> tuple[tuple[bool, str], ...]:
    return tuple((value is not None, value or "") for value in row)
