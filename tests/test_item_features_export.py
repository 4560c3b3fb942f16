"""Raw item features in the candidate SavedModel: in-graph tokens equal the training tables'.

Cold-start items (ids the catalog has never seen) are embedded from their genres and title;
catalog items sent with their own raw features get exactly the catalog vector.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from recsys.core.config import ModelConfig
from recsys.core.schema import GENRES, ITEM_ID, TITLE
from recsys.item_tokens import (
    MAX_RAW_TOKENS,
    PAD,
    genre_tokens,
    graph_genre_tokens,
    graph_title_tokens,
    graph_token_matrix,
    title_tokens,
    token_matrix,
)
from recsys.model import ItemFeatures, TrainedModel
from serving_export import samples, verify
from serving_export.savedmodels import export_savedmodels
from serving_export.signatures import CANDIDATE, SIGNATURE, TF_EXAMPLE_SIGNATURE
from tests.conftest import PLAIN_MODEL

USERS = [f"u{i}" for i in range(10)]
ITEMS = [f"item-{i}" for i in range(30)]
GENRE_NAMES = ["Action", "Comedy", "Drama", "Sci-Fi", "Film-Noir"]
TITLES = ["Star Wars", "Café Society", "The Naked Gun", "Heat", "Ça Ira"]
CONFIG = ModelConfig(
    embedding_dim=8, hidden_dims=[16, 6], oov_buckets=3, max_title_tokens=3, **PLAIN_MODEL
)
TOL = 1e-5

TRICKY_TITLES = [
    "Toy Story (1995)",
    "Amélie (Le Fabuleux Destin d'Amélie Poulain) (2001)",
    "ÇA VA, Ünïcode_X 3½!",
    "naïve—café  --  \t tabs\nand lines",
    "Straße ΣΑΣ Ωmega",
    "千と千尋の神隠し (2001)",
    "Москва слезам не верит",
    "Se7en / 2001: A Space Odyssey",
    "",
    "   ",
    "...!!!",
]


def raw_genres(row: int) -> list[str]:
    return [GENRE_NAMES[row % 5], GENRE_NAMES[(row * 3 + 1) % 5]] if row % 7 else []


def raw_title(row: int) -> str:
    return f"{TITLES[row % 5]} {row % 3} ({1990 + row % 4})" if row % 11 else ""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TrainedModel:
    path = tmp_path_factory.mktemp("features") / "item_features.parquet"
    table = {
        ITEM_ID: ITEMS,
        GENRES: [raw_genres(i) for i in range(len(ITEMS))],
        TITLE: [raw_title(i) for i in range(len(ITEMS))],
    }
    pq.write_table(pa.table(table), path)
    features = ItemFeatures.from_parquet(path, ITEMS, CONFIG.max_title_tokens)
    assert sorted(features.ids) == [GENRES, TITLE]
    tf.keras.utils.set_random_seed(11)
    return TrainedModel.build(USERS, ITEMS, CONFIG, features)


@pytest.fixture(scope="module")
def exported(model: TrainedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return export_savedmodels(model, tmp_path_factory.mktemp("export"), 1, 5, warmup=False)


@functools.lru_cache(maxsize=4)
def _signatures(model_dir: str) -> object:
    return tf.saved_model.load(model_dir).signatures


def embed(
    model_dir: Path, ids: list[str], genres: list[list[str]], titles: list[str]
) -> np.ndarray:
    fn = _signatures(str(model_dir))[SIGNATURE]
    out = fn(
        item_id=tf.constant(samples.strings(ids)),
        genres=tf.constant(samples.padded(genres)),
        title=tf.constant(samples.strings(titles)),
    )
    return out["embedding"].numpy()


def test_graph_title_tokens_equal_the_python_ones() -> None:
    got = graph_title_tokens(tf.constant(TRICKY_TITLES)).to_list()
    assert [[t.decode() for t in row] for row in got] == [title_tokens(t) for t in TRICKY_TITLES]


def test_graph_title_tokens_equal_the_python_ones_on_movielens(ml100k: Path) -> None:
    lines = (ml100k / "u.item").read_text(encoding="latin-1").splitlines()
    titles = [line.split("|")[1] for line in lines]
    got = graph_title_tokens(tf.constant(titles)).to_list()
    assert [[t.decode() for t in row] for row in got] == [title_tokens(t) for t in titles]
    assert len(titles) == 1682


_TEXT = st.text(
    alphabet=st.characters(
        min_codepoint=0x20,
        max_codepoint=0x4FF,  # ASCII, Latin-1 and Latin Extended, IPA, Greek, Cyrillic
        exclude_categories=("Cs", "Lt", "Mn", "Me", "Mc"),
        exclude_characters="İ",  # str.lower() gives "i̇" (full case mapping), TF "i"
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=8))
def test_graph_title_tokens_match_python_on_generated_text(titles: list[str]) -> None:
    got = graph_title_tokens(tf.constant(titles)).to_list()
    assert [[t.decode() for t in row] for row in got] == [title_tokens(t) for t in titles]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["a", "b", "c", "d", "zz", " a ", "", "  "]), max_size=90),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 5),
)
def test_graph_token_matrix_equals_the_training_table(rows: list[list[str]], width: int) -> None:
    vocab = ["c", "a", "b"]
    expected = token_matrix([genre_tokens(r) for r in rows], vocab, width)
    lookup = tf.keras.layers.StringLookup(vocabulary=vocab, num_oov_indices=1, mask_token=None)
    padded = samples.padded(rows)
    tokens = graph_genre_tokens(tf.constant(padded))
    got = graph_token_matrix(tokens, lambda t: lookup(t) - 1, width).numpy()
    np.testing.assert_array_equal(got, expected)


def test_raw_tokens_are_capped() -> None:
    # Past MAX_RAW_TOKENS nothing is read: an oversized request costs bounded work.
    many = ["x"] * MAX_RAW_TOKENS + ["a"]
    assert token_matrix([many], ["a", "x"], 3).tolist() == [[1, PAD, PAD]]


def test_catalog_items_with_their_raw_features_get_the_catalog_vector(
    model: TrainedModel, exported: dict[str, Path]
) -> None:
    rows = list(range(len(ITEMS)))
    catalog = model.item_embeddings()
    titles = [raw_title(i).upper() + " !" for i in rows]  # case and punctuation do not matter
    got = embed(exported[CANDIDATE], ITEMS, [raw_genres(i) for i in rows], titles)
    np.testing.assert_allclose(got, catalog, atol=TOL)
    ids_only = embed(exported[CANDIDATE], ITEMS, [[] for _ in rows], [""] * len(rows))
    np.testing.assert_allclose(ids_only, catalog, atol=TOL)


def test_cold_start_items_are_embedded_from_their_features(
    model: TrainedModel, exported: dict[str, Path]
) -> None:
    new = ["brand-new-1", "brand-new-2", "brand-new-3"]
    genres = [["Drama", "Comedy"], ["Sci-Fi", "Drama ", "Sci-Fi"], []]
    titles = ["Star Wars 2", "", "The Naked Gun"]
    got = embed(exported[CANDIDATE], new, genres, titles)
    features = {GENRES: genres, TITLE: titles}
    np.testing.assert_allclose(got, model.candidate_embeddings(new, features), atol=TOL)
    bare = embed(exported[CANDIDATE], new, [[] for _ in new], [""] * 3)
    # The features move every new item away from its bare out-of-vocabulary vector.
    assert (np.abs(got[:2] - bare[:2]).max(axis=1) > 1e-3).all()


def test_changed_features_of_a_catalog_item_are_used(
    model: TrainedModel, exported: dict[str, Path]
) -> None:
    item = ITEMS[1]
    got = embed(exported[CANDIDATE], [item], [["Film-Noir"]], ["Heat"])
    expected = model.candidate_embeddings([item], {GENRES: [["Film-Noir"]], TITLE: ["Heat"]})
    np.testing.assert_allclose(got, expected, atol=TOL)
    assert np.abs(got - model.item_embeddings()[1:2]).max() > 1e-3


def test_tf_example_with_features_equals_the_raw_signature(
    model: TrainedModel, exported: dict[str, Path]
) -> None:
    items = samples.sample_items(model)
    parsed = _signatures(str(exported[CANDIDATE]))[TF_EXAMPLE_SIGNATURE](
        examples=tf.constant(samples.item_examples(items))
    )["embedding"].numpy()
    raw = embed(exported[CANDIDATE], items.ids, items.genres, items.titles)
    np.testing.assert_allclose(parsed, raw, atol=TOL)
    # An Example carrying the item id only is the catalog vector (absent features: defaults).
    only_id = np.array([samples.tf_example({ITEM_ID: ITEMS[4]})], dtype=object)
    got = _signatures(str(exported[CANDIDATE]))[TF_EXAMPLE_SIGNATURE](
        examples=tf.constant(only_id)
    )["embedding"].numpy()
    np.testing.assert_allclose(got, model.item_embeddings()[4:5], atol=TOL)


def test_oversized_and_odd_feature_requests_are_served(
    model: TrainedModel, exported: dict[str, Path]
) -> None:
    genres = [[f"g{i}" for i in range(5000)] + ["Drama"], [""] * 300, ["Comedy"]]
    titles = ["word " * 20000 + "heat", "", "\x00\x01 Heat \U0001f3ac"]
    ids = ["new-a", ITEMS[2], "new-b"]
    got = embed(exported[CANDIDATE], ids, genres, titles)
    features = {GENRES: genres, TITLE: titles}
    np.testing.assert_allclose(got, model.candidate_embeddings(ids, features), atol=TOL)
    assert embed(exported[CANDIDATE], [], [], []).shape == (0, model.output_dim)
    # Invalid UTF-8 in a title separates tokens instead of failing the request.
    fn = _signatures(str(exported[CANDIDATE]))[SIGNATURE]
    out = fn(
        item_id=tf.constant(["new-c"]),
        genres=tf.constant([[""]]),
        title=tf.constant([b"heat\xff\xfestar"]),
    )["embedding"].numpy()
    expected = model.candidate_embeddings(["new-c"], {TITLE: ["heat star"]})
    np.testing.assert_allclose(out, expected, atol=TOL)


def test_verify_checks_the_feature_inputs_in_a_fresh_process(
    model: TrainedModel, exported: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(verify, "SAVED_MODEL_CLI", tmp_path / "missing")  # speed only
    report = verify.verify_export(model, exported, TOL, max_k=5, expect_warmup=False)
    assert report["models"][CANDIDATE]["max_abs_diff_embedding"] <= TOL
    # Same weights, but title tokens indexed differently from the export: caught.
    vocab = {**model.item_features.vocab, TITLE: model.item_features.vocab[TITLE][::-1]}
    other = TrainedModel.build(USERS, ITEMS, CONFIG, ItemFeatures(model.item_features.ids, vocab))
    other.candidate_tower.set_weights(model.candidate_tower.get_weights())
    other.query_tower.set_weights(model.query_tower.get_weights())
    np.testing.assert_allclose(other.item_embeddings(), model.item_embeddings(), atol=TOL)
    with pytest.raises(verify.ExportVerificationError, match="candidate SavedModel"):
        verify.verify_export(other, {CANDIDATE: exported[CANDIDATE]}, TOL, expect_warmup=False)


def test_a_model_without_item_features_ignores_them(tmp_path: Path) -> None:
    tf.keras.utils.set_random_seed(3)
    plain = TrainedModel.build(USERS, ITEMS, CONFIG)
    exported = export_savedmodels(plain, tmp_path, 1, 5, warmup=False)
    got = embed(exported[CANDIDATE], ITEMS[:3], [["Drama"]] * 3, ["Heat"] * 3)
    np.testing.assert_allclose(got, plain.item_embeddings()[:3], atol=TOL)
