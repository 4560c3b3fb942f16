"""Resolve the `input_path` argument into the sorted list of files the job reads."""

import datetime as dt
import glob
import re
from dataclasses import dataclass
from pathlib import Path

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
    `run_date` (all of them without one) are read, so each night adds one day.
    """
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
