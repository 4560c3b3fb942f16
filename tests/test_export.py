"""SavedModel export and its fresh-process verification (serving_export.savedmodels, .verify)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from recsys.config import ModelConfig
from recsys.errors import ExportVerificationError
from recsys.model import TrainedModel
from serving_export import savedmodels, verify
from serving_export.savedmodels import QUERY, RETRIEVAL, export_savedmodels
from serving_export.verify import compare_topk, sample_users, verify_export

USERS = [f"u{i}" for i in range(12)]
ITEMS = [f"item-{i}" for i in range(25)]
# hidden_dims makes the output width (6) differ from embedding_dim, as it can in production.
CONFIG = ModelConfig(embedding_dim=8, hidden_dims=[16, 6], oov_buckets=3)
VERSION = 3
TOP_K = 5
TOL = 1e-5


def build_model(seed: int, users: list[str] = USERS) -> TrainedModel:
    """Random-init towers: parity checks need no training."""
    tf.keras.utils.set_random_seed(seed)
    return TrainedModel.build(users, ITEMS, CONFIG)


def serve(
    model_dir: Path, user_ids: list[str], history: list[list[str]] | None = None
) -> dict[str, np.ndarray]:
    """Call serving_default of an exported model in this process ("" pads the histories)."""
    fn = tf.saved_model.load(str(model_dir)).signatures["serving_default"]
    history = history or [[] for _ in user_ids]
    width = max(len(h) for h in history)
    padded = tf.constant(
        [h + [""] * (width - len(h)) for h in history], tf.string, shape=[len(user_ids), width]
    )
    return {k: v.numpy() for k, v in fn(user_id=tf.constant(user_ids), history=padded).items()}


@pytest.fixture(scope="module")
def model() -> TrainedModel:
    return build_model(seed=1)


@pytest.fixture(scope="module")
def export_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def exported(model: TrainedModel, export_root: Path) -> dict[str, Path]:
    return export_savedmodels(model, export_root, VERSION, TOP_K)


@pytest.fixture(scope="module")
def report(model: TrainedModel, exported: dict[str, Path]) -> dict:
    return verify_export(model, exported, TOL)


def test_tf_serving_layout(exported: dict[str, Path], export_root: Path) -> None:
    assert exported == {name: export_root / name / str(VERSION) for name in (QUERY, RETRIEVAL)}
    for name, model_dir in exported.items():
        assert (model_dir / "saved_model.pb").is_file()
        assert (model_dir / "variables" / "variables.index").is_file()
        assert (model_dir / "assets" / savedmodels.USER_VOCAB_ASSET).read_text().split() == USERS
        assert [p.name for p in (export_root / name).iterdir()] == [str(VERSION)]


def test_verify_passes_in_a_fresh_process(report: dict) -> None:
    assert report["fresh_process"]["project_modules_loaded"] == []
    assert report["unknown_sample_users"] >= 2
    query, retrieval = report["models"][QUERY], report["models"][RETRIEVAL]
    assert query["max_abs_diff_embedding"] <= TOL
    assert retrieval["max_abs_diff_scores"] <= TOL
    assert retrieval["topk_id_mismatches"] == 0
    assert retrieval["k"] == TOP_K
    assert query["signature"] == {
        "inputs": {
            "history": {"dtype": "string", "shape": [None, None]},
            "user_id": {"dtype": "string", "shape": [None]},
        },
        "outputs": {"embedding": {"dtype": "float32", "shape": [None, 6]}},
    }
    assert retrieval["signature"]["outputs"] == {
        "item_ids": {"dtype": "string", "shape": [None, TOP_K]},
        "scores": {"dtype": "float32", "shape": [None, TOP_K]},
    }
    expected_cli = "serving_default listed" if verify.SAVED_MODEL_CLI.is_file() else "skipped"
    assert all(m["saved_model_cli"].startswith(expected_cli) for m in report["models"].values())
    assert report["seconds"] > 0


def test_unknown_user_ids_use_oov_buckets(model: TrainedModel, exported: dict[str, Path]) -> None:
    ids = ["never-seen", "", "u3", "another-new-user"]
    got = serve(exported[QUERY], ids)["embedding"]
    np.testing.assert_allclose(got, model.user_embeddings(ids), atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_retrieval_equals_numpy_brute_force(model: TrainedModel, exported: dict[str, Path]) -> None:
    ids = [*USERS, "new-user"]
    got = serve(exported[RETRIEVAL], ids)
    scores = model.user_embeddings(ids) @ model.item_embeddings().T
    top = np.argsort(-scores, axis=1, kind="stable")[:, :TOP_K]
    np.testing.assert_array_equal(got["item_ids"].astype(str), np.array(ITEMS)[top])
    np.testing.assert_allclose(got["scores"], np.take_along_axis(scores, top, 1), atol=TOL)


def test_k_is_capped_at_catalog_size(model: TrainedModel, tmp_path: Path) -> None:
    exported = export_savedmodels(model, tmp_path, 1, top_k=1000)
    got = serve(exported[RETRIEVAL], ["u0"])
    assert got["item_ids"].shape == (1, len(ITEMS))
    assert sorted(got["item_ids"][0].astype(str)) == sorted(ITEMS)


def test_ids_a_vocabulary_file_cannot_hold_fall_back_to_an_inline_vocabulary(
    tmp_path: Path,
) -> None:
    odd = build_model(seed=3, users=["line\nbreak", "carriage\rreturn", "plain"])
    exported = export_savedmodels(odd, tmp_path, 1, TOP_K)
    assert not (exported[QUERY] / "assets" / savedmodels.USER_VOCAB_ASSET).exists()
    ids = ["line\nbreak", "carriage\rreturn", "plain", "unknown"]
    np.testing.assert_allclose(
        serve(exported[QUERY], ids)["embedding"], odd.user_embeddings(ids), atol=TOL
    )


def test_failed_save_publishes_nothing(
    model: TrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export_savedmodels(model, tmp_path, 1, TOP_K)
    before = (tmp_path / QUERY / "1" / "saved_model.pb").read_bytes()
    real_save = tf.saved_model.save

    def save_then_fail(obj: tf.Module, export_dir: str, **kwargs: object) -> None:
        real_save(obj, export_dir, **kwargs)  # a complete model in the temp folder...
        (Path(export_dir) / "half-written").write_text("x")
        raise OSError("disk full")  # ...that must still never be published

    monkeypatch.setattr(tf.saved_model, "save", save_then_fail)
    for version in (2, 1):  # a new version, and a rerun over a published one
        with pytest.raises(OSError, match="disk full"):
            export_savedmodels(model, tmp_path, version, TOP_K)
    for name in (QUERY, RETRIEVAL):
        assert [p.name for p in (tmp_path / name).iterdir()] == ["1"]  # no temp folder left
    assert (tmp_path / QUERY / "1" / "saved_model.pb").read_bytes() == before


def test_rerun_replaces_the_same_version(model: TrainedModel, tmp_path: Path) -> None:
    export_savedmodels(build_model(seed=4), tmp_path, 1, TOP_K)
    exported = export_savedmodels(model, tmp_path, 1, TOP_K)
    got = serve(exported[QUERY], ["u1"])["embedding"]
    np.testing.assert_allclose(got, model.user_embeddings(["u1"]), atol=TOL)
    assert [p.name for p in (tmp_path / QUERY).iterdir()] == ["1"]


def test_verify_catches_a_different_model_on_disk(
    model: TrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tampered = export_savedmodels(build_model(seed=2), tmp_path, VERSION, TOP_K)
    monkeypatch.setattr(verify, "SAVED_MODEL_CLI", tmp_path / "missing")  # speed only
    with pytest.raises(ExportVerificationError) as err:
        verify_export(model, tampered, TOL)
    message = str(err.value)
    assert f"query SavedModel at {tampered[QUERY]}: max abs embedding diff" in message
    assert f"retrieval SavedModel at {tampered[RETRIEVAL]}: max abs score diff" in message


def test_verify_reports_an_unloadable_export(
    exported: dict[str, Path], model: TrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / QUERY / "1"
    shutil.copytree(exported[QUERY], broken)
    (broken / "saved_model.pb").write_bytes(b"truncated")
    monkeypatch.setattr(verify, "SAVED_MODEL_CLI", tmp_path / "missing")
    with pytest.raises(ExportVerificationError, match=f"reloading.*{broken}.*failed"):
        verify_export(model, {QUERY: broken}, TOL)


def test_compare_topk_allows_reordering_only_within_ties() -> None:
    full = np.array([[0.9, 0.5, 0.5, 0.1]], dtype=np.float32)
    items = ["a", "b", "c", "d"]
    tied = compare_topk(full, items, np.array([["a", "c", "b"]]), full[:, :3], TOL)
    assert tied["topk_id_mismatches"] == 0 and tied["tied_positions"] == 2
    at_boundary = compare_topk(full[:, :3], items[:3], np.array([["a", "c"]]), full[:, :2], TOL)
    assert at_boundary["topk_id_mismatches"] == 0
    wrong = compare_topk(full, items, np.array([["d", "b", "c"]]), full[:, :3], TOL)
    assert wrong["topk_id_mismatches"] == 1
    assert wrong["max_abs_diff_id_scores"] == pytest.approx(0.8)


def test_sample_users_include_unknown_ids(model: TrainedModel) -> None:
    ids = sample_users(model, ["u1"])
    assert ids[0] == "u1" and "" in ids
    assert len(set(ids) - set(USERS)) == len(verify.UNKNOWN_USER_IDS)
    assert set(USERS) <= set(sample_users(model))


def test_missing_saved_model_cli_is_a_note_not_a_failure(tmp_path: Path) -> None:
    note, problem = verify._finish_cli(None)
    assert note.startswith("skipped") and problem is None


@pytest.mark.parametrize(("version", "top_k"), [(-1, 5), (1, 0)])
def test_export_rejects_bad_arguments(
    model: TrainedModel, tmp_path: Path, version: int, top_k: int
) -> None:
    with pytest.raises(ValueError):
        export_savedmodels(model, tmp_path, version, top_k)
    assert not any(tmp_path.iterdir())


def test_history_input_matches_the_in_memory_model(
    model: TrainedModel, exported: dict[str, Path]
) -> None:
    long = [ITEMS[i % len(ITEMS)] for i in range(CONFIG.history_length + 7)]
    histories = [[], ["item-3"], ["item-1", "unknown-item", "item-9"], long, ["", "item-2"]]
    ids = ["u1", "u1", "u2", "u3", "new-user"]
    got = serve(exported[QUERY], ids, histories)["embedding"]
    np.testing.assert_allclose(got, model.user_embeddings(ids, histories), atol=TOL)
    # The history moves the query; only its last history_length ids count; "" is padding.
    assert np.abs(got[1] - got[0]).max() > 1e-3
    kept = model.user_embeddings(["u3"], [long[-CONFIG.history_length :]])
    np.testing.assert_allclose(got[3:4], kept, atol=TOL)
    np.testing.assert_allclose(
        got[4:5], model.user_embeddings(["new-user"], [["item-2"]]), atol=TOL
    )
    ranked = serve(exported[RETRIEVAL], ids, histories)
    scores = model.user_embeddings(ids, histories) @ model.item_embeddings().T
    np.testing.assert_allclose(ranked["scores"], -np.sort(-scores, axis=1)[:, :TOP_K], atol=TOL)


def test_item_features_are_baked_into_the_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from recsys.model import ItemFeatures

    features = ItemFeatures(
        ids={"genres": np.array([[i % 3, -1] for i in range(len(ITEMS))], np.int32)},
        vocab={"genres": ["a", "b", "c"]},
    )
    tf.keras.utils.set_random_seed(5)
    featured = TrainedModel.build(USERS, ITEMS, CONFIG, features)
    exported = export_savedmodels(featured, tmp_path, 1, TOP_K)
    monkeypatch.setattr(verify, "SAVED_MODEL_CLI", tmp_path / "missing")  # speed only
    report = verify_export(featured, exported, TOL)
    assert report["models"][QUERY]["max_abs_diff_embedding"] <= TOL
    assert report["models"][RETRIEVAL]["topk_id_mismatches"] == 0
    # The baked genre table moves the candidates: blanking it changes every embedding.
    before = featured.item_embeddings()
    table = featured.candidate_tower.feature_ids["genres"]
    table.assign(tf.fill(table.shape, -1))
    assert (np.abs(featured.item_embeddings() - before).max(axis=1) > 1e-4).all()
