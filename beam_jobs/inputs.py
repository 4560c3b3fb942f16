"""Resolve the `input_path` argument into the sorted list of files the job reads."""

import glob
from dataclasses import dataclass
from pathlib import Path

from recsys.errors import DataError

MOVIELENS_RATINGS = "u.data"
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True, order=True)
class InputFile:
    """One input file: its absolute path and its size in bytes."""

    path: str
    bytes: int


def list_input_files(input_path: str | Path, source: str) -> list[InputFile]:
    """The files behind a file, a directory (its files, sorted) or a glob; DataError if none."""
    path = Path(input_path).expanduser()
    if path.is_dir():
        candidates = _directory_files(path, source)
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


def _directory_files(path: Path, source: str) -> list[Path]:
    # MovieLens folders hold u.item, u.user, ... next to the ratings: read only u.data.
    if source == "movielens-100k":
        ratings = path / MOVIELENS_RATINGS
        if not ratings.is_file():
            raise DataError(f"{path} has no {MOVIELENS_RATINGS}: is it the MovieLens 100K folder?")
        return [ratings]
    return [p for p in path.iterdir() if not _is_hidden(p)]


def _is_hidden(path: Path) -> bool:
    # Markers and checksums other tools leave next to data (_SUCCESS, .part.crc) are not input.
    return path.name.startswith((".", "_"))
