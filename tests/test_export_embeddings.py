"""Embeddings Parquet files, their manifest and validated loader, the ANN index, other formats."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from recsys.core.config import ModelConfig
from recsys.core.errors import DataError
from recsys.model import TrainedModel
from serving_export import embeddings
from serving_export.embeddings import (
    read_embeddings,
    write_item_embeddings,
    write_user_embeddings,
)
from tests.conftest import PLAIN_MODEL

USERS = [f"user-{i}" for i in range(20)]
ITEMS = [f"item-{i}" for i in range(30)]
DIM = 5


@pytest.fixture(scope="module")
def model() -> TrainedModel:
    tf.keras.utils.set_random_seed(11)
    config = ModelConfig(embedding_dim=8, hidden_dims=[DIM], **PLAIN_MODEL)
    return TrainedModel.build(USERS, ITEMS, config)


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
    # Encoded in chunks of 8 against one batch of 21: a matmul's blocking depends on the batch
    # shape (and the threads free), so values agree to float32 rounding, not bit for bit.
    np.testing.assert_allclose(vectors, model.user_embeddings(user_ids), rtol=1e-5, atol=1e-6)


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


# -- manifest, validated loading, ANN index, other formats ------------------------------------


@pytest.fixture(scope="module")
def version_dir(model: TrainedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An embeddings version folder as the export stage stages it (with a faiss index)."""
    from recsys.core.config import ExportConfig
    from serving_export.activity import TIMESTAMP_TYPE, Activity
    from serving_export.release import stage_embeddings

    seen = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
    activity = Activity(
        histories=None,
        user_columns={
            "interactions": pa.array(range(len(USERS)), pa.int64()),
            "last_seen": pa.array([seen] * (len(USERS) - 1) + [None], TIMESTAMP_TYPE),
        },
        item_columns={"popularity": pa.array(range(len(ITEMS)), pa.int64())},
    )
    directory = tmp_path_factory.mktemp("embeddings") / "4"
    config = ExportConfig(ann="faiss", ann_nlist=3, ann_nprobe=3, ann_recall_k=5)
    stage_embeddings(model, directory, 4, {}, config, activity)
    return directory


def copy_of(version_dir: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(version_dir, tmp_path / "4"))


def test_manifest_ties_the_files_to_the_model(model: TrainedModel, version_dir: Path) -> None:
    from serving_export.manifest import file_sha256, load_embeddings, vocabulary_hash

    items = load_embeddings(version_dir, "items", expected_dim=DIM)
    manifest = items.manifest
    assert (manifest["model_version"], manifest["embedding_dim"]) == (4, DIM)
    assert (manifest["normalization"], manifest["similarity"]) == ("l2", "dot")
    entry = manifest["files"]["items"]
    assert entry["rows"] == len(ITEMS) and entry["row_group_size"] == embeddings.ROW_GROUP_SIZE
    assert entry["sha256"] == file_sha256(version_dir / "items.parquet")
    # The vocabulary hash is the sha256 of the SavedModel's items.txt asset.
    assert entry["vocabulary_sha256"] == vocabulary_hash(ITEMS)
    asset = "".join(i + "\n" for i in ITEMS).encode()
    import hashlib

    assert entry["vocabulary_sha256"] == hashlib.sha256(asset).hexdigest()
    np.testing.assert_array_equal(items.vectors, model.item_embeddings())
    assert items.columns["popularity"] == list(range(len(ITEMS)))
    users = load_embeddings(version_dir, "users")
    assert users.ids == USERS and users.columns["interactions"] == list(range(len(USERS)))
    assert users.columns["last_seen"][-1] is None
    last_seen = pq.read_schema(version_dir / "users.parquet").field("last_seen")
    assert last_seen.type == pa.timestamp("ms", tz="UTC")
    assert users.columns["last_seen"][0] == dt.datetime(2026, 1, 2, tzinfo=dt.UTC)


