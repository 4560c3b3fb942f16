"""The sequence query encoders (transformer, GRU) and the extra negatives, on tiny inputs."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from conductor import stages
from recsys.core.config import ModelConfig, RecsysConfig
from recsys.core.layout import Workdir
from recsys.losses import in_batch_softmax_loss
from recsys.model import TrainedModel, TwoTowerModel, warm_start
from recsys.model.encoders import GRUEncoder, TransformerEncoder, right_align
from recsys.model.inputs import HISTORY_INDEX, USER_INDEX
from recsys.model.negatives import sample_pool
from recsys.model.trained import ENCODE_ELEMENTS, MAX_ENCODE_ROWS, history_groups
from recsys.training.memory import FLOAT, estimate
from serving_export.savedmodels import export_savedmodels
from tests.conftest import SMALL_DATE

USERS = [f"u{i}" for i in range(8)]
ITEMS = [f"i{i}" for i in range(12)]
LENGTH = 6
TRANSFORMER = ModelConfig(
    query_encoder="transformer",
    history_length=LENGTH,
    embedding_dim=16,
    encoder_dropout=0.0,
    item_features=False,
    user_embedding=True,
)
GRU = TRANSFORMER.model_copy(update={"query_encoder": "gru"})


def _encoder(seed: int = 0) -> TransformerEncoder:
    tf.keras.utils.set_random_seed(seed)
    table = tf.keras.layers.Embedding(20, 16)
    encoder = TransformerEncoder(table, LENGTH, 16, num_layers=2, num_heads=2, dropout=0.0)
    encoder(tf.constant([[1, 2, -1, -1, -1, -1]], tf.int64))
    return encoder


def test_right_align_moves_items_to_the_end_in_order() -> None:
    ids = tf.constant([[4, 5, -1, -1], [-1, -1, -1, -1], [1, 2, 3, 9]], tf.int64)
    np.testing.assert_array_equal(
        right_align(ids).numpy(), [[-1, -1, 4, 5], [-1, -1, -1, -1], [1, 2, 3, 9]]
    )


def test_future_items_do_not_change_earlier_outputs() -> None:
    encoder = _encoder()
    base = tf.constant([[-1, 3, 7, 2, 9, 4]], tf.int64)
    changed = tf.constant([[-1, 3, 7, 11, 12, 13]], tf.int64)  # positions 3.. differ
    a, b = encoder.sequence(base).numpy(), encoder.sequence(changed).numpy()
    np.testing.assert_allclose(a[:, :3], b[:, :3], atol=1e-6)
    assert np.abs(a[:, 3:] - b[:, 3:]).max() > 1e-3  # and later outputs do see them


def test_latest_output_equals_the_last_position_of_the_sequence() -> None:
    encoder = _encoder()
    ids = tf.constant([[3, 7, 1, -1, -1, -1], [5, 4, 3, 2, 1, 9], [-1] * LENGTH], tf.int64)
    full = encoder.sequence(right_align(ids)).numpy()[:, -1]
    np.testing.assert_allclose(encoder(ids).numpy(), full, atol=1e-5)


def test_padding_is_ignored_and_an_empty_history_encodes_to_zero() -> None:
    encoder = _encoder()
    ids = tf.constant([[3, 7, -1, -1, -1, -1], [-1] * LENGTH], tf.int64)
    before = encoder(ids).numpy()
    # PAD entries are looked up as row 0 and masked: changing row 0 must change nothing.
    table = encoder.item_embedding.embeddings
    table.assign(tf.tensor_scatter_nd_update(table, [[0]], tf.ones([1, 16]) * 5.0))
    after = encoder(ids).numpy()
    np.testing.assert_allclose(before, after, atol=1e-6)
    np.testing.assert_array_equal(after[1], 0.0)
    # The same two items padded to another position give the same vector (right-aligned).
    shifted = tf.constant([[3, 7, -1, -1, -1, -1]], tf.int64)
    np.testing.assert_allclose(encoder(shifted).numpy()[0], after[0], atol=1e-6)


def _gru(seed: int = 0) -> GRUEncoder:
    """A built GRU encoder whose weights are all random (zero biases would hide an offset)."""
    tf.keras.utils.set_random_seed(seed)
    encoder = GRUEncoder(tf.keras.layers.Embedding(20, 16), 16, dropout=0.0)
    encoder(tf.constant([[1, 2, -1, -1, -1, -1]], tf.int64))
    for w in [*encoder.gru.weights, *encoder.norm.weights]:
        w.assign(tf.random.normal(w.shape, stddev=0.5))
    return encoder


def test_gru_ignores_padding_and_encodes_an_empty_history_to_zero() -> None:
    encoder = _gru()
    ids = tf.constant([[3, 7, 1, -1, -1, -1], [-1] * LENGTH], tf.int64)
    before = encoder(ids).numpy()
    assert np.abs(before[0]).max() > 1e-3
    np.testing.assert_array_equal(before[1], 0.0)
    # The same items with more (or no) PAD steps after them: the masked steps never update.
    longer = tf.constant([[3, 7, 1] + [-1] * 9], tf.int64)
    np.testing.assert_allclose(encoder(longer).numpy()[0], before[0], atol=1e-6)
    np.testing.assert_allclose(encoder(ids[:1, :3]).numpy()[0], before[0], atol=1e-6)
    # PAD entries are looked up as row 0 and masked: changing row 0 must change nothing.
    table = encoder.item_embedding.embeddings
    table.assign(tf.tensor_scatter_nd_update(table, [[0]], tf.ones([1, 16]) * 5.0))
    np.testing.assert_allclose(encoder(ids).numpy(), before, atol=1e-6)


def test_gru_is_order_sensitive() -> None:
    encoder = _gru()
    forward = encoder(tf.constant([[3, 7, 1, 9, -1, -1]], tf.int64)).numpy()
    backward = encoder(tf.constant([[9, 1, 7, 3, -1, -1]], tf.int64)).numpy()
    assert np.abs(forward - backward).max() > 1e-3


def test_gru_encodes_a_history_as_the_prefix_state_of_any_longer_sequence() -> None:
    """enc(h_1..k) = LN(s_k) of a GRU run over h_1..L: later items cannot reach it."""
    encoder = _gru()
    full = tf.constant([[3, 7, 1, 9, 4, 11]], tf.int64)
    steps = tf.keras.layers.GRU(16, return_sequences=True)
    x = encoder.item_embedding(full)
    steps(x)
    steps.set_weights(encoder.gru.get_weights())
    states = encoder.norm(steps(x)).numpy()[0]  # [L, d]
    for k in range(1, LENGTH + 1):
        prefix = tf.concat([full[:, :k], tf.fill([1, LENGTH - k], tf.constant(-1, tf.int64))], 1)
        np.testing.assert_allclose(encoder(prefix).numpy()[0], states[k - 1], atol=1e-5)


def test_the_gru_is_the_query_towers_encoder_and_its_memory_is_estimated() -> None:
    tf.keras.utils.set_random_seed(7)
    model = TrainedModel.build(USERS, ITEMS, GRU)
    assert isinstance(model.query_tower.encoder, GRUEncoder)
    # The history table is the candidate tower's (shared), as for the transformer.
    assert model.query_tower.encoder.item_embedding is model.candidate_tower.embedding
    config = RecsysConfig(model=GRU)
    mean = RecsysConfig(model=GRU.model_copy(update={"query_encoder": "mean"}))
    batch = config.training.batch_size
    gru_bytes = estimate(config, 100, 50, 10_000)["tower activations"]
    mean_bytes = estimate(mean, 100, 50, 10_000)["tower activations"]
    assert gru_bytes - mean_bytes == batch * LENGTH * 3 * 16 * 4 * FLOAT


def _numpy_loss(q: np.ndarray, c: np.ndarray, ids: np.ndarray, log_q: np.ndarray, t: float):
    """Softmax CE of each row's diagonal column, log_q subtracted, accidental hits removed."""
    logits = q @ c.T / t - log_q[None, :]
    total = 0.0
    for i in range(len(q)):
        keep = (ids != ids[i]) | (np.arange(len(ids)) == i)
        row = logits[i][keep]
        total += np.log(np.exp(row - row.max()).sum()) + row.max() - logits[i, i]
    return total


