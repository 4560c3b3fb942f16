"""Evaluation, segments and latest histories read from the per-user sequence records give
exactly what the former per-row readers gave (their code is kept here as the reference)."""

from __future__ import annotations

import itertools
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from recsys import evaluation as ev
from recsys.core import schema
from recsys.core.config import RecsysConfig
from recsys.core.layout import DataFile
from recsys.data_io import (
    Sequences,
    concat_batches,
    decoded,
    iter_split,
    latest_histories,
    latest_items,
    load_split,
)
from recsys.item_tokens import PAD
from recsys.model import TrainedModel
from recsys.model.inputs import read_vocab
from recsys.model_evaluation import evaluate_model
from recsys.tracking.compare import HEAD_SHARE, NEW_USER_MAX_HISTORY, user_segments
from serving_export.activity import read_activity
from tests.test_beam_sequences import HISTORY_LENGTH, preprocess, tied_config, write_tied_log
from tests.test_export_activity import string_based

# --- eval_examples on hand-made sequences ----------------------------------------------------

# Item indices as a model lookup gives them: 0 is the one OOV bucket, the catalog starts at 1.
# "c" has two test positions (time-window split); "d" none.
SEQUENCES = Sequences(
    users=["a", "b", "c", "d"],
    offsets=np.array([0, 5, 9, 14, 16]),
    items=np.array([5, 3, 7, 3, 9, 2, 4, 0, 4, 1, 2, 3, 0, 1, 6, 6]),
    splits=np.array([0, 0, 0, 1, 2, 0, 0, 1, 2, 0, 1, 2, 2, 2, 0, 0], np.int8),
)


def csr(examples: ev.EvalExamples) -> list[list[int]]:
    o = examples.exclude_offsets
    return [sorted(examples.exclude_items[o[i] : o[i + 1]].tolist()) for i in range(len(o) - 1)]


def test_eval_examples_of_the_test_split() -> None:
    got = ev.eval_examples(SEQUENCES, "test", first_item=1)
    assert got.rows.tolist() == [0, 1, 2, 2, 2]
    assert got.positions.tolist() == [4, 8, 11, 12, 13]
    assert got.targets.tolist() == [8, 3, 2, -1, 0]  # the OOV item: outside the catalog
    # Train + validation items (catalog indices), each once, never the example's own target.
    assert csr(got) == [[2, 4, 6], [1], [0, 1], [0, 1], [1]]
    histories = got.histories(SEQUENCES.items, 3)
    assert histories.tolist() == [
        [3, 7, 3],
        [2, 4, 0],
        [1, 2, PAD],
        [1, 2, 3],
        [2, 3, 0],
    ]
    assert got.population is None
    eval_set = got.eval_set(SEQUENCES.users, 9)
    assert eval_set.users == ["a", "b", "c", "c", "c"]
    assert [e.tolist() for e in eval_set.exclude] == csr(got)


def test_eval_examples_of_the_validation_split_exclude_train_only() -> None:
    got = ev.eval_examples(SEQUENCES, "validation", first_item=1)
    assert got.positions.tolist() == [3, 7, 10]
    assert got.targets.tolist() == [2, -1, 1]
    assert csr(got) == [[4, 6], [1, 3], [0]]
    assert got.histories(SEQUENCES.items, 5).tolist() == [
        [5, 3, 7, PAD, PAD],
        [2, 4, PAD, PAD, PAD],
        [1, PAD, PAD, PAD, PAD],
    ]
    assert got.histories(SEQUENCES.items, 0).shape == (3, 0)


def test_a_sample_keeps_the_seeded_examples() -> None:
    whole = ev.eval_examples(SEQUENCES, "test", first_item=1)
    got = ev.eval_examples(SEQUENCES, "test", first_item=1, sample=2, seed=3)
    chosen = ev.sample_indices(5, 2, 3)
    assert got.positions.tolist() == whole.positions[chosen].tolist()
    assert csr(got) == [csr(whole)[i] for i in chosen.tolist()]
    assert got.population == 5
    assert ev.eval_examples(SEQUENCES, "test", sample=5).population is None  # everyone


# --- the readers against the per-row splits ---------------------------------------------------


