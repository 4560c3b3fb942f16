"""One causal pass per sequence window: the maths against the per-prefix reference.

The one-pass loss of a batch of windows must equal the loss of the same positions computed
one prefix at a time (same weights, same negatives), outputs must be causal, and padding
must change nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from conductor import stages
from recsys.core.config import ModelConfig, RecsysConfig, set_values
from recsys.core.errors import ConfigError
from recsys.core.layout import Workdir
from recsys.data_io import Sequences
from recsys.losses import softmax_loss
from recsys.model import (
    HISTORY_INDEX,
    ITEM_INDEX,
    ITEM_LOG_PROB,
    PAD,
    TARGET_INDEX,
    USER_INDEX,
    TrainedModel,
    TwoTowerModel,
)
from recsys.training.trainer import IncrementalStart, train
from recsys.training.windows import TrainingSequences, make_windows, split_positions

USERS = [f"u{i}" for i in range(6)]
ITEMS = [f"i{i}" for i in range(15)]
LENGTH = 5


def _model(
    encoder: str,
    negatives: str,
    user_embedding: bool = True,
    positions: str = "relative",
    history_mean: bool = False,
) -> TwoTowerModel:
    tf.keras.utils.set_random_seed(3)
    config = ModelConfig(
        encoder_positions=positions,
        query_encoder=encoder,
        history_length=LENGTH,
        embedding_dim=8,
        encoder_dropout=0.0,
        encoder_heads=2,
        item_features=False,
        negatives=negatives,
        user_embedding=user_embedding,
        history_mean=history_mean,
        sampled_negatives=7,
    )
    trained = TrainedModel.build(USERS, ITEMS, config)
    log_probs = np.log(np.full(len(ITEMS) + 1, 1.0 / (len(ITEMS) + 1))).astype(np.float32)
    log_probs[3:6] += 1.0  # a non-uniform log Q, so the correction is exercised
    return TwoTowerModel(trained.query_tower, trained.candidate_tower, config, log_probs)


def _windows() -> dict[str, tf.Tensor]:
    """Two users' sequences (7 and 3 positions) cut into windows of 5, stride 3."""
    rng = np.random.default_rng(0)
    items = rng.integers(1, len(ITEMS) + 1, size=10)
    sequences = Sequences(["a", "b"], np.array([0, 7, 10]), items, np.zeros(10, np.int8))
    windows = make_windows(sequences, np.array([2, 4]), ("train",), LENGTH, 3)
    assert windows.positions == 10  # every position trained exactly once
    return {
        USER_INDEX: tf.constant(windows.users),
        HISTORY_INDEX: tf.constant(windows.inputs, tf.int64),
        TARGET_INDEX: tf.constant(windows.targets, tf.int64),
    }


def _prefix_rows(batch: dict[str, tf.Tensor]) -> dict[str, np.ndarray]:
    """One row per trained position, in the one-pass order: the user, the history the
    position sees (left-aligned, PAD after), the target."""
    users, inputs, targets = (batch[k].numpy() for k in (USER_INDEX, HISTORY_INDEX, TARGET_INDEX))
    rows: dict[str, list] = {USER_INDEX: [], HISTORY_INDEX: [], ITEM_INDEX: []}
    for w, j in zip(*np.nonzero(targets >= 0), strict=True):
        history = [i for i in inputs[w, : j + 1] if i != PAD]
        rows[USER_INDEX].append(users[w])
        rows[HISTORY_INDEX].append(history + [PAD] * (LENGTH - len(history)))
        rows[ITEM_INDEX].append(targets[w, j])
    return {k: np.array(v, np.int64) for k, v in rows.items()}


@pytest.mark.parametrize("negatives", ["in_batch", "full", "sampled"])
@pytest.mark.parametrize("encoder", ["mean", "gru", "transformer", "transformer+mean"])
def test_one_pass_loss_equals_the_per_prefix_loss(encoder: str, negatives: str) -> None:
    """Each position's query equals the per-prefix query (the serving path: the history
    right-aligned on its own); with the same pool (seeded), the same loss."""
    kind, _, mean = encoder.partition("+")
    model = _model(kind, negatives, history_mean=bool(mean))
    batch = _windows()
    tf.random.set_seed(11)  # the sampled pool: the same draw for both
    one_pass, examples = model._loss_and_examples(batch, training=False)
    rows = _prefix_rows(batch)
    features = {k: tf.constant(v) for k, v in rows.items()}
    features[ITEM_LOG_PROB] = tf.gather(model.item_log_probs, features[ITEM_INDEX])
    tf.random.set_seed(11)
    per_prefix, count = model._loss_and_examples(features, training=False)
    assert int(examples) == int(count) == 10
    np.testing.assert_allclose(float(one_pass), float(per_prefix), rtol=1e-5)