@pytest.mark.parametrize("sampler", ["uniform", "popularity"])
def test_pooled_negatives_loss_equals_numpy(sampler: str) -> None:
    tf.keras.utils.set_random_seed(3)
    config = TRANSFORMER.model_copy(
        update={"negatives": "mixed", "sampled_negatives": 9, "negative_sampler": sampler}
    )
    model = TrainedModel.build(USERS, ITEMS, config)
    counts = np.arange(1, len(ITEMS) + 2, dtype=np.float64)  # OOV row first
    log_p = np.log(counts / counts.sum()).astype(np.float32)
    task = TwoTowerModel(model.query_tower, model.candidate_tower, config, log_p)
    items = np.array([3, 5, 5, 8], np.int64)  # a duplicate positive: an accidental hit
    cands, ids, log_q = task._add_pool(
        model.candidate_tower(items), tf.constant(items), tf.constant(log_p[items]), False
    )
    ids = ids.numpy()
    assert len(ids) == 4 + 9 and ids[4:].min() >= 1 and ids[4:].max() <= len(ITEMS)
    r = np.full(len(ids), 1 / len(ITEMS)) if sampler == "uniform" else np.exp(log_p[ids])
    expected_log_q = np.log(4 * np.exp(log_p[ids]) + 9 * r)
    np.testing.assert_allclose(log_q.numpy(), expected_log_q, rtol=1e-5)
    np.testing.assert_allclose(cands.numpy()[4:], model.candidate_tower(ids[4:]).numpy())
    q = model.query_tower(
        {
            "user_index": tf.constant([1, 2, 3, 4], tf.int64),
            "history_index": tf.constant([[1, 2, -1, -1, -1, -1]] * 4, tf.int64),
        }
    ).numpy()
    loss = in_batch_softmax_loss(q, cands, 0.1, log_q, ids).numpy()
    reference = _numpy_loss(q, cands.numpy(), ids, expected_log_q, 0.1)
    assert loss == pytest.approx(reference, rel=1e-4)


