"""The cross-dataset benchmark's own parts: protocol split (tie order) and the SASRec reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import protocol, sasrec
from recsys import evaluation as ev


def _log(rows: list[tuple[str, str, int]]) -> protocol.Log:
    users, items, stamps = zip(*rows, strict=True)
    return protocol.Log(np.array(users), np.array(items), np.array(stamps, np.int64), True, "test")


def test_ties_break_by_numeric_item_id_not_string() -> None:
    # u1's last second holds items 98 and 1000: numerically 1000 is last (the test item);
    # as strings "98" > "1000", which would make 98 the test item.
    rows = [("u1", str(i), 10) for i in (1, 2, 3)] + [("u1", "98", 50), ("u1", "1000", 50)]
    split = protocol.leave_last_out(_log(rows))
    catalog = split.catalog
    assert catalog == ["1", "2", "3", "98"]  # numeric order; 1000 only in test
    assert split.test == {0: -1}  # the test item 1000 is outside the catalog: a miss
    assert catalog[split.validation[0]] == "98"
    assert [catalog[i] for i in split.train[0]] == ["1", "2", "3"]


def test_string_ids_keep_string_order_and_short_users_are_train_only() -> None:
    log = _log([("a", "x", 1), ("a", "t", 1), ("b", "z", 1)] + [("c", i, 5) for i in "pqrst"])
    log.numeric = False
    split = protocol.leave_last_out(log, min_interactions=5)
    assert split.users == ["a", "b", "c"]
    assert 0 not in split.test and 1 not in split.test  # fewer than 5 events: train only
    assert split.catalog[split.test[2]] == "t" and split.catalog[split.validation[2]] == "s"
    assert split.test_rows.sum() == 1 and log.items[split.test_rows][0] == "t"
    rows, data = protocol.eval_set(split, "test")
    assert rows == [2] and data.users == ["c"]
    # Test ranking removes the user's training and validation items, never the target.
    assert sorted(split.catalog[i] for i in data.exclude[0]) == ["p", "q", "r", "s"]


def test_reads_the_amazon_style_csv(tmp_path: Path) -> None:
    path = tmp_path / "ratings.csv"
    path.write_text("userId,movieId,rating,timestamp\n1,10,1.0,1\n1,9,1.0,2\n")
    log = protocol.read_log(str(path))
    assert log.users.tolist() == ["1", "1"] and log.items.tolist() == ["10", "9"]
    assert log.timestamps.tolist() == [1, 2] and log.numeric


def test_sasrec_is_causal() -> None:
    model = sasrec.SASRec(20, sasrec.Settings(hidden=16, max_length=6, seed=0))
    seq = tf.constant([[0, 3, 4, 5, 6, 7]])
    changed = tf.constant([[0, 3, 4, 5, 6, 19]])
    a, b = model(seq).numpy(), model(changed).numpy()
    np.testing.assert_allclose(a[:, :5], b[:, :5], atol=1e-6)  # earlier outputs unchanged
    assert not np.allclose(a[:, 5], b[:, 5])


def test_sasrec_batch_trimmed_of_padding_columns_gives_the_same_outputs() -> None:
    """Trainer.epoch drops the all-padding columns of a batch: each real position keeps
    the output (and so the loss) it has in the full max_length window."""
    model = sasrec.SASRec(20, sasrec.Settings(hidden=16, max_length=8, seed=0))
    full = tf.constant([[0, 0, 0, 0, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0, 7, 8]])
    trimmed = full[:, -4:]
    np.testing.assert_allclose(model(full).numpy()[:, -4:], model(trimmed).numpy(), atol=1e-5)


def test_sasrec_length_batches_group_users_of_similar_length() -> None:
    """length_batches: each batch holds users of neighbouring lengths (less padding); the
    default draws uniformly random batches. Both pass over every user once."""
    lengths = np.repeat([2, 9], 64)
    targets = np.zeros((128, 10), np.int32)
    for r, n in enumerate(lengths):
        targets[r, -n:] = 1
    inputs = targets.copy()
    seen: dict[bool, list[np.ndarray]] = {}
    for by_length in (False, True):
        s = sasrec.Settings(hidden=8, blocks=1, max_length=10, batch_size=32,
                            length_batches=by_length)  # fmt: skip
        trainer = sasrec.Trainer(20, s)
        batches: list[np.ndarray] = []
        trainer.step = lambda seq, target, out=batches: (out.append(target.numpy()), 0.0)[1]
        trainer.epoch(inputs, targets, np.random.default_rng(0))
        seen[by_length] = batches
        assert sum(len(b) for b in batches) == 128
    assert all(len({int(v) for v in (b > 0).sum(axis=1)}) == 1 for b in seen[True])
    assert any(len({int(v) for v in (b > 0).sum(axis=1)}) == 2 for b in seen[False])
    assert "-bylength" in sasrec.Settings(length_batches=True).label()


def test_sasrec_learns_a_deterministic_sequence_pattern() -> None:
    """Every user walks the catalog in steps of +3 (mod 30): the next item is certain."""
    rng = np.random.default_rng(0)
    n = 30

    def walk(length: int) -> np.ndarray:
        return (rng.integers(n) + 3 * np.arange(length)) % n

    train = [walk(12) for _ in range(200)]
    held_out = [walk(8) for _ in range(50)]
    history = [s[:-1] for s in held_out]

    data = ev.EvalSet(
        [str(i) for i in range(50)],
        np.array([s[-1] for s in held_out]),
        [np.zeros(0, np.int64)] * 50,
        n,
    )
    settings = sasrec.Settings(
        hidden=32, blocks=1, dropout=0.1, max_length=12, learning_rate=5e-3,
        batch_size=64, max_epochs=30, eval_every=5, patience=2, seed=0,
    )  # fmt: skip
    trainer, info = sasrec.fit(n, train, (history, data), settings)
    scores = trainer.scores(history)(np.arange(50))
    accuracy = float(np.mean(scores.argmax(axis=1) == data.targets))
    assert accuracy > 0.9, (accuracy, info["curve"])
    # Popularity cannot do this: every item is equally frequent (chance = 1/30).
    assert info["validation_ndcg_at_10"] > 0.9
    # The refit (train + validation sequences, the kept epoch count, no evaluation) is a
    # fresh model that learns the same rule.
    refitted = sasrec.refit(n, train + held_out, settings, info["best_epoch"])
    assert refitted is not trainer
    again = refitted.scores(history)(np.arange(50))
    assert float(np.mean(again.argmax(axis=1) == data.targets)) > 0.9


def test_ours_is_scored_from_the_exported_parquet_files(tmp_path: Path) -> None:
    """The outside scorer: test rows never reach the pipeline; vectors come from the files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from benchmarks import quality
    from serving_export.embeddings import embeddings_schema

    path = tmp_path / "ratings.csv"
    rows = [("1", str(i), t) for t, i in enumerate([10, 11, 12, 13, 14], 1)]
    rows += [("2", str(i), t) for t, i in enumerate([12, 11, 10, 14, 15], 1)]
    path.write_text("userId,movieId,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
    bench = quality.Bench(str(path))
    ours = quality.Ours(bench, tmp_path / "ours")
    written = (tmp_path / "ours" / "log.csv").read_text().splitlines()
    assert len(written) == 1 + 8  # both test rows (user 1: item 14, user 2: item 15) left out
    assert "1,14,5" not in written and "2,15,5" not in written

    def write(name: str, column: str, ids: list[str], vectors: list[list[float]]) -> Path:
        schema = embeddings_schema(column, 2, 1)
        flat = pa.array([x for v in vectors for x in v], pa.float32())
        table = pa.Table.from_arrays(
            [pa.array(ids), pa.FixedSizeListArray.from_arrays(flat, 2), pa.array([1] * len(ids))],
            schema=schema,
        )
        pq.write_table(table, tmp_path / name)
        return tmp_path / name

    # The export lacks item 14 (say it was only in a row the pipeline held out) and user 2.
    items = write("items.parquet", "item_id", ["13", "10", "12", "11"],
                  [[0, 1], [1, 0], [0.5, 0.5], [-1, 0]])  # fmt: skip
    users = write("users.parquet", "user_id", ["1"], [[1.0, 0.0]])
    scores, missing = ours.parquet_scores({"items": items, "users": users})
    assert missing == {"users": 1, "items": 1}
    assert bench.split.catalog == ["10", "11", "12", "13", "14"]
    got = scores(np.arange(2))
    np.testing.assert_allclose(got[0], [1.0, -1.0, 0.5, 0.0, -np.inf])  # catalog order
    np.testing.assert_allclose(got[1, :4], 0.0)


def test_ours_validation_stage_holds_out_validation_rows_too(tmp_path: Path) -> None:
    """--stage validation: neither validation nor test rows reach the pipeline; the
    validation item is the scored one, with only the training items known."""
    from benchmarks import quality

    path = tmp_path / "ratings.csv"
    rows = [("1", str(i), t) for t, i in enumerate([10, 11, 12, 13, 14], 1)]
    rows += [("2", str(i), t) for t, i in enumerate([12, 11, 10, 14, 15], 1)]
    path.write_text("userId,movieId,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
    bench = quality.Bench(str(path))
    ours = quality.Ours(bench, tmp_path / "ours", stage="validation")
    written = (tmp_path / "ours" / "log.csv").read_text().splitlines()
    assert len(written) == 1 + 6
    for held_out in ("1,13,4", "1,14,5", "2,14,4", "2,15,5"):
        assert held_out not in written
    assert ours.scored is bench.val_set
    assert [bench.split.catalog[t] for t in ours.scored.targets] == ["13", "14"]


def test_sasrec_candidates_are_distinct_when_the_start_already_has_a_change() -> None:
    """--sasrec-length-batches: the start batches by length, so that change is not re-tried."""
    from benchmarks import quality

    plain = quality.sasrec_candidates(sasrec.Settings(learning_rate=1e-3))
    assert len(plain) == 7 and len(set(plain)) == 7
    batched = quality.sasrec_candidates(sasrec.Settings(learning_rate=1e-3, length_batches=True))
    assert len(batched) == 6 and len(set(batched)) == 6
    assert batched[0].length_batches and all(s.length_batches for s in batched)


def test_a_second_sasrec_round_starts_from_the_best_tuning_fit() -> None:
    """--sasrec-from-best: the candidates change one setting of the best fit, not the start."""
    from dataclasses import asdict

    from benchmarks import quality

    good = sasrec.Settings(learning_rate=3e-3, length_batches=True, max_epochs=50)
    worse = sasrec.Settings(learning_rate=1e-3, length_batches=True, max_epochs=50)
    tuning = {
        s.label(): {"settings": asdict(s), "validation_ndcg_at_10": v}
        for s, v in ((good, 0.063), (worse, 0.033))
    }
    start = quality._best_sasrec(tuning, max_epochs=80)
    assert start.label() == good.label() and start.max_epochs == 80
    round_two = quality.sasrec_candidates(start)
    assert round_two[0] == start and len(round_two) == 5  # lr 3e-3 and length batches: no-ops
    assert all(s.learning_rate == 3e-3 for s in round_two)
    assert {s.label() for s in round_two[1:]}.isdisjoint(tuning)


def test_implicit_als_reference_ranks_each_users_own_block_first() -> None:
    # Two user groups with disjoint tastes (items 0-4, items 5-9): every user's ALS scores
    # must favour their group's unseen items over the other group's.
    from scipy import sparse

    from benchmarks import quality

    rng = np.random.default_rng(0)
    x = np.zeros((40, 10), dtype=np.float32)
    for u in range(40):
        block = range(0, 5) if u < 20 else range(5, 10)
        x[u, rng.choice(list(block), 3, replace=False)] = 1
    users, items = quality.als_fit(sparse.csr_matrix(x), 4, 0.1, 10.0, seed=0)
    scores = quality.factor_scores(users, items, np.arange(40))(np.arange(40))
    first = np.arange(40) < 20
    own = np.where(first, scores[:, :5].mean(1), scores[:, 5:].mean(1))
    other = np.where(first, scores[:, 5:].mean(1), scores[:, :5].mean(1))
    assert (own > other).all()


def test_screen_variants_merge_overrides_nested_keys_only() -> None:
    from benchmarks.screen_variants import merge

    base = {"model": {"embedding_dim": 64, "user_embedding": "auto"}, "training": {"epochs": 10}}
    merged = merge(base, {"model": {"user_embedding": False}, "data": {"source": "csv"}})
    assert merged == {
        "model": {"embedding_dim": 64, "user_embedding": False},
        "training": {"epochs": 10},
        "data": {"source": "csv"},
    }
    assert base["model"]["user_embedding"] == "auto"  # the base is not changed


def test_per_user_ranks_are_kept_beside_the_results_for_paired_comparisons(
    tmp_path: Path,
) -> None:
    """Every run's per-user ranks go to <results>.ranks.npz; --paired compares two models on
    the same users, and a merge keeps the ranks of the runs it keeps."""
    import argparse

    from benchmarks import quality

    rng = np.random.default_rng(0)
    path = tmp_path / "ratings.csv"
    lines = [f"{u},{i},{t}\n" for u in range(40) for t, i in enumerate(rng.choice(30, 8, False))]
    path.write_text("userId,movieId,timestamp\n" + "".join(lines))
    out = tmp_path / "q.json"
    args = argparse.Namespace(
        data=[str(path)], models=["popularity", "ease"], seeds=[0], out=str(out), resume=False,
        stage="test", config="configs/default.yaml", tuned=None, tune_trials=0,
    )  # fmt: skip
    results = quality.run_dataset(str(path), args)
    ranks = quality.load_ranks(quality.ranks_path(out))
    assert sorted(ranks) == ["ease/seed0", "popularity/seed0"]
    assert all(
        r.dtype == np.uint8 and len(r) == results["data"]["test_users"] for r in ranks.values()
    )
    assert all(quality.RANKS_KEY not in run for run in json.loads(out.read_text())["runs"].values())
    for run in results["runs"].values():  # unfiltered: known items compete, so never higher
        assert set(run[quality.UNFILTERED]) == set(run["test"])
        assert run[quality.UNFILTERED]["recall_at_10"] <= run["test"]["recall_at_10"]
    # The ranks give back the metrics the results file reports.
    for key, r in ranks.items():
        per_user = quality._per_user({key: r}, key.split("/")[0])
        for metric in ("recall_at_10", "ndcg_at_10", "mrr_at_100"):
            assert per_user[metric].mean() == pytest.approx(
                results["runs"][key]["test"][metric], abs=5e-5
            )
    report = quality.paired(ranks, "ease", "popularity", resamples=200)
    ndcg = {m: quality._per_user(ranks, m)["ndcg_at_10"].mean() for m in ("ease", "popularity")}
    row = next(line for line in report.splitlines() if line.startswith("| ndcg_at_10 "))
    assert f"| {ndcg['ease'] - ndcg['popularity']:+.4f} (" in row
    # A merge keeps the ranks of the runs it keeps, from the file each run came from.
    other = tmp_path / "other.json"
    quality.save_ranks(quality.ranks_path(other), {"als/seed0": ranks["ease/seed0"]})
    merged = {"runs": {"ease/seed0": {}, "als/seed0": {}}}
    assert sorted(quality.merge_ranks([out, other], merged)) == ["als/seed0", "ease/seed0"]


def test_unfiltered_ranking_leaves_the_users_known_items_in() -> None:
    """A user's 10 known items score above the target: rank 0 filtered, rank 10 unfiltered."""
    from benchmarks import quality

    data = ev.EvalSet(["u"], np.array([10]), [np.arange(10)], 20)
    scores = np.arange(20, 0, -1, dtype=np.float32)[None, :]
    test, ranks, raw = quality._test_scored(lambda rows: scores.repeat(len(rows), 0), data)
    assert ranks.tolist() == [0]
    assert (test["recall_at_10"], test["ndcg_at_10"]) == (1.0, 1.0)
    assert (raw["recall_at_10"], raw["recall_at_50"]) == (0.0, 1.0)
    assert [len(e) for e in quality.unfiltered(data).exclude] == [0]


def test_paired_differences_on_identical_users_have_a_point_interval() -> None:
    from benchmarks import quality

    ranks = {
        "a/seed0": np.zeros(50, np.uint8),  # every user's item first
        "b/seed0": np.full(50, 4, np.uint8),  # fifth
        "b/seed1": np.full(50, quality.RANK_CAP, np.uint8),  # beyond the cap: a miss
    }
    report = quality.paired(ranks, "a", "b", resamples=100)
    b_ndcg = (1 / np.log2(6)) / 2  # each user's value averaged over b's two seeds
    row = next(line for line in report.splitlines() if line.startswith("| ndcg_at_10 "))
    diff = 1 - b_ndcg
    assert f"| 1.0000 | {b_ndcg:.4f} | {diff:+.4f} ({diff:+.4f}, {diff:+.4f})" in row
    with pytest.raises(SystemExit, match="no per-user ranks of 'c'"):
        quality.paired(ranks, "a", "c")
