"""The top-K implementations agree: same ids and scores on the same random vectors."""

import faiss
import numpy as np
import pytest

from recsys.topk import ExactNumpyTopK, ExactTFTopK, IndexTopK, ordered_top_k


def _flat_index(items: np.ndarray) -> faiss.Index:
    index = faiss.IndexFlatIP(items.shape[1])
    index.add(np.ascontiguousarray(items, dtype=np.float32))
    return index


@pytest.mark.parametrize(("num_items", "k"), [(50, 5), (2_000, 10), (7, 20)])
def test_exact_numpy_tf_and_faiss_agree(num_items: int, k: int) -> None:
    """Random float vectors (no ties): ids equal, scores equal to float32 rounding."""
    rng = np.random.default_rng(num_items)
    items = rng.normal(size=(num_items, 8)).astype(np.float32)
    queries = rng.normal(size=(33, 8)).astype(np.float32)
    answers = {
        name: impl(queries, k)
        for name, impl in {
            "numpy": ExactNumpyTopK(items),
            "tf": ExactTFTopK(items),
            "faiss": IndexTopK(_flat_index(items)),
        }.items()
    }
    want_k = min(k, num_items)  # capped at the catalog, never padded
    ref_scores, ref_ids = answers["numpy"]
    assert ref_ids.shape == ref_scores.shape == (33, want_k)
    assert (np.diff(ref_scores, axis=1) <= 0).all()
    brute = queries @ items.T
    np.testing.assert_allclose(ref_scores, np.sort(brute, axis=1)[:, ::-1][:, :want_k], rtol=1e-6)
    for name, (scores, ids) in answers.items():
        np.testing.assert_array_equal(ids, ref_ids, err_msg=name)
        np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5, err_msg=name)


def test_ties_go_to_the_lower_item_row_in_numpy_and_tf() -> None:
    """Equal scores (duplicated item vectors) rank by catalog order, also across the k cut."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(4, 6)).astype(np.float32)
    items = np.concatenate([base, base, base])  # rows i, i+4, i+8 score equally
    queries = rng.normal(size=(5, 6)).astype(np.float32)
    for k in (1, 2, 3, 5, 12):
        np_scores, np_ids = ExactNumpyTopK(items)(queries, k)
        tf_scores, tf_ids = ExactTFTopK(items)(queries, k)
        np.testing.assert_array_equal(np_ids, tf_ids, err_msg=f"k={k}")
        np.testing.assert_allclose(np_scores, tf_scores, rtol=1e-6)
    best = np.argmax(queries @ base.T, axis=1)
    np.testing.assert_array_equal(ExactNumpyTopK(items)(queries, 3)[1], best[:, None] + [0, 4, 8])


def test_ordered_top_k_resolves_a_tie_across_the_cut_over_the_whole_row() -> None:
    """A wide row (the block-maxima path) whose k-th place is a tie keeps the lowest rows."""
    scores = np.zeros((1, 20_000), np.float32)
    scores[0, [19_000, 5]] = 2.0
    values, ids = ordered_top_k(scores, 4)
    assert ids.tolist() == [[5, 19_000, 0, 1]]
    assert values.tolist() == [[2.0, 2.0, 0.0, 0.0]]
