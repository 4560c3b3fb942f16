"""`embeddings/<version>/manifest.json`: what a version's embedding files are, and proof of it.

The manifest ties items.parquet and users.parquet (and an optional ANN index) to the query
and candidate SavedModels of the same version: dimension, normalisation, similarity, the
vocabulary hashes, row counts and SHA-256 checksums. `load_embeddings` reads a file back only
if it agrees with its manifest, so an index is never built from a truncated file, from another
model's vectors or with the wrong dimension.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from recsys.core.errors import DataError, EmbeddingsContractError
from recsys.core.layout import EmbeddingsFile
from recsys.core.schema import ITEM_ID, USER_ID
from serving_export.embeddings import EMBEDDING, MODEL_VERSION, ROW_GROUP_SIZE, read_embeddings

MANIFEST = EmbeddingsFile.MANIFEST
FORMAT_VERSION = 1
KINDS = {"items": ITEM_ID, "users": USER_ID}
SIMILARITY = "dot"


@dataclass
class Embeddings:
    """One validated embeddings file: ids, [n, d] float32 vectors, its version and manifest."""

    ids: list[str]
    vectors: np.ndarray
    version: int
    manifest: dict[str, Any]
    columns: dict[str, list[Any]]


def vocabulary_hash(ids: Iterable[str]) -> str:
    """SHA-256 of the ids, each followed by "\\n" (= the SavedModel's vocabulary asset file)."""
    digest = hashlib.sha256()
    for value in ids:
        digest.update(value.encode("utf-8") + b"\n")
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in 8 MiB blocks (user files can exceed memory)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(
    directory: Path,
    version: int,
    dim: int,
    vocabularies: dict[str, list[str]],
    models: dict[str, Path] | None = None,
    ann: dict[str, Any] | None = None,
    normalization: str = "l2",
) -> Path:
    """Describe the embeddings files in `directory` (kind -> the ids they were written for).

    `models`: the SavedModel dirs of the same version (their fingerprints are recorded).
    """
    directory = Path(directory)
    files = {}
    for kind, ids in vocabularies.items():
        path = directory / f"{kind}.parquet"
        meta = pq.ParquetFile(path).metadata
        files[kind] = {
            "file": path.name,
            "id_column": KINDS[kind],
            "rows": meta.num_rows,
            "row_groups": meta.num_row_groups,
            "row_group_size": ROW_GROUP_SIZE,
            "bytes": path.stat().st_size,
            "sha256": file_sha256(path),
            "vocabulary_sha256": vocabulary_hash(ids),
        }
    manifest = {
        "format_version": FORMAT_VERSION,
        "model_version": version,
        "embedding_dim": dim,
        "dtype": "float32",
        "normalization": normalization,
        "similarity": SIMILARITY,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "models": {name: _model_entry(Path(path)) for name, path in (models or {}).items()},
        "files": files,
        "ann": ann,
    }
    return write_json_atomic(directory / MANIFEST, manifest)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of an embeddings version folder (DataError if missing or unreadable)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DataError(f"no {MANIFEST} in {directory}: not an exported embeddings version")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise EmbeddingsContractError(
            f"{path}: format_version {manifest.get('format_version')!r}, this reader knows "
            f"{FORMAT_VERSION}",
            "format_version",
        )
    return manifest


def load_embeddings(
    directory: Path,
    kind: str = "items",
    expected_dim: int | None = None,
    expected_vocabulary_hash: str | None = None,
    verify_checksum: bool = True,
) -> Embeddings:
    """Read `<kind>.parquet` of an embeddings version, refusing anything its manifest denies.

    Raises EmbeddingsContractError (its `field` says which check) when the checksum, row
    count, dimension, vocabulary hash or model version disagrees with the manifest, or with
    `expected_dim` / `expected_vocabulary_hash` (what the consumer's index was built for).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    directory = Path(directory)
    manifest = read_manifest(directory)
    entry = manifest["files"].get(kind)
    if entry is None:
        raise DataError(f"{directory / MANIFEST} lists no {kind} file")
    path = directory / entry["file"]
    if verify_checksum:
        digest = file_sha256(path) if path.is_file() else None
        if digest is None:
            raise DataError(f"embeddings file not found: {path}")
        _agree(path, "checksum", "sha256", digest, entry["sha256"])
    dim = manifest["embedding_dim"]
    if expected_dim is not None:
        _agree(path, "dim", "embedding dim (manifest)", dim, expected_dim, "expected")
    ids, vectors, version = read_embeddings(path)
    _agree(path, "dim", "embedding dim", vectors.shape[1], dim)
    _agree(path, "rows", "row count", len(ids), entry["rows"])
    _agree(path, "model_version", "model_version", version, manifest["model_version"])
    vocab = vocabulary_hash(ids)
    _agree(path, "vocabulary_hash", "vocabulary sha256", vocab, entry["vocabulary_sha256"])
    if expected_vocabulary_hash is not None:
        want = expected_vocabulary_hash
        _agree(path, "vocabulary_hash", "vocabulary sha256", vocab, want, "expected")
    skip = {KINDS[kind], EMBEDDING, MODEL_VERSION}
    names = [n for n in pq.read_schema(path).names if n not in skip]
    columns = pq.read_table(path, columns=names).to_pydict() if names else {}
    return Embeddings(ids, vectors, version, manifest, columns)


def write_json_atomic(path: Path, payload: Any) -> Path:
    """Write JSON to a temporary sibling and os.replace it onto `path`."""
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _agree(
    path: Path, field: str, what: str, got: Any, want: Any, source: str = "manifest"
) -> None:
    if got != want:
        raise EmbeddingsContractError(
            f"{path}: {what} is {got}, the {source} says {want}; refusing to load it "
            "(re-export the version or fix the consumer)",
            field,
        )


def _model_entry(model_dir: Path) -> dict[str, Any]:
    """The SavedModel's version folder and fingerprint (saved_model_checksum), if it has one."""
    entry: dict[str, Any] = {"version": int(model_dir.name)}
    if (model_dir / "fingerprint.pb").is_file():
        import tensorflow as tf

        fingerprint = tf.saved_model.experimental.read_fingerprint(str(model_dir))
        entry["saved_model_checksum"] = str(fingerprint.saved_model_checksum)
    return entry