def test_popularity_pool_follows_the_item_distribution() -> None:
    p = np.array([0.0, 0.1, 0.2, 0.7])
    log_p = tf.constant(np.log(np.maximum(p, 1e-30)), tf.float32)
    draws = sample_pool(20000, log_p, 1, "popularity").numpy()
    share = np.bincount(draws, minlength=4)[1:] / len(draws)
    np.testing.assert_allclose(share, p[1:], atol=0.015)
    uniform = sample_pool(2000, log_p, 1, "uniform").numpy()
    assert uniform.min() == 1 and uniform.max() == 3


def test_full_catalog_loss_equals_numpy_cross_entropy() -> None:
    tf.keras.utils.set_random_seed(4)
    config = TRANSFORMER.model_copy(update={"negatives": "full"})
    model = TrainedModel.build(USERS, ITEMS, config)
    log_p = np.full(len(ITEMS) + 1, -np.log(len(ITEMS) + 1), np.float32)
    task = TwoTowerModel(model.query_tower, model.candidate_tower, config, log_p)
    features = {
        "user_index": tf.constant([1, 2, 3], tf.int64),
        "history_index": tf.constant([[4, 5, -1, -1, -1, -1]] * 3, tf.int64),
        "item_index": tf.constant([2, 6, 6], tf.int64),
        "item_log_prob": tf.constant(log_p[[2, 6, 6]]),
    }
    loss = task.compute_loss(features).numpy()
    q = model.query_tower({k: features[k] for k in ("user_index", "history_index")}).numpy()
    logits = q @ model.candidate_tower(tf.range(len(ITEMS) + 1, dtype=tf.int64)).numpy().T / 0.1
    top = logits.max(axis=1)
    lse = np.log(np.exp(logits - top[:, None]).sum(axis=1)) + top
    assert loss == pytest.approx(float((lse - logits[[0, 1, 2], [2, 6, 6]]).sum()), rel=1e-5)


def test_the_model_refuses_an_auto_setting_left_undecided() -> None:
    with pytest.raises(ValueError, match="user_embedding 'auto' must be resolved"):
        TrainedModel.build(USERS, ITEMS, ModelConfig(user_embedding="auto"))