def per_row_evaluate(
    config: RecsysConfig, model_dir: Path, data_dir: Path
) -> tuple[ev.EvalSet, ev.EvalResult]:
    """The former evaluate_model: test rows with the Beam job's histories, exclusions from the
    train and validation rows."""
    model = TrainedModel.load(model_dir)
    sample = config.evaluation.sample_users
    test = concat_batches(iter_split(data_dir, "test"), schema.FEATURE_NAMES)
    population = len(test[schema.USER_ID])
    test = ev.sample_rows(test, sample, config.evaluation.sample_seed)
    ids = (schema.USER_ID, schema.ITEM_ID)
    known = itertools.chain(*(iter_split(data_dir, s, ids) for s in ("train", "validation")))
    eval_set = ev.build_eval_set(model.items, test, known)
    if sample and sample < population:
        eval_set.population = population
    vectors = model.user_embeddings(eval_set.users, list(test[schema.HISTORY]))
    scores = ev.dot_product_scores(vectors, model.item_embeddings())
    return eval_set, ev.evaluate(scores, eval_set, config.evaluation)


def per_row_segments(data_dir: Path) -> dict[str, tuple[str, str]]:
    """The former compare.user_segments, over the per-row splits."""
    history: dict[str, int] = {}
    for split in ("train", "validation"):
        for user in load_split(data_dir, split, columns=[schema.USER_ID])[schema.USER_ID]:
            history[user.decode()] = history.get(user.decode(), 0) + 1
    features = pq.read_table(data_dir / DataFile.ITEM_FEATURES).to_pydict()
    order = np.argsort(-np.asarray(features["train_count"]), kind="stable")
    head = {
        str(features["item_id"][i]) for i in order[: max(1, math.ceil(HEAD_SHARE * len(order)))]
    }
    test = load_split(data_dir, "test", columns=[schema.USER_ID, schema.ITEM_ID])
    labels = {}
    for user, item in zip(test[schema.USER_ID], test[schema.ITEM_ID], strict=True):
        who = (
            "new users"
            if history.get(user.decode(), 0) <= NEW_USER_MAX_HISTORY
            else "returning users"
        )
        labels[user.decode()] = (who, "head items" if item.decode() in head else "tail items")
    return labels


def random_model(config: RecsysConfig, data_dir: Path, path: Path) -> Path:
    """Untrained towers over the data's vocabularies (scores are arbitrary but fixed)."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(5)
    model = TrainedModel.build(
        read_vocab(data_dir / "vocab" / "users.txt"),
        read_vocab(data_dir / "vocab" / "items.txt"),
        config.model.model_copy(
            update={"user_embedding": True, "negatives": "full", "oov_buckets": 3}
        ),
    )
    model.save(path)
    return path


def without_per_row_splits(data_dir: Path, copy: Path) -> Path:
    """A copy of a data folder without its per-row split files: only the records remain."""
    shutil.copytree(data_dir, copy)
    for split in schema.SPLITS:
        for path in copy.glob(f"{split}-*.tfrecord.gz"):
            path.unlink()
    return copy


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> tuple[RecsysConfig, Path]:
    """The tied log under the time-window split (several test positions per user), one shard."""
    tmp = tmp_path_factory.mktemp("tied")
    log = write_tied_log(tmp / "log.csv")
    out, stats = preprocess(tmp, log, "time_window")
    assert stats["splits"]["test"] > stats["sequences"]["users"] // 2
    config = tied_config(log, "time_window")
    # A window shorter than the Beam job's per-row histories: both readers cut it.
    model = config.model.model_copy(update={"history_length": HISTORY_LENGTH - 1})
    return config.model_copy(update={"model": model}), out


@pytest.fixture(scope="module", params=["small", "tied"])
def dataset(
    request: pytest.FixtureRequest, prepared: tuple, tied: tuple
) -> tuple[RecsysConfig, Path]:
    """(config, data folder): SMALL's synthetic log (leave-last-out), or the tied log."""
    if request.param == "small":
        config, _, data_dir = prepared
        return config, data_dir
    return tied