@pytest.mark.parametrize("negatives", ["in_batch", "full"])
def test_absolute_positions_one_pass_loss_equals_each_prefix_encoded_alone(negatives: str) -> None:
    """With absolute positions a prefix sits at the window's slots: each prefix encoded alone
    in the same slots (later slots PAD) gives the loss of the one pass."""
    model = _model("transformer", negatives, positions="absolute")
    batch = _windows()
    one_pass, _ = model._loss_and_examples(batch, training=False)
    inputs, targets = batch[HISTORY_INDEX].numpy(), batch[TARGET_INDEX].numpy()
    vectors, items = [], []
    for w, j in zip(*np.nonzero(targets >= 0), strict=True):
        alone = inputs[w : w + 1].copy()
        alone[:, j + 1 :] = PAD
        out = model.query_tower.sequence(
            {USER_INDEX: batch[USER_INDEX][w : w + 1], HISTORY_INDEX: tf.constant(alone)}
        )
        vectors.append(out[0, j].numpy())
        items.append(targets[w, j])
    query, items = tf.constant(np.stack(vectors)), tf.constant(items, tf.int64)
    log_p = tf.gather(model.item_log_probs, items)
    expected = model._loss(query, items, log_p, training=False)
    np.testing.assert_allclose(float(one_pass), float(expected), rtol=1e-5)


@pytest.mark.parametrize("encoder", ["mean", "gru", "transformer", "gru+mean", "transformer+mean"])
def test_outputs_are_causal_and_padding_changes_nothing(encoder: str) -> None:
    kind, _, mean = encoder.partition("+")
    tower = _model(kind, "full", history_mean=bool(mean)).query_tower
    users = tf.constant([1, 1], tf.int64)
    base = tf.constant([[PAD, PAD, 3, 7, 2], [PAD, PAD, 3, 11, 12]], tf.int64)
    out = tower.sequence({USER_INDEX: users, HISTORY_INDEX: base}).numpy()
    np.testing.assert_allclose(out[0, :3], out[1, :3], atol=1e-6)  # later items unseen
    assert np.abs(out[0, 3] - out[1, 3]).max() > 1e-4
    # A PAD slot before the history is no input: the same vectors whatever fills the batch.
    with_other = tf.constant([[PAD, PAD, 3, 7, 2], [5, 6, 8, 9, 10]], tf.int64)
    again = tower.sequence({USER_INDEX: users, HISTORY_INDEX: with_other}).numpy()
    np.testing.assert_allclose(out[0], again[0], atol=1e-6)
    # The serving path: the last slot of a right-aligned window is the query of its history.
    served = tower({USER_INDEX: users[:1], HISTORY_INDEX: tf.constant([[3, 7, 2, PAD, PAD]])})
    np.testing.assert_allclose(out[0, 4], served.numpy()[0], atol=1e-5)


def test_untrained_slots_and_history_only_windows_add_no_loss() -> None:
    model = _model("transformer", "full")
    batch = _windows()
    loss, _ = model._loss_and_examples(batch, training=False)
    extra = {k: tf.concat([v, v[:1]], 0) for k, v in batch.items()}
    extra[TARGET_INDEX] = tf.concat(
        [batch[TARGET_INDEX], tf.fill([1, LENGTH], tf.constant(PAD, tf.int64))], 0
    )
    padded, examples = model._loss_and_examples(extra, training=False)
    assert int(examples) == 10
    np.testing.assert_allclose(float(loss), float(padded), rtol=1e-6)


def test_blocked_softmax_with_labels_equals_the_dense_cross_entropy() -> None:
    rng = np.random.default_rng(1)
    query = tf.constant(rng.normal(size=(37, 6)), tf.float32)
    catalog = tf.constant(rng.normal(size=(23, 6)), tf.float32)
    labels = tf.constant(rng.integers(0, 23, size=37), tf.int64)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([query, catalog])
        blocked = softmax_loss(query, catalog, labels, temperature=0.5, block_rows=8)
        logits = tf.matmul(query, catalog, transpose_b=True) / 0.5
        dense = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    np.testing.assert_allclose(float(blocked), float(dense), rtol=1e-5)
    for var in (query, catalog):
        np.testing.assert_allclose(
            tape.gradient(blocked, var).numpy(), tape.gradient(dense, var).numpy(), atol=1e-5
        )


