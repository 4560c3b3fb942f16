"""Embeddings Parquet files (serving_export.embeddings)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from recsys.config import ModelConfig
from recsys.errors import DataError
from recsys.model import TrainedModel
from serving_export import embeddings
from serving_export.embeddings import (
    read_embeddings,
    write_item_embeddings,
    write_user_embeddings,
)

USERS = [f"user-{i}" for i in range(20)]
ITEMS = [f"item-{i}" for i in range(30)]
DIM = 5


@pytest.fixture(scope="module")
def model() -> TrainedModel:
    tf.keras.utils.set_random_seed(11)
    return TrainedModel.build(USERS, ITEMS, ModelConfig(embedding_dim=8, hidden_dims=[DIM]))


def test_items_file_schema_and_values(model: TrainedModel, tmp_path: Path) -> None:
    path = write_item_embeddings(model, tmp_path / "embeddings" / "7" / "items.parquet", 7)
    schema = pq.read_schema(path)
    assert schema.names == ["item_id", "embedding", "model_version"]
    assert schema.field("item_id").type == pa.string()
    assert schema.field("embedding").type == pa.list_(pa.float32(), DIM)
    assert schema.field("model_version").type == pa.int64()
    assert schema.metadata[b"recsys.model_version"] == b"7"
    table = pq.read_table(path)
    assert table["item_id"].to_pylist() == ITEMS
    assert set(table["model_version"].to_pylist()) == {7}
    ids, vectors, version = read_embeddings(path)
    assert (ids, version) == (ITEMS, 7)
    assert vectors.dtype == np.float32 and vectors.shape == (len(ITEMS), DIM)
    np.testing.assert_array_equal(vectors, model.item_embeddings())


def test_users_round_trip_in_streaming_row_groups(
    model: TrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embeddings, "ROW_GROUP_SIZE", 4)
    monkeypatch.setattr(embeddings, "_ENCODE_CHUNK", 8)  # several encode chunks, too
    user_ids = [*USERS, "brand-new-user"]
    path = write_user_embeddings(model, user_ids, tmp_path / "users.parquet", 2)
    assert pq.read_schema(path).names == ["user_id", "embedding", "model_version"]
    meta = pq.ParquetFile(path).metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert sum(sizes) == len(user_ids) and max(sizes) == 4
    ids, vectors, version = read_embeddings(path)
    assert (ids, version) == (user_ids, 2)
    np.testing.assert_array_equal(vectors, model.user_embeddings(user_ids))


def test_empty_user_list_keeps_schema_and_version(model: TrainedModel, tmp_path: Path) -> None:
    ids, vectors, version = read_embeddings(
        write_user_embeddings(model, [], tmp_path / "users.parquet", 9)
    )
    assert (ids, vectors.shape, version) == ([], (0, DIM), 9)


def test_failed_write_leaves_old_file_and_no_temp(
    model: TrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_item_embeddings(model, tmp_path / "items.parquet", 1)
    before = path.read_bytes()

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", fail)
    with pytest.raises(OSError, match="disk full"):
        write_item_embeddings(model, path, 2)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["items.parquet"]


def test_read_rejects_files_that_break_the_contract(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        read_embeddings(tmp_path / "missing.parquet")
    pq.write_table(pa.table({"id": ["a"], "vec": [[1.0]]}), tmp_path / "other.parquet")
    with pytest.raises(DataError, match="not an embeddings file"):
        read_embeddings(tmp_path / "other.parquet")
    doubles = pa.table({"item_id": ["a"], "embedding": [[1.0, 2.0]], "model_version": [1]})
    pq.write_table(doubles, tmp_path / "doubles.parquet")
    with pytest.raises(DataError, match="fixed_size_list<float32>"):
        read_embeddings(tmp_path / "doubles.parquet")


def test_rejects_negative_version(model: TrainedModel, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="non-negative"):
        write_item_embeddings(model, tmp_path / "items.parquet", -1)