@pytest.mark.parametrize("positions", ["absolute", "relative"])
def test_warm_start_copies_the_encoder_and_maps_item_rows(positions: str) -> None:
    tf.keras.utils.set_random_seed(5)
    base = TRANSFORMER.model_copy(update={"encoder_positions": positions})
    old = TrainedModel.build(USERS, ITEMS, base)
    longer = base.model_copy(update={"history_length": LENGTH + 2})
    new = TrainedModel.build(USERS, ["new", *ITEMS[::-1]], longer)
    if positions == "relative":  # a trained bias, so that copying it is visible
        for block in old.query_tower.encoder.blocks:
            block.attention.distance_bias.assign(tf.random.normal([1, LENGTH]))
    copied = warm_start(new, old)
    assert copied["items"] == len(ITEMS) and copied["encoder_positions"] == LENGTH
    enc, old_enc = new.query_tower.encoder, old.query_tower.encoder
    if positions == "absolute":
        np.testing.assert_array_equal(enc.positions.numpy()[-LENGTH:], old_enc.positions.numpy())
        for a, b in zip(enc.blocks[1].get_weights(), old_enc.blocks[1].get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
    # The same history of item ids gives the same vector (the positions it uses are mapped).
    history = [["i3", "i7", "i1"]]
    np.testing.assert_allclose(
        new.user_embeddings(["u2"], history), old.user_embeddings(["u2"], history), atol=1e-5
    )


def test_warm_start_copies_the_gru_and_skips_an_encoder_of_another_kind() -> None:
    tf.keras.utils.set_random_seed(8)
    old = TrainedModel.build(USERS, ITEMS, GRU)
    longer = GRU.model_copy(update={"history_length": LENGTH + 2})
    new = TrainedModel.build(USERS, ["new", *ITEMS[::-1]], longer)
    copied = warm_start(new, old)
    assert copied["items"] == len(ITEMS) and copied["encoder_positions"] == 0
    enc, old_enc = new.query_tower.encoder, old.query_tower.encoder
    for a, b in zip(
        [*enc.gru.get_weights(), *enc.norm.get_weights()],
        [*old_enc.gru.get_weights(), *old_enc.norm.get_weights()],
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    history = [["i3", "i7", "i1"]]
    np.testing.assert_allclose(
        new.user_embeddings(["u2"], history), old.user_embeddings(["u2"], history), atol=1e-5
    )
    # Across kinds the items still carry over and the new encoder keeps its fresh weights.
    transformer = TrainedModel.build(USERS, ITEMS, TRANSFORMER)
    for target, source in ((new, transformer), (transformer, old)):
        fresh = _own_weights(target.query_tower.encoder)
        copied = warm_start(target, source)
        assert copied["items"] == len(ITEMS) and copied["encoder_positions"] == 0
        for a, b in zip(_own_weights(target.query_tower.encoder), fresh, strict=True):
            np.testing.assert_array_equal(a, b)


def _own_weights(encoder: tf.keras.layers.Layer) -> list[np.ndarray]:
    """An encoder's weights but the item table it shares (warm start maps that by id)."""
    table = encoder.item_embedding.embeddings
    return [w.numpy() for w in encoder.weights if w is not table]


def test_without_a_user_table_the_query_is_the_history_alone() -> None:
    tf.keras.utils.set_random_seed(6)
    config = TRANSFORMER.model_copy(update={"user_embedding": False})
    model = TrainedModel.build(USERS, ITEMS, config)
    assert model.query_tower.embedding is None
    assert all(v.shape[0] != len(USERS) + 1 for v in model.query_tower.trainable_variables)
    history = ["i3", "i7", "i1"]
    vectors = model.user_embeddings(["u2", "u5", "nobody", "u2"], [history] * 3 + [["i4"]])
    np.testing.assert_allclose(vectors[0], vectors[1], atol=1e-6)
    np.testing.assert_allclose(vectors[0], vectors[2], atol=1e-6)  # a new user is served too
    assert np.abs(vectors[0] - vectors[3]).max() > 1e-3  # and the history still matters
    # Warm starts across the flag carry the item rows and skip the table one side lacks.
    with_users = TrainedModel.build(USERS, ITEMS, TRANSFORMER)
    for new, old in ((model, with_users), (with_users, model)):
        copied = warm_start(new, old)
        assert copied["items"] == len(ITEMS) and "users" not in copied


def test_query_vectors_are_encoded_in_row_chunks_bounded_by_the_history_size() -> None:
    wide = TRANSFORMER.model_copy(update={"history_length": 50, "embedding_dim": 64})
    rows = TrainedModel.build(USERS, ITEMS, wide).encode_rows()
    assert rows * 50 * 64 <= ENCODE_ELEMENTS < (rows + 1) * 50 * 64
    no_history = TRANSFORMER.model_copy(update={"history_length": 0, "query_encoder": "mean"})
    assert TrainedModel.build(USERS, ITEMS, no_history).encode_rows() == MAX_ENCODE_ROWS
    # Chunks change nothing: one row per call gives the one-call vectors.
    tf.keras.utils.set_random_seed(3)
    model = TrainedModel.build(USERS, ITEMS, TRANSFORMER)
    histories = [["i3", "i7", "i1"], [], ["i4"], ["i2", "i9"]]
    users = ["u1", "u2", "nobody", "u7"]
    whole = model.user_embeddings(users, histories, batch_size=len(users))
    np.testing.assert_allclose(model.user_embeddings(users, histories, 1), whole, atol=1e-6)
    np.testing.assert_allclose(model.user_embeddings(users, histories), whole, atol=1e-6)


def test_history_groups_collect_rows_by_the_slot_of_their_last_item() -> None:
    pad = -1
    history = np.array([[3, 4, pad], [pad, pad, pad], [5, pad, pad], [1, 2, pad], [7, 8, 9]])
    groups = history_groups(history, len(history))
    assert [(rows.tolist(), width) for rows, width in groups] == [
        ([1], 0),
        ([2], 1),
        ([0, 3], 2),
        ([4], 3),
    ]
    assert [(r.tolist(), w) for r, w in history_groups(None, 3)] == [([0, 1, 2], 0)]
    assert history_groups(np.zeros((0, 3), np.int64), 0) == []


@pytest.mark.parametrize(
    "update",
    [
        {"encoder_positions": "relative"},
        {"encoder_positions": "absolute"},
        {"encoder_positions": "relative", "history_mean": True},
        {"query_encoder": "gru"},
        {"query_encoder": "mean"},
    ],
)
def test_histories_trimmed_of_their_padding_encode_as_the_full_width(
    update: dict[str, object],
) -> None:
    """The grouped, trimmed encoding equals one tower call on the [n, history_length] matrix."""
    tf.keras.utils.set_random_seed(11)
    model = TrainedModel.build(USERS, ITEMS, TRANSFORMER.model_copy(update=update))
    rng = np.random.default_rng(0)
    counts = [0, 1, 2, 2, 3, LENGTH, LENGTH - 1, 4]
    history = np.full((len(counts), LENGTH), -1, np.int64)
    for row, count in enumerate(counts):
        history[row, :count] = rng.integers(1, len(ITEMS), count)
    users = np.arange(len(counts), dtype=np.int64) + 1
    full = model.query_tower({USER_INDEX: tf.constant(users), HISTORY_INDEX: tf.constant(history)})
    np.testing.assert_allclose(model.query_embeddings(users, history), full.numpy(), atol=1e-5)
    np.testing.assert_allclose(model.query_embeddings(users, history, 1), full.numpy(), atol=1e-5)


@pytest.mark.parametrize(
    ("encoder", "user_embedding"), [("transformer", True), ("transformer", False), ("gru", False)]
)
def test_saved_sequence_query_model_matches_in_memory_vectors(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path, encoder: str, user_embedding: bool
) -> None:
    config, workdir, data_dir = prepared
    raw = config.model_dump(mode="json")
    raw["model"].update(
        query_encoder=encoder,
        negatives="full",
        history_length=LENGTH,
        user_embedding=user_embedding,
    )
    raw["training"].update(epochs=1, refit="off")  # the saved towers are at stake, not a refit
    run_dir, result = stages.train(
        RecsysConfig.model_validate(raw), workdir, dt.date.fromisoformat(SMALL_DATE), data_dir
    )
    model = TrainedModel.load(run_dir / "model")
    assert model.config.query_encoder == encoder
    users = ["u1", "u2", "nobody", "u3"]
    histories = [model.items[:2], [], model.items[:9], ["unknown", model.items[5]]]
    expected = model.user_embeddings(users, histories)
    np.testing.assert_allclose(expected, result.model.user_embeddings(users, histories), atol=1e-5)
    export_savedmodels(model, tmp_path / "export", 1, top_k=5, warmup=False)
    width = max(len(h) for h in histories)
    padded = [h + [""] * (width - len(h)) for h in histories]
    script = (
        "import json, sys, tensorflow as tf\n"
        f"f = tf.saved_model.load({str(tmp_path / 'export/query/1')!r})"
        ".signatures['serving_default']\n"
        f"out = f(user_id=tf.constant({users!r}), history=tf.constant({padded!r}))\n"
        "print(json.dumps(out['embedding'].numpy().tolist()))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'recsys')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    vectors, project = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert project == []
    np.testing.assert_allclose(np.array(vectors), expected, atol=1e-5)
