"""SavedModel export (query, candidate, retrieval) and its fresh-process verification."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from recsys.core.config import ModelConfig
from recsys.core.errors import ExportVerificationError
from recsys.model import TrainedModel
from serving_export import samples, savedmodels, verify
from serving_export.savedmodels import export_savedmodels, signature_specs
from serving_export.signatures import (
    CANDIDATE,
    MODEL_NAMES,
    PAD_SCORE,
    QUERY,
    RETRIEVAL,
    SIGNATURES,
    TF_EXAMPLE_SIGNATURE,
)
from serving_export.verify import compare_topk, sample_users, verify_export
from serving_export.warmup import WARMUP_DIR, WARMUP_FILE, read_warmup_requests
from tests.conftest import PLAIN_MODEL

USERS = [f"u{i}" for i in range(12)]
ITEMS = [f"item-{i}" for i in range(25)]
# hidden_dims makes the output width (6) differ from embedding_dim, as it can in production.
CONFIG = ModelConfig(embedding_dim=8, hidden_dims=[16, 6], oov_buckets=3, **PLAIN_MODEL)
VERSION = 3
TOP_K = 5
TOL = 1e-5


def build_model(seed: int, users: list[str] = USERS) -> TrainedModel:
    """Random-init towers: parity checks need no training."""
    tf.keras.utils.set_random_seed(seed)
    return TrainedModel.build(users, ITEMS, CONFIG)


def _load(model_dir: Path) -> object:
    """tf.saved_model.load, once per SavedModel on disk (loading dominates these tests)."""
    stamp = (model_dir / "saved_model.pb").stat().st_mtime_ns
    return _load_cached(str(model_dir), stamp)


@functools.lru_cache(maxsize=16)
def _load_cached(model_dir: str, stamp: int) -> object:
    return tf.saved_model.load(model_dir)


def serve(
    model_dir: Path,
    user_ids: list[str],
    history: list[list[str]] | None = None,
    k: list[int] | None = None,
) -> dict[str, np.ndarray]:
    """Call serving_default of a query/retrieval export in this process ("" pads histories)."""
    fn = _load(model_dir).signatures["serving_default"]
    inputs = {
        "user_id": tf.constant(user_ids, tf.string),
        "history": tf.constant(samples.padded(history or [[] for _ in user_ids])),
    }
    if "k" in fn.structured_input_signature[1]:
        inputs["k"] = tf.constant(k if k is not None else [TOP_K] * len(user_ids), tf.int32)
    return {key: v.numpy() for key, v in fn(**inputs).items()}


def call(model_dir: Path, signature: str, **inputs: object) -> dict[str, np.ndarray]:
    """Call any signature of an export with the given input arrays."""
    fn = _load(model_dir).signatures[signature]
    return {
        key: v.numpy() for key, v in fn(**{k: tf.constant(v) for k, v in inputs.items()}).items()
    }


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
    return verify_export(model, exported, TOL, max_k=TOP_K)


def test_tf_serving_layout(exported: dict[str, Path], export_root: Path) -> None:
    assert exported == {name: export_root / name / str(VERSION) for name in MODEL_NAMES}
    for name, model_dir in exported.items():
        assert (model_dir / "saved_model.pb").is_file()
        assert (model_dir / "variables" / "variables.index").is_file()
        assert (model_dir / WARMUP_DIR / WARMUP_FILE).is_file()
        assets = model_dir / "assets"
        assert (assets / savedmodels.ITEM_VOCAB_ASSET).read_text().split() == ITEMS
        if name != CANDIDATE:
            assert (assets / savedmodels.USER_VOCAB_ASSET).read_text().split() == USERS
        assert [p.name for p in (export_root / name).iterdir()] == [str(VERSION)]


def test_verify_calls_every_signature_in_a_fresh_process(report: dict, model: TrainedModel) -> None:
    assert report["fresh_process"]["project_modules_loaded"] == []
    assert report["unknown_sample_users"] >= 2
    models = report["models"]
    assert sorted(models) == sorted(MODEL_NAMES)
    for name in (QUERY, CANDIDATE):
        assert sorted(models[name]["per_signature"]) == sorted(SIGNATURES)
        assert models[name]["max_abs_diff_embedding"] <= TOL
    retrieval = models[RETRIEVAL]
    assert retrieval["k"] == TOP_K
    for stats in retrieval["per_signature"].values():
        assert stats["max_abs_diff_scores"] <= TOL and stats["topk_id_mismatches"] == 0
        assert stats["mixed_k_problems"] == 0
    specs = signature_specs(model)
    assert {name: m["signatures"] for name, m in models.items()} == specs
    assert specs[QUERY]["serving_default"] == {
        "inputs": {
            "history": {"dtype": "string", "shape": [None, None]},
            "user_id": {"dtype": "string", "shape": [None]},
        },
        "outputs": {"embedding": {"dtype": "float32", "shape": [None, 6]}},
    }
    assert all(m["warmup_requests_replayed"] == 4 for m in models.values())
    expected_cli = "serving_default, predict_tf_example listed"
    if not verify.SAVED_MODEL_CLI.is_file():
        expected_cli = "skipped"
    assert all(m["saved_model_cli"].startswith(expected_cli) for m in models.values())
    assert report["seconds"] > 0


def test_unknown_user_ids_use_oov_buckets(model: TrainedModel, exported: dict[str, Path]) -> None:
    ids = ["never-seen", "", "u3", "another-new-user"]
    got = serve(exported[QUERY], ids)["embedding"]
    np.testing.assert_allclose(got, model.user_embeddings(ids), atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # Unknown ids hash into the first oov_buckets indices; known ones follow in vocab order.
    index = model.user_indices(ids)
    assert index.dtype == np.int64 and (index[[0, 1, 3]] < CONFIG.oov_buckets).all()
    assert index[2] == CONFIG.oov_buckets + model.users.index("u3")


def test_retrieval_equals_numpy_brute_force(model: TrainedModel, exported: dict[str, Path]) -> None:
    ids = [*USERS, "new-user"]
    got = serve(exported[RETRIEVAL], ids)
    scores = model.user_embeddings(ids) @ model.item_embeddings().T
    top = np.argsort(-scores, axis=1, kind="stable")[:, :TOP_K]
    np.testing.assert_array_equal(got["item_ids"].astype(str), np.array(ITEMS)[top])
    np.testing.assert_allclose(got["scores"], np.take_along_axis(scores, top, 1), atol=TOL)


def test_k_is_capped_at_catalog_size(model: TrainedModel, tmp_path: Path) -> None:
    exported = export_savedmodels(model, tmp_path, 1, top_k=1000, warmup=False)
    got = serve(exported[RETRIEVAL], ["u0"], k=[1000])
    assert got["item_ids"].shape == (1, len(ITEMS))
    assert sorted(got["item_ids"][0].astype(str)) == sorted(ITEMS)
    assert not (exported[RETRIEVAL] / WARMUP_DIR).exists()


def test_k_is_per_row_and_clipped_in_the_graph(
    model: TrainedModel, exported: dict[str, Path]
) -> None:
    ids = ["u0", "u1", "u2", "u3", "u4"]
    full = serve(exported[RETRIEVAL], ids, k=[TOP_K] * 5)
    got = serve(exported[RETRIEVAL], ids, k=[-7, 0, 2, TOP_K, 2**31 - 1])
    assert got["item_ids"].shape == (5, TOP_K)  # the widest clipped k of the batch
    for row, k in enumerate([1, 1, 2, TOP_K, TOP_K]):
        np.testing.assert_array_equal(got["item_ids"][row, :k], full["item_ids"][row, :k])
        np.testing.assert_array_equal(got["scores"][row, :k], full["scores"][row, :k])
        assert (got["item_ids"][row, k:] == b"").all()
        assert (got["scores"][row, k:] == PAD_SCORE).all()
    narrow = serve(exported[RETRIEVAL], ids, k=[1, 2, 2, 1, 2])
    assert narrow["item_ids"].shape == (5, 2)
    # One k for the whole batch (or none at all) applies to every row instead of failing.
    assert serve(exported[RETRIEVAL], ids, k=[3])["item_ids"].shape == (5, 3)
    assert serve(exported[RETRIEVAL], ids, k=[])["item_ids"].shape == (5, TOP_K)
    empty = serve(exported[RETRIEVAL], [], history=[], k=[])
    assert empty["item_ids"].shape[0] == 0 and empty["scores"].shape[0] == 0


def test_candidate_model_embeds_raw_item_ids(
    model: TrainedModel, exported: dict[str, Path]
) -> None:
    ids = [*ITEMS[:5], "never-seen-item", ""]
    got = call(
        exported[CANDIDATE],
        "serving_default",
        item_id=samples.strings(ids),
        genres=samples.padded([[] for _ in ids]),
        title=samples.strings([""] * len(ids)),
    )["embedding"]
    np.testing.assert_allclose(got, model.candidate_embeddings(ids), atol=TOL)
    np.testing.assert_allclose(got[:5], model.item_embeddings()[:5], atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tf_example_signature_equals_the_raw_feature_one(
    model: TrainedModel, exported: dict[str, Path], name: str
) -> None:
    users = sample_users(model)
    histories = samples.sample_histories(model, len(users))
    items = samples.sample_items(model)
    ks = samples.sample_ks(TOP_K, len(users))
    raw = call(
        exported[name],
        "serving_default",
        **samples.request_inputs(name, "serving_default", users, histories, items, ks),
    )
    parsed = call(
        exported[name],
        TF_EXAMPLE_SIGNATURE,
        **samples.request_inputs(name, TF_EXAMPLE_SIGNATURE, users, histories, items, ks),
    )
    assert sorted(raw) == sorted(parsed)
    for key, value in raw.items():
        if value.dtype == object:
            np.testing.assert_array_equal(parsed[key], value)
        else:
            np.testing.assert_allclose(parsed[key], value, atol=TOL)


def test_tf_examples_missing_features_take_schema_defaults(exported: dict[str, Path]) -> None:
    # An empty Example is user "" with no history, as the schema's defaults say.
    empty = np.array([samples.tf_example({})], dtype=object)
    got = call(exported[QUERY], TF_EXAMPLE_SIGNATURE, examples=empty)["embedding"]
    np.testing.assert_allclose(got, serve(exported[QUERY], [""])["embedding"], atol=TOL)
    # Bytes that are no Example fail that request (InvalidArgument), not the server.
    with pytest.raises(tf.errors.InvalidArgumentError):
        call(exported[QUERY], TF_EXAMPLE_SIGNATURE, examples=np.array([b"\x0a\x05hello"], object))


def test_oversized_and_empty_requests_are_served(
    model: TrainedModel, exported: dict[str, Path]
) -> None:
    huge = [ITEMS[i % len(ITEMS)] for i in range(10_000)]
    got = serve(exported[QUERY], ["u1", "u2"], [huge, []])["embedding"]
    expected = model.user_embeddings(["u1", "u2"], [huge[-CONFIG.history_length :], []])
    np.testing.assert_allclose(got, expected, atol=TOL)
    assert serve(exported[QUERY], [], [])["embedding"].shape == (0, model.output_dim)
    wide = serve(exported[RETRIEVAL], ["u1"] * 3, [huge, [], [""] * 50], k=[10**9] * 3)
    assert wide["item_ids"].shape == (3, TOP_K)


def test_warmup_records_parse_and_replay(exported: dict[str, Path]) -> None:
    from tensorflow_serving.apis import prediction_log_pb2

    for name, model_dir in exported.items():
        raw = list(tf.data.TFRecordDataset(str(model_dir / WARMUP_DIR / WARMUP_FILE)))
        logs = [prediction_log_pb2.PredictionLog.FromString(r.numpy()) for r in raw]
        assert {log.predict_log.request.model_spec.name for log in logs} == {name}
        requests = read_warmup_requests(model_dir)
        assert sorted({sig for sig, _ in requests}) == sorted(SIGNATURES)
        assert sorted({len(next(iter(inputs.values()))) for _, inputs in requests}) == [1, 8]
        for signature, inputs in requests:
            out = call(model_dir, signature, **inputs)
            assert all(len(value) == len(next(iter(inputs.values()))) for value in out.values())


def test_ids_a_vocabulary_file_cannot_hold_fall_back_to_an_inline_vocabulary(
    tmp_path: Path,
) -> None:
    odd = build_model(seed=3, users=["line\nbreak", "carriage\rreturn", "plain"])
    exported = export_savedmodels(odd, tmp_path, 1, TOP_K, warmup=False)
    assert not (exported[QUERY] / "assets" / savedmodels.USER_VOCAB_ASSET).exists()
    ids = ["line\nbreak", "carriage\rreturn", "plain", "unknown"]
    np.testing.assert_allclose(
        serve(exported[QUERY], ids)["embedding"], odd.user_embeddings(ids), atol=TOL
    )


def test_failed_save_publishes_nothing(
    model: TrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export_savedmodels(model, tmp_path, 1, TOP_K, warmup=False)
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
    for name in MODEL_NAMES:
        assert [p.name for p in (tmp_path / name).iterdir()] == ["1"]  # no temp folder left
    assert (tmp_path / QUERY / "1" / "saved_model.pb").read_bytes() == before


def test_rerun_replaces_the_same_version(model: TrainedModel, tmp_path: Path) -> None:
    export_savedmodels(build_model(seed=4), tmp_path, 1, TOP_K, warmup=False)
    exported = export_savedmodels(model, tmp_path, 1, TOP_K, warmup=False)
    got = serve(exported[QUERY], ["u1"])["embedding"]
    np.testing.assert_allclose(got, model.user_embeddings(["u1"]), atol=TOL)
    assert [p.name for p in (tmp_path / QUERY).iterdir()] == ["1"]


def test_verify_catches_a_different_model_on_disk(
    model: TrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tampered = export_savedmodels(build_model(seed=2), tmp_path, VERSION, TOP_K)
    monkeypatch.setattr(verify, "SAVED_MODEL_CLI", tmp_path / "missing")  # speed only
    with pytest.raises(ExportVerificationError) as err:
        verify_export(model, tampered, TOL, max_k=TOP_K + 1)
    message = str(err.value)
    for name in (QUERY, CANDIDATE):
        assert (
            f"{name} SavedModel at {tampered[name]}: serving_default: max abs embedding" in message
        )
        assert "predict_tf_example: max abs embedding diff" in message
    assert f"retrieval SavedModel at {tampered[RETRIEVAL]}: serving_default: K=5" in message
    assert "expected max_k 6" in message and "serving_default: max abs score diff" in message


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
    ranked = serve(exported[RETRIEVAL], ids, histories, k=[TOP_K] * len(ids))
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
    exported = export_savedmodels(featured, tmp_path, 1, TOP_K, warmup=False)
    monkeypatch.setattr(verify, "SAVED_MODEL_CLI", tmp_path / "missing")  # speed only
    report = verify_export(featured, exported, TOL, expect_warmup=False)
    assert report["models"][QUERY]["max_abs_diff_embedding"] <= TOL
    assert report["models"][CANDIDATE]["max_abs_diff_embedding"] <= TOL
    assert report["models"][RETRIEVAL]["topk_id_mismatches"] == 0
    # The baked genre table moves the candidates: blanking it changes every embedding.
    before = featured.item_embeddings()
    table = featured.candidate_tower.feature_ids["genres"]
    table.assign(tf.fill(table.shape, -1))
    assert (np.abs(featured.item_embeddings() - before).max(axis=1) > 1e-4).all()


def test_verify_catches_wrong_padding_and_missing_signatures(model: TrainedModel) -> None:
    full_ids = np.array([["a", "b", "c"], ["d", "e", "f"]])
    full_scores = np.array([[0.9, 0.5, 0.1], [0.8, 0.4, 0.2]], np.float32)
    ids, scores = full_ids[:, :2].copy(), full_scores[:, :2].copy()
    ids[0, 1], scores[0, 1] = "", PAD_SCORE
    assert verify.mixed_k_problems(full_ids, full_scores, ids, scores, [1, 2]) == []
    ids[0, 1] = "b"  # row 0 asked for one item but got two
    assert "not padded" in verify.mixed_k_problems(full_ids, full_scores, ids, scores, [1, 2])[0]
    assert "shape" in verify.mixed_k_problems(full_ids, full_scores, ids, scores, [1, 3])[0]
    specs = signature_specs(model)[QUERY]
    only_default = {"serving_default": specs["serving_default"]}
    assert "signatures ['serving_default']" in verify._signature_problems(only_default, specs)[0]


def test_documented_rest_requests_run_against_the_exports(
    model: TrainedModel, exported: dict[str, Path]
) -> None:
    """Every `curl -d` body in docs/SERVING.md, sent to the signature its URL names."""
    import base64
    import json
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "SERVING.md").read_text()
    requests = re.findall(r"-d '(\{.*?\})'\s*\\?\s*(http://\S+)", doc, flags=re.DOTALL)
    # TF Serving's REST requests (the MLflow Model's /invocations are tested apart).
    requests = [(body, url) for body, url in requests if "/v1/models/" in url]
    assert len(requests) >= 6
    specs = signature_specs(model)
    for body, url in requests:
        name = url.split("/v1/models/")[1].split("/")[0].split(":")[0]
        payload = json.loads(body)
        signature = payload.get("signature_name", "serving_default")
        expected = specs[name][signature]["inputs"]
        columns = payload.get("inputs") or {
            key: [row[key] for row in payload["instances"]] for key in payload["instances"][0]
        }
        assert sorted(columns) == sorted(expected), (url, body)
        inputs = {}
        for key, values in columns.items():
            if key == "examples":
                values = [base64.b64decode(v["b64"]) for v in values]
            dtype = np.int32 if expected[key]["dtype"] == "int32" else object
            inputs[key] = np.array(values, dtype=dtype)
            if len(expected[key]["shape"]) == 2:  # [] rows of the columnar example: [n, 0]
                inputs[key] = inputs[key].reshape(len(values), -1)
        outputs = call(exported[name], signature, **inputs)
        assert sorted(outputs) == sorted(specs[name][signature]["outputs"])


def test_unnormalized_towers_export_with_their_own_padding_and_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from recsys.core.config import ExportConfig
    from serving_export.manifest import read_manifest
    from serving_export.release import stage_embeddings
    from serving_export.signatures import UNNORMALIZED_PAD_SCORE

    tf.keras.utils.set_random_seed(8)
    raw = TrainedModel.build(USERS, ITEMS, CONFIG.model_copy(update={"normalize": False}))
    assert not np.allclose(np.linalg.norm(raw.item_embeddings(), axis=1), 1.0)
    exported = export_savedmodels(raw, tmp_path / "export", 1, TOP_K, warmup=False)
    monkeypatch.setattr(verify, "SAVED_MODEL_CLI", tmp_path / "missing")  # speed only
    report = verify_export(raw, exported, TOL, max_k=TOP_K, expect_warmup=False)
    assert report["models"][RETRIEVAL]["topk_id_mismatches"] == 0
    # Unbounded scores: a row asking for fewer items is padded below any possible score.
    padded_row = serve(exported[RETRIEVAL], ["u1", "u2"], k=[1, TOP_K])["scores"][0]
    assert (padded_row[1:] == UNNORMALIZED_PAD_SCORE).all()
    stage_embeddings(raw, tmp_path / "emb", 1, exported, ExportConfig())
    assert read_manifest(tmp_path / "emb")["normalization"] == "none"