def test_loader_refuses_files_that_disagree_with_the_manifest(
    version_dir: Path, tmp_path: Path
) -> None:
    import json

    from recsys.core.errors import EmbeddingsContractError
    from serving_export.manifest import MANIFEST, file_sha256, load_embeddings, vocabulary_hash

    with pytest.raises(EmbeddingsContractError, match=r"embedding dim .* expected says 64") as err:
        load_embeddings(version_dir, "items", expected_dim=64)
    assert err.value.field == "dim"
    with pytest.raises(EmbeddingsContractError, match="vocabulary sha256") as err:
        load_embeddings(version_dir, "items", expected_vocabulary_hash=vocabulary_hash(USERS))
    assert err.value.field == "vocabulary_hash"

    corrupt = copy_of(version_dir, tmp_path / "corrupt")
    with (corrupt / "items.parquet").open("r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00\x01\x02\x03")
    with pytest.raises(EmbeddingsContractError, match=r"sha256 is .* the manifest says") as err:
        load_embeddings(corrupt, "items")
    assert err.value.field == "checksum"

    # Another model's file with its own (consistent) checksum: the ids give it away.
    other = copy_of(version_dir, tmp_path / "other")
    table = pq.read_table(other / "items.parquet")
    renamed = table.set_column(0, "item_id", pa.array([f"x{i}" for i in range(len(ITEMS))]))
    pq.write_table(renamed, other / "items.parquet")
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["files"]["items"]["sha256"] = file_sha256(other / "items.parquet")
    (other / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EmbeddingsContractError, match="vocabulary sha256") as err:
        load_embeddings(other, "items")
    assert err.value.field == "vocabulary_hash"

    wrong_dim = copy_of(version_dir, tmp_path / "dim")
    manifest = json.loads((wrong_dim / MANIFEST).read_text())
    manifest["embedding_dim"] = DIM + 1
    (wrong_dim / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EmbeddingsContractError, match="embedding dim is 5") as err:
        load_embeddings(wrong_dim, "items")
    assert err.value.field == "dim"
    with pytest.raises(DataError, match=r"no manifest\.json"):
        load_embeddings(tmp_path, "items")


def test_ann_index_uses_inner_product_and_records_its_recall(
    model: TrainedModel, version_dir: Path
) -> None:
    import faiss

    from serving_export.ann import exact_top_k, load_ann_index
    from serving_export.manifest import load_embeddings

    entry = load_embeddings(version_dir, "items").manifest["ann"]
    assert (entry["metric"], entry["nlist"], entry["nprobe"]) == ("inner_product", 3, 3)
    # Every list probed: exact search, so recall@5 against brute force is 1.
    assert entry["recall"] == {"k": 5, "value": 1.0, "queries": len(USERS)}
    index = load_ann_index(version_dir)
    assert index.metric_type == faiss.METRIC_INNER_PRODUCT
    queries = model.user_embeddings(USERS)
    scores, ids = index.search(queries, 5)
    np.testing.assert_array_equal(ids, exact_top_k(model.item_embeddings(), queries, 5))
    np.testing.assert_allclose(
        scores[:, 0], (queries @ model.item_embeddings().T).max(1), atol=1e-5
    )


def test_ann_recall_drops_when_few_lists_are_probed() -> None:
    from serving_export.ann import build_index, recall_at_k

    rng = np.random.default_rng(0)
    items = rng.normal(size=(4000, 16)).astype(np.float32)
    items /= np.linalg.norm(items, axis=1, keepdims=True)
    queries = items[:200] + 0.1 * rng.normal(size=(200, 16)).astype(np.float32)
    coarse = recall_at_k(build_index(items, nlist=64, nprobe=1), items, queries, 10)
    fine = recall_at_k(build_index(items, nlist=64, nprobe=64), items, queries, 10)
    assert coarse < 0.9 < fine == 1.0


def test_ann_index_with_a_wrong_checksum_is_refused(version_dir: Path, tmp_path: Path) -> None:
    from recsys.core.errors import EmbeddingsContractError
    from serving_export.ann import INDEX_FILE, load_ann_index

    bad = copy_of(version_dir, tmp_path)
    with (bad / INDEX_FILE).open("ab") as handle:
        handle.write(b"x")
    with pytest.raises(EmbeddingsContractError, match="sha256"):
        load_ann_index(bad)