@pytest.mark.parametrize("sample", [0, 30])
def test_evaluate_model_equals_the_per_row_evaluation(
    dataset: tuple, sample: int, tmp_path: Path
) -> None:
    config, data_dir = dataset
    evaluation = config.evaluation.model_copy(update={"sample_users": sample, "sample_seed": 4})
    config = config.model_copy(update={"evaluation": evaluation})
    model_dir = random_model(config, data_dir, tmp_path / "model")
    expected_set, expected = per_row_evaluate(config, model_dir, data_dir)
    records_only = without_per_row_splits(data_dir, tmp_path / "records")
    got_set, got = evaluate_model(config, model_dir, records_only)
    assert got_set.users == expected_set.users
    assert got_set.targets.tolist() == expected_set.targets.tolist()
    assert [sorted(e.tolist()) for e in got_set.exclude] == [
        sorted(e.tolist()) for e in expected_set.exclude
    ]
    assert got_set.population == expected_set.population
    assert got.metrics == expected.metrics
    assert got.metrics["recall_at_50"] > 0  # the ranks are not all misses
    assert got.intervals == expected.intervals
    for name, values in expected.per_user.items():
        assert got.per_user[name].tolist() == values.tolist()
    if sample:
        assert got.metrics["eval_users"] == sample


def test_sharded_records_give_the_same_examples(tied: tuple, tmp_path: Path) -> None:
    """Three shards interleave users differently: the same examples and ranks, reordered."""
    config, data_dir = tied
    log = Path(config.data.path or "")
    sharded, _ = preprocess(tmp_path, log, "time_window", 3)
    model_dir = random_model(config, data_dir, tmp_path / "model")
    expected_set, expected = per_row_evaluate(config, model_dir, data_dir)
    got_set, got = evaluate_model(config, model_dir, sharded)

    def keyed(eval_set: ev.EvalSet, result: ev.EvalResult) -> list[tuple]:
        ranks = result.per_user["rank"].tolist()
        return sorted(zip(eval_set.users, eval_set.targets.tolist(), ranks, strict=True))

    assert keyed(got_set, got) == keyed(expected_set, expected)
    assert got.metrics == pytest.approx(expected.metrics, rel=1e-12)


def test_segments_and_latest_histories_equal_the_per_row_ones(
    dataset: tuple, tmp_path: Path
) -> None:
    _, data_dir = dataset
    records_only = without_per_row_splits(data_dir, tmp_path / "records")
    labels = user_segments(records_only)
    assert labels == per_row_segments(data_dir)
    assert {"new users", "returning users"} <= {who for who, _ in labels.values()}
    columns = (schema.USER_ID, schema.ITEM_ID, schema.TIMESTAMP)
    parts = [load_split(data_dir, split, columns=columns) for split in schema.SPLITS]
    user = decoded([u for p in parts for u in p[schema.USER_ID]])
    item = decoded([i for p in parts for i in p[schema.ITEM_ID]])
    stamp = np.concatenate([p[schema.TIMESTAMP] for p in parts]).astype(np.int64)
    users = [*sorted(set(user.tolist()))[::-1], "nobody"]
    for length in (0, 3, 50):
        assert latest_histories(records_only, users, length) == latest_items(
            user, item, stamp, users, length
        )


def test_activity_from_the_records_equals_the_per_row_one(dataset: tuple, tmp_path: Path) -> None:
    _, data_dir = dataset
    users = [*read_vocab(data_dir / "vocab" / "users.txt")[::-1], "nobody"]
    items = read_vocab(data_dir / "vocab" / "items.txt")
    items = [*items[:5], items[0], *items[5:], "never"]  # a repeated and an absent id
    expected = string_based(data_dir, users, items, 5)
    got = read_activity(without_per_row_splits(data_dir, tmp_path / "records"), users, items, 5)
    assert got.histories == expected["histories"]
    assert got.user_columns["interactions"].equals(expected["interactions"])
    assert got.user_columns["last_seen"].equals(expected["user_last_seen"])
    assert got.item_columns["last_seen"].equals(expected["item_last_seen"])
    # popularity comes from item_features.parquet's train_count here: the same counts.
    assert got.item_columns["popularity"].equals(expected["popularity"])
