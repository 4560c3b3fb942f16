"""Resolve the `input_path` argument into the sorted list of files the job reads."""

import datetime as dt
import fnmatch
import glob
import re
from dataclasses import dataclass
from pathlib import Path

from recsys.core import storage
from recsys.core.errors import DataError

MOVIELENS_RATINGS = "u.data"
# The ratings file a MovieLens preset reads from its folder (the other files are side files).
PRESET_RATINGS = {
    "movielens-100k": MOVIELENS_RATINGS,
    "movielens-1m": "ratings.dat",
    "movielens-10m": "ratings.dat",
    "movielens-latest": "ratings.csv",
}
# Hive-style day partitions: events/date=2026-01-05/part-0.parquet.
_PARTITION = re.compile(r"^date=(\d{4}-\d{2}-\d{2})$")
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True, order=True)
class InputFile:
    """One input file: its absolute path and its size in bytes."""

    path: str
    bytes: int


def list_input_files(
    input_path: str | Path, source: str, run_date: dt.date | None = None
) -> list[InputFile]:
    """The files behind a file, a directory (its files, sorted) or a glob; DataError if none.

    A directory's `date=YYYY-MM-DD` sub-folders are day partitions: those up to and including
    `run_date` (all of them without one) are read, so each night adds one day. An `s3://` or
    `gs://` URI is listed the same way in object storage (a prefix is a directory).
    """
    if storage.is_uri(input_path):
        return _remote_files(str(input_path), source, run_date)
    path = Path(input_path).expanduser()
    if path.is_dir():
        candidates = _directory_files(path, source, run_date)
    elif path.is_file():
        candidates = [path]
    elif _GLOB_CHARS & set(str(input_path)):
        candidates = [Path(p) for p in glob.glob(str(path)) if not _is_hidden(Path(p))]
    else:
        raise DataError(f"input not found: {input_path} (expected a file, a directory or a glob)")
    files = sorted(InputFile(str(p.resolve()), p.stat().st_size) for p in candidates if p.is_file())
    if not files:
        raise DataError(f"no input files in {input_path} for data.source '{source}'")
    return files


def _directory_files(path: Path, source: str, run_date: dt.date | None) -> list[Path]:
    # MovieLens folders hold u.item, movies.dat, ... next to the ratings: read only those.
    if source in PRESET_RATINGS:
        ratings = path / PRESET_RATINGS[source]
        if not ratings.is_file():
            raise DataError(
                f"{path} has no {ratings.name}: is it the {source} folder? (data.source '{source}')"
            )
        return [ratings]
    files: list[Path] = []
    for p in path.iterdir():
        if _is_hidden(p):
            continue
        match = _PARTITION.match(p.name)
        if match and p.is_dir():
            day = _partition_day(p, match.group(1))
            if run_date is None or day <= run_date:
                files.extend(q for q in p.iterdir() if q.is_file() and not _is_hidden(q))
        else:
            files.append(p)
    return files


def _remote_files(uri: str, source: str, run_date: dt.date | None) -> list[InputFile]:
    """The objects behind a URI: one object, a prefix (as a directory) or a glob."""
    uri = uri.rstrip("/")
    size = storage.file_size(uri)
    if size is not None:
        found = {uri: size}
    elif _GLOB_CHARS & set(uri):
        found = _remote_glob(uri)
    else:
        found = _remote_directory(uri, source, run_date)
    if not found:
        raise DataError(f"no input files in {uri} for data.source '{source}'")
    return sorted(InputFile(path, n) for path, n in found.items())


def _remote_directory(uri: str, source: str, run_date: dt.date | None) -> dict[str, int]:
    if source in PRESET_RATINGS:
        ratings = f"{uri}/{PRESET_RATINGS[source]}"
        size = storage.file_size(ratings)
        if size is None:
            raise DataError(
                f"{uri} has no {PRESET_RATINGS[source]}: is it the {source} folder? "
                f"(data.source '{source}')"
            )
        return {ratings: size}
    listed = storage.list_files(uri)
    if not listed:
        raise DataError(f"input not found: {uri} (expected an object, a prefix or a glob)")
    found = {}
    for name, size in listed.items():
        parts = name.split("/")
        if any(part.startswith((".", "_")) for part in parts):
            continue
        if len(parts) == 1:
            found[f"{uri}/{name}"] = size
            continue
        match = _PARTITION.match(parts[0])
        if match and len(parts) == 2:
            day = _partition_day(Path(parts[0]), match.group(1))
            if run_date is None or day <= run_date:
                found[f"{uri}/{name}"] = size
    return found


def _remote_glob(uri: str) -> dict[str, int]:
    # Object stores list by prefix: list below the part before the first wildcard, then match.
    first = min(uri.index(c) for c in _GLOB_CHARS if c in uri)
    prefix = uri[:first].rsplit("/", 1)[0]
    listed = storage.list_files(prefix)
    return {
        f"{prefix}/{name}": size
        for name, size in listed.items()
        if fnmatch.fnmatchcase(f"{prefix}/{name}", uri)
        and not any(part.startswith((".", "_")) for part in name.split("/"))
    }


def _partition_day(path: Path, text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise DataError(
            f"day partition {path} is not a valid date (expected date=YYYY-MM-DD)"
        ) from None


def _is_hidden(path: Path) -> bool:
    # Markers and checksums other tools leave next to data (_SUCCESS, .part.crc) are not input.
    return path.name.startswith((".", "_"))
