"""Evaluation at scale: streamed exclusions, chunked ranking, sampled users with intervals."""

from __future__ import annotations

import numpy as np

from recsys import evaluation as ev
from recsys.core.config import EvaluationConfig

CFG = EvaluationConfig(ks=[10, 50], ndcg_k=10, mrr_k=50, coverage_k=10)


def _rows(users: np.ndarray, items: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "user_id": np.array([f"u{u}".encode() for u in users], dtype=object),
        "item_id": np.array([f"i{i}".encode() for i in items], dtype=object),
    }


def _reference_exclusions(catalog, eval_rows, known_rows) -> list[list[int]]:
    """The definition, one Python set per user."""
    position = {item: i for i, item in enumerate(catalog)}
    seen: dict[str, set[int]] = {}
    for rows in known_rows:
        for u, i in zip(rows["user_id"], rows["item_id"], strict=True):
            if i.decode() in position:
                seen.setdefault(u.decode(), set()).add(position[i.decode()])
    out = []
    for u, t in zip(eval_rows["user_id"], eval_rows["item_id"], strict=True):
        target = position.get(t.decode(), -1)
        out.append(sorted(seen.get(u.decode(), set()) - {target}))
    return out


def test_streamed_exclusions_equal_the_definition() -> None:
    rng = np.random.default_rng(0)
    catalog = [f"i{i}" for i in range(300)]
    eval_rows = _rows(rng.permutation(200), rng.integers(0, 320, 200))  # some unknown items
    known = _rows(rng.integers(0, 260, 5000), rng.integers(0, 320, 5000))
    batches = [{k: v[i : i + 333] for k, v in known.items()} for i in range(0, 5000, 333)]
    whole = ev.build_eval_set(catalog, eval_rows, [known])
    streamed = ev.build_eval_set(catalog, eval_rows, iter(batches))
    expected = _reference_exclusions(catalog, eval_rows, [known])
    assert [e.tolist() for e in whole.exclude] == expected
    assert [e.tolist() for e in streamed.exclude] == expected
    assert whole.targets.tolist() == [
        int(t.decode()[1:]) if int(t.decode()[1:]) < 300 else -1 for t in eval_rows["item_id"]
    ]


def test_chunked_ranking_equals_one_full_score_matrix() -> None:
    rng = np.random.default_rng(1)
    users, items = rng.normal(size=(300, 16)), rng.normal(size=(5000, 16))
    targets = rng.integers(0, 5000, 300)
    exclude = [rng.choice(5000, 30, replace=False) for _ in range(300)]
    exclude = [e[e != t] for e, t in zip(exclude, targets, strict=True)]
    data = ev.EvalSet([f"u{u}" for u in range(300)], targets, exclude, 5000)
    config = CFG.model_copy(update={"user_batch_size": 7})
    chunked = ev.evaluate(ev.dot_product_scores(users, items), data, config)
    scores = (users.astype(np.float32) @ items.astype(np.float32).T).astype(np.float32)
    for row, excluded in enumerate(exclude):
        scores[row, excluded] = -np.inf
    ranks = (scores > scores[np.arange(300), targets][:, None]).sum(axis=1)
    np.testing.assert_array_equal(chunked.per_user["rank"], ranks)
    assert chunked.metrics["recall_at_10"] == np.mean(ranks < 10)


def test_sampled_users_interval_covers_the_population_metric() -> None:
    rng = np.random.default_rng(2)
    population = 4000
    hits = (rng.random(population) < 0.3).astype(np.float64)  # per-user recall values
    truth = hits.mean()
    covered = 0
    for seed in range(200):
        sample = np.random.default_rng(seed).choice(population, 400, replace=False)
        lo, hi = ev.confidence_intervals({"recall_at_10": hits[sample]}, population)["recall_at_10"]
        covered += lo <= truth <= hi
    assert 0.9 <= covered / 200 <= 0.99
    # The whole population as the "sample": no sampling error left.
    lo, hi = ev.confidence_intervals({"recall_at_10": hits}, population)["recall_at_10"]
    assert lo == hi == truth


def test_sample_rows_is_seeded_uniform_and_keeps_order() -> None:
    rows = _rows(np.arange(1000), np.arange(1000))
    sample = ev.sample_rows(rows, 100, seed=3)
    assert len(sample["user_id"]) == 100
    ids = [int(u.decode()[1:]) for u in sample["user_id"]]
    assert ids == sorted(ids) and len(set(ids)) == 100
    assert ev.sample_rows(rows, 100, seed=3)["user_id"].tolist() == sample["user_id"].tolist()
    assert ev.sample_rows(rows, 0, seed=3) is rows


def test_sampled_batches_keep_the_sample_rows_of_the_whole_stream() -> None:
    rows = _rows(np.arange(1000), np.arange(1000))
    batches = [{k: v[s : s + 64] for k, v in rows.items()} for s in range(0, 1000, 64)]
    chosen = ev.sample_indices(1000, 10, seed=3)
    streamed = list(ev.sampled_batches(batches, chosen))
    assert len(streamed) < len(batches)  # batches without a sampled row are skipped
    whole = ev.sample_rows(rows, 10, seed=3)
    for name in rows:
        got = np.concatenate([b[name] for b in streamed])
        assert got.tolist() == whole[name].tolist()
    assert ev.sample_indices(1000, 0, seed=3) is None
    assert list(ev.sampled_batches(batches, None)) == batches