@pytest.mark.parametrize("fmt", ["parquet", "npy", "tfrecord"])
def test_cli_exports_a_version_in_each_format(
    model: TrainedModel, version_dir: Path, tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture
) -> None:
    from conductor.cli import main
    from serving_export.manifest import MANIFEST

    work = tmp_path / "work"
    copy_of(version_dir, work / "embeddings")
    out = tmp_path / "out"
    args = ["embeddings", "export", "--workdir", str(work), "--version", "4", "--format", fmt]
    assert main([*args, "--output", str(out)]) == 0
    assert f"wrote:       {out / MANIFEST}" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    if fmt == "parquet":
        assert names == sorted([MANIFEST, "items.parquet", "users.parquet"])
        ids, vectors, _ = read_embeddings(out / "items.parquet")
    elif fmt == "npy":
        assert names == sorted(
            [MANIFEST, "items.npy", "items_ids.npy", "users.npy", "users_ids.npy"]
        )
        ids, vectors = np.load(out / "items_ids.npy").tolist(), np.load(out / "items.npy")
    else:
        assert names == sorted([MANIFEST, "items.tfrecord", "users.tfrecord"])
        spec = {
            "item_id": tf.io.FixedLenFeature([], tf.string),
            "embedding": tf.io.FixedLenFeature([DIM], tf.float32),
            "model_version": tf.io.FixedLenFeature([], tf.int64),
            "popularity": tf.io.FixedLenFeature([], tf.int64),
        }
        rows = list(tf.data.TFRecordDataset(str(out / "items.tfrecord")).batch(100))
        parsed = tf.io.parse_example(rows[0], spec)
        assert parsed["popularity"].numpy().tolist() == list(range(len(ITEMS)))
        assert set(parsed["model_version"].numpy().tolist()) == {4}
        ids = [i.decode() for i in parsed["item_id"].numpy()]
        vectors = parsed["embedding"].numpy()
    assert ids == ITEMS
    np.testing.assert_array_equal(vectors, model.item_embeddings())


def test_cli_error_for_a_missing_version_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from conductor.cli import main

    args = ["embeddings", "export", "--workdir", str(tmp_path), "--version", "9", "--format", "npy"]
    assert main(args) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("recsys: error: no exported embeddings version at") and "\n" not in err
    assert "versions present: none" in err


def test_exact_top_k_in_bounded_chunks_equals_one_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    from recsys import topk
    from serving_export import ann

    rng = np.random.default_rng(1)
    items = rng.normal(size=(300, 8)).astype(np.float32)
    queries = rng.normal(size=(37, 8)).astype(np.float32)
    whole = np.argsort(-(queries @ items.T), axis=1, kind="stable")[:, :10]
    monkeypatch.setattr(topk, "_SCORE_BUDGET", 1000)  # 3 queries per chunk
    np.testing.assert_array_equal(ann.exact_top_k(items, queries, 10), whole)
    assert ann.exact_top_k(items, queries[:0], 10).shape == (0, 10)


def test_streamed_users_file_equals_one_chunk_file(
    model: TrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user_ids = [*USERS, "brand-new-user"]
    histories = [ITEMS[: i % 7] for i in range(len(user_ids))]
    columns = {"interactions": pa.array(range(len(user_ids)), pa.int64())}
    whole = write_user_embeddings(
        model, user_ids, tmp_path / "whole.parquet", 3, histories, columns
    )  # the default chunk holds all 21 users: one encode call, as before streaming
    monkeypatch.setattr(embeddings, "ROW_GROUP_SIZE", 4)
    monkeypatch.setattr(embeddings, "_ENCODE_CHUNK", 4)
    streamed = write_user_embeddings(
        model, user_ids, tmp_path / "streamed.parquet", 3, histories, columns
    )
    assert pq.ParquetFile(streamed).metadata.num_row_groups == 6
    a, b = pq.read_table(streamed), pq.read_table(whole)
    assert a.schema.equals(b.schema, check_metadata=True)
    for name in ("user_id", "model_version", "interactions"):
        assert a[name].to_pylist() == b[name].to_pylist()
    # The query tower's products over 4 vs 21 rows may round differently in the last bit.
    np.testing.assert_allclose(read_embeddings(streamed)[1], read_embeddings(whole)[1], atol=1e-6)
