"""Item and user embeddings as Parquet, for retrieval indexes (ScaNN, FAISS, vector databases).

Contract (docs/SERVING.md): one row per id with columns `<item_id|user_id>` (string),
`embedding` (fixed_size_list<float32>[d], L2-normalised tower output) and `model_version`
(int64), then optional extra columns (popularity, interactions, last_seen); row groups of
ROW_GROUP_SIZE rows so readers can stream a file group by group. Files are written to a
temporary sibling and published with os.replace. `serving_export.manifest` ties a version's
files together and loads them with checks.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys.core.errors import DataError
from recsys.core.schema import ITEM_ID, USER_ID
from recsys.model import TrainedModel

EMBEDDING = "embedding"
MODEL_VERSION = "model_version"
ROW_GROUP_SIZE = 65_536
# Users are encoded this many at a time: bounds memory for tens of millions of users while
# keeping the per-call StringLookup rebuild inside TrainedModel.user_embeddings rare.
_ENCODE_CHUNK = 16 * ROW_GROUP_SIZE
_META_VERSION = b"recsys.model_version"

Chunk = tuple[Sequence[str], np.ndarray, dict[str, pa.Array]]


def embeddings_schema(
    id_column: str,
    dim: int,
    version: int,
    extra: Sequence[pa.Field] = (),
    normalization: str = "l2",
) -> pa.Schema:
    """The Arrow schema of an embeddings file (the version is also kept in the metadata)."""
    return pa.schema(
        [
            pa.field(id_column, pa.string(), nullable=False),
            pa.field(EMBEDDING, pa.list_(pa.float32(), dim), nullable=False),
            pa.field(MODEL_VERSION, pa.int64(), nullable=False),
            *extra,
        ],
        metadata={
            _META_VERSION: str(version).encode(),
            b"recsys.embedding_dim": str(dim).encode(),
            b"recsys.normalization": normalization.encode(),
        },
    )


def write_item_embeddings(
    model: TrainedModel,
    path: Path,
    version: int,
    columns: dict[str, pa.Array] | None = None,
) -> Path:
    """Write every catalog item's candidate vector (vocabulary order) to `path`.

    `columns`: extra columns aligned with `model.items` (e.g. popularity, last_seen).
    """
    vectors = model.item_embeddings().reshape(len(model.items), output_dim(model))
    columns = columns or {}
    extra = _fields(columns, len(model.items))
    chunk = [(model.items, vectors, columns)]
    return _write(
        Path(path), ITEM_ID, output_dim(model), version, chunk, extra, model.normalization
    )


def write_user_embeddings(
    model: TrainedModel,
    user_ids: Sequence[str],
    path: Path,
    version: int,
    histories: Sequence[Sequence[str]] | None = None,
    columns: dict[str, pa.Array] | None = None,
) -> Path:
    """Write the query vectors of `user_ids` (with their item histories) to `path`.

    Unknown ids use OOV buckets; `histories` (one per user, oldest first; None: empty) should
    be each user's latest items, the query a request would make now. `columns`: extra
    columns aligned with `user_ids` (e.g. interactions, last_seen).
    """
    user_ids = list(user_ids)
    if histories is not None and len(histories) != len(user_ids):
        raise ValueError(f"{len(histories)} histories for {len(user_ids)} users")
    columns = columns or {}
    extra = _fields(columns, len(user_ids))
    chunks = (
        (
            user_ids[i : i + _ENCODE_CHUNK],
            model.user_embeddings(
                user_ids[i : i + _ENCODE_CHUNK],
                None if histories is None else histories[i : i + _ENCODE_CHUNK],
            ),
            {name: array.slice(i, _ENCODE_CHUNK) for name, array in columns.items()},
        )
        for i in range(0, len(user_ids), _ENCODE_CHUNK)
    )
    return _write(
        Path(path), USER_ID, output_dim(model), version, chunks, extra, model.normalization
    )


def read_embeddings(path: Path) -> tuple[list[str], np.ndarray, int]:
    """Read an embeddings file back: ids, [n, d] float32 vectors, model version."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"embeddings file not found: {path}")
    table = pq.read_table(path)
    id_column = _id_column(table.schema, path)
    dim = _embedding_dim(table.schema, path)
    vectors = table[EMBEDDING].combine_chunks().flatten().to_numpy(zero_copy_only=False)
    ids = table[id_column].to_pylist()
    return ids, vectors.astype(np.float32).reshape(len(ids), dim), _version(table, path)


def output_dim(model: TrainedModel) -> int:
    """Width of a tower's output: the last hidden layer, or the embedding size without an MLP."""
    return model.output_dim


def _fields(columns: dict[str, pa.Array], rows: int) -> list[pa.Field]:
    reserved = {ITEM_ID, USER_ID, EMBEDDING, MODEL_VERSION}
    for name, array in columns.items():
        if name in reserved or len(array) != rows:
            raise ValueError(f"extra column {name!r}: {len(array)} values for {rows} rows")
    return [pa.field(name, array.type) for name, array in columns.items()]


def _write(
    path: Path,
    id_column: str,
    dim: int,
    version: int,
    chunks: Iterable[Chunk],
    extra: Sequence[pa.Field] = (),
    normalization: str = "l2",
) -> Path:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    schema = embeddings_schema(id_column, dim, version, extra, normalization)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            for table in _tables(schema, chunks, version):
                writer.write_table(table, row_group_size=ROW_GROUP_SIZE)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _tables(schema: pa.Schema, chunks: Iterable[Chunk], version: int) -> Iterator[pa.Table]:
    dim = schema.field(EMBEDDING).type.list_size
    for ids, vectors, columns in chunks:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.shape != (len(ids), dim):
            raise ValueError(
                f"expected {len(ids)} vectors of size {dim}, got shape {vectors.shape}"
            )
        flat = pa.array(vectors.reshape(-1), type=pa.float32())
        yield pa.Table.from_arrays(
            [
                pa.array(list(ids), type=pa.string()),
                pa.FixedSizeListArray.from_arrays(flat, dim),
                pa.array(np.full(len(ids), version, dtype=np.int64)),
                *(columns[f.name] for f in schema if f.name in columns),
            ],
            schema=schema,
        )


def _id_column(schema: pa.Schema, path: Path) -> str:
    present = [name for name in (ITEM_ID, USER_ID) if name in schema.names]
    if len(present) != 1 or EMBEDDING not in schema.names or MODEL_VERSION not in schema.names:
        raise DataError(
            f"{path}: not an embeddings file: expected columns item_id or user_id, "
            f"{EMBEDDING}, {MODEL_VERSION}; found {schema.names}"
        )
    return present[0]


def _embedding_dim(schema: pa.Schema, path: Path) -> int:
    kind = schema.field(EMBEDDING).type
    if not pa.types.is_fixed_size_list(kind) or kind.value_type != pa.float32():
        raise DataError(f"{path}: column {EMBEDDING} must be fixed_size_list<float32>, got {kind}")
    return kind.list_size


def _version(table: pa.Table, path: Path) -> int:
    versions = np.unique(table[MODEL_VERSION].to_numpy())
    if len(versions) > 1:
        raise DataError(f"{path}: mixes model versions {versions.tolist()}; expected one")
    if len(versions) == 1:
        return int(versions[0])
    meta = table.schema.metadata or {}
    if _META_VERSION not in meta:
        raise DataError(f"{path}: empty file without {_META_VERSION.decode()} metadata")
    return int(meta[_META_VERSION])