def test_windows_train_every_position_once_with_the_history_before_it() -> None:
    items = np.arange(1, 13)
    splits = np.array([0] * 5 + [1, 2] + [0] * 3 + [1, 2], np.int8)
    sequences = Sequences(["a", "b"], np.array([0, 7, 12]), items, splits)
    for stride in (1, 2, 4):
        windows = make_windows(sequences, np.array([1, 2]), ("train", "validation"), 4, stride)
        trained = windows.targets[windows.targets >= 0]
        assert sorted(trained.tolist()) == [1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
        for w, j in zip(*np.nonzero(windows.targets >= 0), strict=True):
            target = windows.targets[w, j]
            history = windows.inputs[w, : j + 1]
            history = history[history != PAD]
            # The items right before the target, as many as the window holds.
            first = 1 if target <= 6 else 8
            expected = np.arange(max(first, target - len(history)), target)
            np.testing.assert_array_equal(history, expected)
            assert len(history) >= min(target - first, 4 - stride + 1)
    validation = split_positions(sequences, ("validation",))
    held = make_windows(
        sequences, np.array([1, 2]), ("train", "validation"), 4, 4, True, validation
    )
    assert held.targets[held.targets >= 0].tolist() == [6, 11]


def test_an_incremental_night_trains_the_new_positions_from_the_previous_model(
    prepared: tuple[RecsysConfig, Workdir, Path], caplog: pytest.LogCaptureFixture
) -> None:
    config, workdir, data_dir = prepared
    # The night before: the log's last day is not there yet (rejected as after the run date).
    earlier = set_values(config, {"preprocess.max_rejected_fraction": 1.0})
    yesterday, _ = stages.preprocess(earlier, workdir, dt.date(2026, 1, 4))
    config = set_values(config, {"training.epochs": 1, "training.replay_fraction": 0.0})
    first = train(config, yesterday)
    model_dir = workdir.root / "night-1"
    first.model.save(model_dir)
    since = json.loads((yesterday / "stats.json").read_text())["max_timestamp"]
    full = train(config, data_dir)
    incremental = set_values(config, {"training.mode": "incremental"})
    with caplog.at_level(logging.INFO, logger="recsys.training.trainer"):
        night = train(incremental, data_dir, start=IncrementalStart(model_dir, since))
    sequences = TrainingSequences.load(data_dir, 1, timestamps=True)
    new = sequences.incremental(since, 0.0, 0)
    train_split = split_positions(sequences.sequences, ("train",))
    expected = int((sequences.trainable & train_split).sum())
    assert 0 < expected < full.examples
    assert night.examples == expected  # only the positions newer than the last night
    assert f"{new} positions after {since}" in caplog.text
    assert "rows taken over" in caplog.text  # the weights start from the previous model
    # Without a previous model the first incremental night trains in full.
    assert train(incremental, data_dir).examples == full.examples
    with pytest.raises(ConfigError, match=r"needs training\.input sequences"):
        train(set_values(incremental, {"training.input": "rows"}), data_dir)


def test_refit_continue_trains_the_first_fit_on_the_held_back_positions(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    config, _, data_dir = prepared
    config = set_values(config, {"training.epochs": 1, "training.refit": "continue"})
    result = train(config, data_dir)
    stats = json.loads((data_dir / "stats.json").read_text())["splits"]
    # One more epoch over every validation and test position, nothing else.
    assert result.refit_examples == stats["validation"] + stats["test"]
    assert result.refit_splits == ("train", "validation", "test")
    # The first fit never saw the test items: it is what evaluation scores.
    assert result.evaluation_model is not None and result.evaluation_model is not result.model
    first = result.evaluation_model.query_tower.get_weights()
    served = result.model.query_tower.get_weights()
    assert any(np.abs(a - b).max() > 0 for a, b in zip(first, served, strict=True))


def test_a_transformer_saved_before_relative_positions_loads_as_it_was_trained(
    tmp_path: Path,
) -> None:
    tf.keras.utils.set_random_seed(5)
    config = ModelConfig(
        query_encoder="transformer",
        encoder_positions="absolute",
        history_length=LENGTH,
        embedding_dim=8,
        item_features=False,
        user_embedding=True,
    )
    model = TrainedModel.build(USERS, ITEMS, config)
    model.save(tmp_path / "old")
    saved = json.loads((tmp_path / "old" / "model.json").read_text())
    del saved["encoder_positions"]  # what a model saved before the setting existed holds
    (tmp_path / "old" / "model.json").write_text(json.dumps(saved))
    loaded = TrainedModel.load(tmp_path / "old")
    assert loaded.config.encoder_positions == "absolute"
    histories = [["i1", "i4", "i2"], []]
    np.testing.assert_allclose(
        loaded.user_embeddings(["u1", "u2"], histories),
        model.user_embeddings(["u1", "u2"], histories),
        atol=1e-6,
    )


def test_history_mean_adds_an_order_free_term() -> None:
    """history_mean adds no weights but changes the query: the same weights, another vector."""
    users = tf.constant([1], tf.int64)
    history = tf.constant([[PAD, PAD, 3, 7, 2]], tf.int64)
    plain = _model("transformer", "full").query_tower
    mean = _model("transformer", "full", history_mean=True).query_tower
    assert len(plain.weights) == len(mean.weights)
    a = plain.sequence({USER_INDEX: users, HISTORY_INDEX: history}).numpy()
    b = mean.sequence({USER_INDEX: users, HISTORY_INDEX: history}).numpy()
    assert np.abs(a[0, 2:] - b[0, 2:]).max() > 1e-3
