"""Optional user side features in the query tower: tokens, training, save/load, export."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from conductor import stages
from recsys.core.config import ModelConfig, RecsysConfig, parse_config
from recsys.core.layout import Workdir
from recsys.model import PAD, TrainedModel, UserFeatures, warm_start
from serving_export import verify
from serving_export.savedmodels import export_savedmodels
from serving_export.signatures import QUERY
from tests.conftest import PLAIN_MODEL, SMALL_DATE

USERS = [f"u{i}" for i in range(40)]
ITEMS = [f"i{i}" for i in range(20)]
CONFIG = ModelConfig(
    embedding_dim=8, hidden_dims=[12], oov_buckets=2, user_features=True, **PLAIN_MODEL
)


def write_users(path: Path, users: list[str]) -> Path:
    """A user_features.parquet as the Beam job writes it: string columns, nulls allowed."""
    rows = range(len(users))
    pq.write_table(
        pa.table(
            {
                "user_id": users,
                "age": [str(18 + (3 * r) % 50) if r % 9 else None for r in rows],
                "gender": ["F" if r % 2 else "M" for r in rows],
                "occupation": [("writer", "doctor", "student")[r % 3] for r in rows[:-1]]
                + ["astronaut"],  # a value of one user only: dropped like a rare token
            },
            schema=pa.schema(
                [(n, pa.string()) for n in ("user_id", "age", "gender", "occupation")]
            ),
        ),
        path,
    )
    return path


@pytest.fixture
def features(tmp_path: Path) -> UserFeatures:
    return UserFeatures.from_parquet(write_users(tmp_path / "users.parquet", USERS), USERS)


def test_tokens_are_values_or_quantile_buckets(features: UserFeatures) -> None:
    assert sorted(features.ids) == ["age", "gender", "occupation"]
    assert all(ids.shape == (len(USERS), 1) for ids in features.ids.values())
    assert sorted(features.vocab["gender"]) == ["F", "M"]
    assert "astronaut" not in features.vocab["occupation"]
    assert features.ids["occupation"][-1, 0] == PAD
    # Age is numeric with more distinct values than buckets: deciles q0..q9, older = higher.
    assert set(features.vocab["age"]) <= {f"q{k}" for k in range(10)}
    assert features.ids["age"][0, 0] == PAD  # a null age
    ages = {r: features.vocab["age"][features.ids["age"][r, 0]] for r in (1, 5)}
    assert int(ages[1][1:]) < int(ages[5][1:])


def test_no_user_side_file_means_no_user_features(tmp_path: Path) -> None:
    assert UserFeatures.from_parquet(tmp_path / "absent.parquet", USERS).ids == {}


def test_user_features_move_the_query_and_survive_save_load(
    features: UserFeatures, tmp_path: Path
) -> None:
    tf.keras.utils.set_random_seed(4)
    model = TrainedModel.build(USERS, ITEMS, CONFIG, user_features=features)
    before = model.user_embeddings(USERS)
    table = model.query_tower.feature_ids["gender"]
    table.assign(tf.fill(table.shape, PAD))
    assert (np.abs(model.user_embeddings(USERS) - before).max(axis=1) > 1e-4).all()
    table.assign(np.concatenate([np.full((2, 1), PAD), features.ids["gender"]]).astype(np.int32))
    model.save(tmp_path / "model")
    loaded = TrainedModel.load(tmp_path / "model")
    np.testing.assert_allclose(loaded.user_embeddings(USERS), before, atol=1e-6)
    assert loaded.user_features.vocab == features.vocab
    # Off in the config: the same vocabularies build towers without user features.
    plain = TrainedModel.build(
        USERS, ITEMS, CONFIG.model_copy(update={"user_features": False}), None, features
    )
    assert not hasattr(plain.query_tower, "feature_ids")


def test_export_serves_user_features_by_user_id(
    features: UserFeatures, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tf.keras.utils.set_random_seed(6)
    model = TrainedModel.build(USERS, ITEMS, CONFIG, user_features=features)
    exported = export_savedmodels(model, tmp_path, 1, 5, warmup=False)
    monkeypatch.setattr(verify, "SAVED_MODEL_CLI", tmp_path / "missing")  # speed only
    report = verify.verify_export(model, exported, 1e-5, max_k=5, expect_warmup=False)
    assert report["models"][QUERY]["max_abs_diff_embedding"] <= 1e-5


def test_warm_start_maps_user_feature_rows_by_token(features: UserFeatures) -> None:
    tf.keras.utils.set_random_seed(1)
    old = TrainedModel.build(USERS, ITEMS, CONFIG, user_features=features)
    swapped = UserFeatures(
        dict(features.ids), {**features.vocab, "gender": features.vocab["gender"][::-1]}
    )
    new = TrainedModel.build(USERS, ITEMS, CONFIG, user_features=swapped)
    copied = warm_start(new, old)
    assert copied["gender"] == 2
    old_rows = old.query_tower.feature_embeddings["gender"].embeddings.numpy()
    new_rows = new.query_tower.feature_embeddings["gender"].embeddings.numpy()
    np.testing.assert_array_equal(new_rows[::-1], old_rows)


def test_training_with_a_user_side_file(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    config, workdir, data_dir = prepared
    data = shutil.copytree(data_dir, tmp_path / "data")
    users = (data / "vocab" / "users.txt").read_text().split()
    write_users(data / "user_features.parquet", users)
    raw = config.model_dump(mode="json")
    raw["model"]["user_features"] = True
    raw["training"].update(epochs=1, refit="off")  # the user features are at stake, not a refit
    run_dir, result = stages.train(
        parse_config(raw), workdir, dt.date.fromisoformat(SMALL_DATE), data
    )
    assert np.isfinite(result.history["loss"]).all()
    model = TrainedModel.load(run_dir / "model")
    assert model.config.user_features and sorted(model.user_features.ids) == [
        "age",
        "gender",
        "occupation",
    ]
