"""Training engine: features, precision, checkpoints and resume, early stopping, warm start."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from conductor import stages
from recsys.core import schema
from recsys.core.config import ModelConfig, RecsysConfig, TrainingConfig, parse_config
from recsys.core.errors import ConfigError, OutOfMemoryError
from recsys.core.layout import DataFile, Workdir
from recsys.data_io import load_split
from recsys.model import (
    HISTORY_INDEX,
    PAD,
    ItemFeatures,
    TrainedModel,
    TwoTowerModel,
    warm_start,
)
from recsys.training import trainer
from recsys.training.dataset import in_memory_dataset, training_dataset
from tests.conftest import PLAIN_MODEL, SMALL, SMALL_DATE, build_model, plain_prepared

DATE = dt.date.fromisoformat(SMALL_DATE)
REPO = Path(__file__).resolve().parent.parent


def with_updates(config: RecsysConfig, **sections: dict) -> RecsysConfig:
    """A copy of `config` with some model/training keys replaced."""
    raw = config.model_dump(mode="json")
    for section, values in sections.items():
        raw[section].update(values)
    return parse_config(raw)


@pytest.fixture(scope="module")
def prepared(prepared: tuple[RecsysConfig, Workdir, Path]) -> tuple[RecsysConfig, Workdir, Path]:
    """SMALL's data, trained with the plain model: these tests check the training engine
    (cache, XLA, checkpoints and resume, early stopping, refit, warm start), not the model, and
    the default transformer would cost them minutes (XLA on CPU compiles it slowly)."""
    return plain_prepared(prepared)


def _model(data_dir: Path, config: ModelConfig) -> TrainedModel:
    return build_model(data_dir, config)


def test_history_batches_are_padded_index_matrices(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    config, _, data_dir = prepared
    model = _model(data_dir, config.model.model_copy(update={"history_length": 3}))
    batch = next(iter(training_dataset(data_dir, "train", model, 64)))
    history = batch[HISTORY_INDEX].numpy()
    assert history.shape == (64, 3) and history.dtype == np.int64
    assert ((history == PAD) | (history >= config.model.oov_buckets)).all()
    # Histories are left-aligned: padding only after the kept ids.
    assert not ((history[:, :-1] == PAD) & (history[:, 1:] != PAD)).any()


def test_same_seed_same_batches_when_deterministic(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    config, _, data_dir = prepared
    model = _model(data_dir, config.model)

    def first_items(seed: int) -> list[int]:
        ds = training_dataset(data_dir, "train", model, 32, 1000, seed, deterministic=True)
        return next(iter(ds))["item_index"].numpy().tolist()

    assert first_items(1) == first_items(1)
    assert first_items(1) != first_items(2)


def test_in_memory_batches_are_whole_split_permutations(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    """Held in memory, every epoch is a fresh permutation of the streamed split's examples
    (a full shuffle), reproducible with the seed, in batches of the streamed shapes."""
    config, _, data_dir = prepared
    model = _model(data_dir, config.model)

    def rows(batch: dict[str, tf.Tensor]) -> list[tuple[int, ...]]:
        columns = [batch[k].numpy() for k in ("user_index", "item_index", HISTORY_INDEX)]
        return [(u, i, *h) for u, i, h in zip(*columns, strict=True)]

    def epochs(ds: tf.data.Dataset) -> list[list[list[tuple[int, ...]]]]:
        return [[rows(b) for b in ds] for _ in range(2)]

    streamed = epochs(training_dataset(data_dir, "train", model, 64))[0]
    cached = epochs(in_memory_dataset(data_dir, "train", model, 64, True, 5))
    assert cached == epochs(in_memory_dataset(data_dir, "train", model, 64, True, 5))
    assert cached != epochs(in_memory_dataset(data_dir, "train", model, 64, True, 6))
    everything = sorted(r for b in streamed for r in b)
    for epoch in cached:
        assert [len(b) for b in epoch] == [len(b) for b in streamed]  # last batch partial
        assert sorted(r for b in epoch for r in b) == everything  # every example once
    assert cached[0] != cached[1]  # reshuffled every epoch
    dropped = in_memory_dataset(data_dir, "train", model, 64, True, 5, drop_remainder=True)
    assert dropped.element_spec["item_index"].shape == (64,)  # static, as replicas need
    assert len(list(dropped)) == len(everything) // 64
    batch = next(iter(in_memory_dataset(data_dir, "train", model, 64)))
    assert batch[HISTORY_INDEX].shape == (64, config.model.history_length)


def test_cache_and_jit_settings(prepared: tuple[RecsysConfig, Workdir, Path]) -> None:
    config, _, data_dir = prepared
    model = _model(data_dir, config.model)
    one = tf.distribute.get_strategy()
    small = {"train": 1000, "validation": 100}
    huge = {"train": 10**8, "validation": 0}  # ~18 GB of indices: streamed under auto
    assert trainer.use_cache("auto", small, model, one)
    assert not trainer.use_cache("auto", huge, model, one)
    assert trainer.use_cache("memory", huge, model, one)
    assert not trainer.use_cache("none", small, model, one)
    # One-pass windows select their trained positions at run time: XLA cannot compile that
    # (the auto rule: recsys.core.auto.jit_compile, tests/test_resolve.py).
    with pytest.raises(ConfigError, match=r"training\.input rows"):
        trainer.use_jit(TrainingConfig(jit_compile="on", input="sequences"))
    assert trainer.use_jit(TrainingConfig(jit_compile="on", input="rows"))


def test_xla_trains_the_same_model(prepared: tuple[RecsysConfig, Workdir, Path]) -> None:
    """The XLA-compiled step and the plain graph: same (in-memory) batches, same losses."""
    config, _, data_dir = prepared

    def fit(jit: str) -> trainer.TrainResult:
        cfg = with_updates(
            config, training={"epochs": 2, "jit_compile": jit, "cache": "memory", "input": "rows"}
        )
        return trainer.train(cfg, data_dir)

    fast, plain = fit("on"), fit("off")
    assert (fast.jit_compile, plain.jit_compile, fast.cached) == (True, False, True)
    np.testing.assert_allclose(fast.history["loss"], plain.history["loss"], rtol=1e-3)


@pytest.mark.parametrize("cache", ["memory", "none"])
def test_xla_with_determinism_repeats_the_same_run(
    prepared: tuple[RecsysConfig, Workdir, Path], cache: str
) -> None:
    """`jit_compile: on` + `deterministic: true`: two runs give the same losses and weights."""
    config, _, data_dir = prepared
    cfg = with_updates(
        config,
        training={
            "epochs": 2,
            "jit_compile": "on",
            "deterministic": True,
            "cache": cache,
            "input": "rows",
        },
    )
    first = trainer.train(cfg, data_dir)
    tf.keras.backend.clear_session()
    second = trainer.train(cfg, data_dir)
    assert first.jit_compile and second.jit_compile
    assert first.history["loss"] == second.history["loss"]
    np.testing.assert_array_equal(first.model.item_embeddings(), second.model.item_embeddings())


def test_blocked_loss_equals_the_tfrs_task() -> None:
    """recsys.losses: TFRS Retrieval's loss and gradients, in row blocks, extra negatives."""
    import tensorflow_recommenders as tfrs

    from recsys.losses import in_batch_softmax_loss

    rng = np.random.default_rng(3)
    n, m = 70, 90  # 20 extra candidates (another replica's rows)
    query = tf.Variable(rng.normal(size=(n, 8)).astype(np.float32))
    cands = tf.Variable(rng.normal(size=(m, 8)).astype(np.float32))
    ids = tf.constant(rng.integers(0, 15, m))  # many accidental hits
    log_q = tf.constant(np.log(rng.uniform(0.01, 0.2, m)).astype(np.float32))
    for temperature, logq, hits in [(1.0, False, False), (0.1, True, True), (0.05, False, True)]:
        task = tfrs.tasks.Retrieval(temperature=temperature, remove_accidental_hits=hits)
        with tf.GradientTape(persistent=True) as tape:
            want = task(
                query,
                cands,
                candidate_sampling_probability=tf.exp(log_q) if logq else None,
                candidate_ids=ids if hits else None,
                compute_metrics=False,
                compute_batch_metrics=False,
            )
            got = in_batch_softmax_loss(
                query, cands, temperature, log_q if logq else None, ids if hits else None, 16
            )
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5)
        grads = tape.gradient(got, [query, cands]), tape.gradient(want, [query, cands])
        for g, w in zip(*grads, strict=True):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-4)


def test_towers_without_normalisation(prepared: tuple[RecsysConfig, Workdir, Path]) -> None:
    """`model.normalize: false` (the TFRS tutorial's raw dot products), kept in model.json."""
    config, _, data_dir = prepared
    model = _model(data_dir, config.model.model_copy(update={"normalize": False}))
    assert not np.allclose(np.linalg.norm(model.item_embeddings(), axis=1), 1.0)
    normalised = _model(data_dir, config.model)
    np.testing.assert_allclose(np.linalg.norm(normalised.item_embeddings(), axis=1), 1.0, rtol=1e-5)


def test_item_features_from_parquet(tmp_path: Path) -> None:
    path = tmp_path / "item_features.parquet"
    pq.write_table(
        pa.table(
            {
                "item_id": ["a", "b", "c"],
                "train_count": [3, 2, 1],
                "genres": [["Drama", "Comedy"], ["Drama"], []],
                "title": ["Toy Story (1995)", "Toy Soldiers (1991)", None],
            }
        ),
        path,
    )
    features = ItemFeatures.from_parquet(path, ["a", "b", "c", "unknown"], max_title_tokens=4)
    # Tokens of a single item are dropped (another item id); order: frequency, then name.
    assert features.vocab == {"genres": ["Drama"], "title": ["toy"]}
    assert features.ids["genres"][:, 0].tolist() == [0, 0, PAD, PAD]
    assert features.ids["title"].shape == (4, 4)
    pq.write_table(pa.table({"item_id": ["a"], "train_count": [1]}), path)
    assert ItemFeatures.from_parquet(path, ["a"], 4).ids == {}  # columns absent: no features


def test_mixed_precision_trains_with_float32_outputs(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    """bfloat16 and float16 (emulated on CPU, slow: one epoch of 4 big batches), on the default
    model: on a recent GPU `precision: auto` trains the transformer in mixed_float16."""
    _, _, data_dir = prepared
    for precision in ("mixed_bfloat16", "mixed_float16"):
        training = {"precision": precision, "epochs": 1, "batch_size": 512, "refit": "off"}
        cfg = parse_config({**SMALL, "training": {**SMALL["training"], **training}})
        result = trainer.train(cfg, data_dir)
        assert result.precision == precision and result.model.config.query_encoder == "transformer"
        assert np.isfinite(result.history["loss"]).all()
        compute = result.model.candidate_tower.embedding.dtype_policy.compute_dtype
        assert compute == precision.removeprefix("mixed_")
        histories = [result.model.items[:2]] * 3
        vectors = result.model.user_embeddings(result.model.users[:3], histories)
        assert vectors.dtype == np.float32 and np.isfinite(vectors).all()
        assert result.model.item_embeddings().dtype == np.float32
    assert tf.keras.mixed_precision.global_policy().name == "float32"  # left as found


def test_float16_uses_loss_scaling() -> None:
    cfg = parse_config(SMALL).training
    assert isinstance(
        trainer.make_optimizer(cfg, "mixed_float16"), tf.keras.mixed_precision.LossScaleOptimizer
    )


def test_tf_config_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert trainer.tf_config_workers() == 0
    spec = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(spec))
    assert trainer.tf_config_workers() == 2
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ConfigError, match="TF_CONFIG"):
        trainer.tf_config_workers()


def test_out_of_memory_names_the_batch_size(
    prepared: tuple[RecsysConfig, Workdir, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _, data_dir = prepared

    def oom(*args: object, **kwargs: object) -> None:
        raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")

    monkeypatch.setattr(TwoTowerModel, "fit", oom)
    with pytest.raises(OutOfMemoryError, match=r"training.batch_size=128.*e\.g\. 64"):
        trainer.train(config, data_dir)


def _scripted_validation(monkeypatch: pytest.MonkeyPatch, values: list[float]) -> list[np.ndarray]:
    """Validation scores in the given order; the item table at each epoch's end is recorded."""
    scores = iter(values)
    snapshots: list[np.ndarray] = []

    def scripted(self: trainer.ValidationRecall) -> float:
        snapshots.append(self.trained.candidate_tower.embedding.embeddings.numpy().copy())
        return next(scores)

    monkeypatch.setattr(trainer.ValidationRecall, "score", scripted)
    return snapshots


def test_early_stopping_keeps_the_best_epoch(
    prepared: tuple[RecsysConfig, Workdir, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation recall 0.1, 0.3, 0.2, 0.2: stops after epoch 4 (patience 2), keeps epoch 2."""
    config, _, data_dir = prepared
    snapshots = _scripted_validation(monkeypatch, [0.1, 0.3, 0.2, 0.2, 0.9, 0.9])
    cfg = with_updates(config, training={"epochs": 6, "early_stopping_patience": 2})
    result = trainer.train(cfg, data_dir)
    assert result.history["val_recall_at_50"] == [0.1, 0.3, 0.2, 0.2]
    assert result.best_epoch == 2
    kept = result.model.candidate_tower.embedding.embeddings.numpy()
    np.testing.assert_array_equal(kept, snapshots[1])


def test_refit_trains_the_chosen_epochs_on_train_and_validation(
    prepared: tuple[RecsysConfig, Workdir, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Early stopping keeps epoch 2 of 4; the refit then runs 2 epochs over both splits."""
    config, _, data_dir = prepared
    snapshots = _scripted_validation(monkeypatch, [0.1, 0.3, 0.2, 0.2])
    epochs_logged: list[int] = []
    monkeypatch.setattr(
        trainer.EpochLogger, "on_epoch_end", lambda self, epoch, logs=None: epochs_logged.append(1)
    )
    cfg = with_updates(config, training={"epochs": 6, "early_stopping_patience": 2, "refit": True})
    result = trainer.train(cfg, data_dir)
    splits = json.loads((data_dir / DataFile.STATS).read_text())["splits"]
    assert result.best_epoch == 2 and result.refit_epochs == 2
    assert len(epochs_logged) == 4 + 2  # the first fit's 4 epochs, then the refit's 2
    assert result.refit_examples == 2 * (splits["train"] + splits["validation"])
    assert result.history["val_recall_at_50"] == [0.1, 0.3, 0.2, 0.2]  # the first fit's
    refit = result.model.candidate_tower.embedding.embeddings.numpy()
    assert not np.allclose(refit, snapshots[1])  # a new model, not the kept first fit
    assert result.refit_splits == ("train", "validation")
    assert result.evaluation_model is None  # the served refit never saw the test split


def test_the_progress_line_follows_the_refit_too(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    """The nightly's progress callback reports the first fit, then the refit with its own total."""
    import io

    from conductor.progress import KerasProgress

    config, _, data_dir = prepared
    stream = io.StringIO()
    cfg = with_updates(config, training={"epochs": 2, "refit": True})
    trainer.train(cfg, data_dir, callbacks=[KerasProgress(stream, interval=3600)])
    finals = [line for line in stream.getvalue().splitlines() if "epochs" in line]
    assert [line.split()[1] for line in finals] == ["train:", "refit:"], finals
    assert all("(100%)" in line and line.endswith("; 2 epochs") for line in finals), finals


def test_a_run_that_starts_at_its_refit_labels_it_refit(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    """A rerun finds its first fit kept in the backup folder: its only progress line is the
    refit's, not a `train` line for what is a refit."""
    import io

    from conductor.progress import KerasProgress

    config, _, data_dir = prepared
    cfg = with_updates(config, training={"epochs": 2, "refit": True})
    trainer.train(cfg, data_dir, backup_dir=tmp_path / "backup")
    assert (tmp_path / "backup" / "first_fit").is_dir()
    stream = io.StringIO()
    progress = KerasProgress(stream, interval=3600)
    trainer.train(cfg, data_dir, backup_dir=tmp_path / "backup", callbacks=[progress])
    finals = [line for line in stream.getvalue().splitlines() if "epochs" in line]
    assert [line.split()[1] for line in finals] == ["refit:"], finals


def test_refit_all_also_trains_on_test_and_keeps_the_first_fit_for_evaluation(
    prepared: tuple[RecsysConfig, Workdir, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`refit: all` serves a refit on every split; the first fit stays the evaluation model."""
    config, _, data_dir = prepared
    snapshots = _scripted_validation(monkeypatch, [0.1, 0.3, 0.2, 0.2])
    cfg = with_updates(config, training={"epochs": 6, "early_stopping_patience": 2, "refit": "all"})
    result = trainer.train(cfg, data_dir)
    splits = json.loads((data_dir / DataFile.STATS).read_text())["splits"]
    assert splits["test"] > 0
    assert result.refit_splits == ("train", "validation", "test")
    assert result.refit_examples == 2 * (splits["train"] + splits["validation"] + splits["test"])
    assert result.evaluation_model is not None
    first = result.evaluation_model.candidate_tower.embedding.embeddings.numpy()
    np.testing.assert_array_equal(first, snapshots[1])  # the first fit's kept epoch
    served = result.model.candidate_tower.embedding.embeddings.numpy()
    assert not np.allclose(served, first)


class _Rates(tf.keras.callbacks.Callback):
    """The optimizer's learning rate at the end of each epoch, per fit."""

    def __init__(self) -> None:
        super().__init__()
        self.fit = "train"
        self.rates: dict[str, list[float]] = {}

    def begin_fit(self, fit: str) -> None:
        self.fit = fit

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        rate = float(self.model.optimizer.learning_rate)
        self.rates.setdefault(self.fit, []).append(rate)


def _cosine(base: float, step: int, total: int) -> float:
    return base * (1 + math.cos(math.pi * min(step, total) / total)) / 2


def test_cosine_schedule_decays_over_the_configured_epochs_of_each_fit(
    prepared: tuple[RecsysConfig, Workdir, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epoch e of E ends at rate lr (1 + cos(pi (e n - 1) / (E n))) / 2, n the fit's steps per
    epoch (the last step's rate); the refit's n counts its own, larger, splits. `auto` is
    that on a log with more events per user than the history window, constant otherwise."""
    config, _, data_dir = prepared
    stats = json.loads((data_dir / DataFile.STATS).read_text())
    splits, users = stats["splits"], stats["users"]
    assert 5 < sum(splits.values()) / users <= 20  # dense for a window of 5, sparse for 20
    _scripted_validation(monkeypatch, [0.1, 0.3, 0.2, 0.2])
    base, epochs, batch = 0.02, 6, 256
    cfg = with_updates(
        config,
        model={"history_length": 5},
        training={
            "epochs": epochs, "early_stopping_patience": 2, "refit": "validation",
            "learning_rate": base, "learning_rate_schedule": "auto", "batch_size": batch,
        },
    )  # fmt: skip
    rates = _Rates()
    result = trainer.train(cfg, data_dir, callbacks=[rates])
    assert result.best_epoch == 2 and result.refit_epochs == 2
    for fit, rows, run in (
        ("train", splits["train"], 4),
        ("refit", splits["train"] + splits["validation"], 2),
    ):
        n = -(-rows // batch)
        expected = [_cosine(base, e * n - 1, epochs * n) for e in range(1, run + 1)]
        np.testing.assert_allclose(rates.rates[fit], expected, rtol=1e-5)
    constant = with_updates(cfg, model={"history_length": 20}, training={"refit": "off"})
    flat = _Rates()
    _scripted_validation(monkeypatch, [0.1, 0.3, 0.2, 0.2])
    trainer.train(constant, data_dir, callbacks=[flat])
    assert flat.rates["train"] == pytest.approx([base] * 4)


@pytest.mark.parametrize(
    ("given", "mode"), [(True, "validation"), (False, "off"), ("all", "all"), ("off", "off")]
)
def test_refit_setting_reads_old_booleans(given: object, mode: str) -> None:
    """Configs written before `refit: all` existed (true / false) keep their meaning."""
    assert parse_config({"training": {"refit": given}}).training.refit == mode


class Killed(Exception):
    """Stands in for a SIGKILL after an epoch's checkpoint was written."""


def test_early_stopping_state_survives_a_resume(
    prepared: tuple[RecsysConfig, Workdir, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Best epoch 2 (0.5) before the kill; after it 0.3, 0.2: stop at 5, keep epoch 2."""
    config, _, data_dir = prepared
    scores = iter([0.1, 0.5, 0.2, 0.3, 0.2, 0.9, 0.9, 0.9])
    snapshots: list[np.ndarray] = []

    def scripted(self: trainer.ValidationRecall) -> float:
        snapshots.append(self.trained.candidate_tower.embedding.embeddings.numpy().copy())
        return next(scores)

    def kill_after_epoch_3(self: trainer.EpochLogger, epoch: int, logs: object = None) -> None:
        if epoch == 2:  # runs after the epoch's backup: the resume starts at epoch 4
            raise Killed

    monkeypatch.setattr(trainer.ValidationRecall, "score", scripted)
    monkeypatch.setattr(trainer.EpochLogger, "on_epoch_end", kill_after_epoch_3)
    cfg = with_updates(config, training={"epochs": 8, "early_stopping_patience": 3})
    backup = tmp_path / "backup"
    with pytest.raises(Killed):
        trainer.train(cfg, data_dir, backup_dir=backup)
    state = json.loads((backup / "early_stopping" / "state.json").read_text())
    assert (state["best"], state["best_epoch"], state["wait"]) == (0.5, 1, 1)
    monkeypatch.undo()
    monkeypatch.setattr(trainer.ValidationRecall, "score", scripted)
    tf.keras.backend.clear_session()
    result = trainer.train(cfg, data_dir, backup_dir=backup)
    # Only epochs 4 and 5 ran after the resume; without the saved state the best would be
    # epoch 4 (0.3) and training would run to epoch 7.
    assert result.history["val_recall_at_50"] == [0.3, 0.2]
    assert result.best_epoch == 2
    kept = result.model.candidate_tower.embedding.embeddings.numpy()
    np.testing.assert_array_equal(kept, snapshots[1])
    assert not (backup / "early_stopping").exists()  # a finished run leaves no state behind


@pytest.mark.parametrize("kill", ["mid_epoch", "after_epoch"])
def test_steps_per_execution_with_step_checkpoints_resumes_exactly(
    prepared: tuple[RecsysConfig, Workdir, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    kill: str,
) -> None:
    """3 steps per call, a checkpoint every 4 steps (13 steps an epoch): backups after steps
    5 and 11 and at the epoch end, each recording the last step done; a resume continues
    after it: inside the epoch, or at the next epoch when killed after an epoch's end."""
    config, _, data_dir = prepared
    cfg = with_updates(
        config,
        training={"epochs": 3, "steps_per_execution": 3, "checkpoint_every_steps": 4},
    )
    backups: list[tuple[int, int]] = []
    backup_call = trainer.BackupEveryStepsAndEpoch._backup

    def recording_backup(
        self: trainer.BackupEveryStepsAndEpoch, epoch: int, batch: int = 0
    ) -> None:
        backups.append((epoch, int(self._training_state._ckpt_saved_batch.numpy())))
        backup_call(self, epoch, batch)

    class Steps(tf.keras.callbacks.Callback):
        """(epoch, first step) of every call; raises Killed where asked (after the backup)."""

        def __init__(self, kill_at: tuple[int, int] | None) -> None:
            super().__init__()
            self.kill_at, self.calls, self.epoch = kill_at, [], 0

        def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
            self.epoch = epoch

        def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
            self.calls.append((self.epoch, batch))

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            if (self.epoch, batch) == self.kill_at:
                raise Killed

    def kill_after_epoch_1(self: trainer.EpochLogger, epoch: int, logs: object = None) -> None:
        if epoch == 0:  # after the epoch's backup
            raise Killed

    monkeypatch.setattr(trainer.BackupEveryStepsAndEpoch, "_backup", recording_backup)
    if kill == "after_epoch":
        monkeypatch.setattr(trainer.EpochLogger, "on_epoch_end", kill_after_epoch_1)
    first = Steps((1, 8) if kill == "mid_epoch" else None)
    backup = tmp_path / "backup"
    with pytest.raises(Killed):
        trainer.train(cfg, data_dir, backup_dir=backup, callbacks=[first])
    assert first.calls[:5] == [(0, 0), (0, 3), (0, 6), (0, 9), (0, 12)]
    assert backups[:3] == [(0, 5), (0, 11), (0, 12)]  # 12: the epoch's last step
    tf.keras.backend.clear_session()
    monkeypatch.setattr(trainer.EpochLogger, "on_epoch_end", lambda *args, **kwargs: None)
    resumed = Steps(None)
    result = trainer.train(cfg, data_dir, backup_dir=backup, callbacks=[resumed])
    if kill == "mid_epoch":  # killed after step 8 of epoch 2, last backup after step 5
        assert backups[3] == (1, 5)
        assert resumed.calls[:3] == [(1, 6), (1, 9), (1, 12)]
        assert len(result.history["loss"]) == 2
    else:  # the finished epoch 1 is not trained (nor validated) again
        assert resumed.calls[0] == (1, 0)
        assert len(result.history["loss"]) == 2


def test_is_chief_follows_tf_config(monkeypatch: pytest.MonkeyPatch) -> None:
    def task(kind: str, index: int, chief: bool = False) -> None:
        cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
        if chief:
            cluster["chief"] = ["127.0.0.1:3"]
        spec = {"cluster": cluster, "task": {"type": kind, "index": index}}
        monkeypatch.setenv("TF_CONFIG", json.dumps(spec))

    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert trainer.is_chief()
    task("worker", 0)
    assert trainer.is_chief()
    task("worker", 1)
    assert not trainer.is_chief()
    # Single-process layouts write their own files whatever TF_CONFIG says.
    assert trainer.is_chief(tf.distribute.get_strategy())
    task("worker", 0, chief=True)  # a cluster with a chief: worker 0 is not it
    assert not trainer.is_chief()
    task("chief", 0, chief=True)
    assert trainer.is_chief()
    assert trainer.write_dir(tmp := Path("/nonexistent/run"), chief=True) == tmp
    temp = trainer.write_dir(Path("/nonexistent/run"), chief=False)
    assert temp.is_dir() and temp.name.startswith("run-workertemp-")
    temp.rmdir()


def test_validation_recall_is_exact(prepared: tuple[RecsysConfig, Workdir, Path]) -> None:
    config, _, data_dir = prepared
    result = trainer.train(with_updates(config, training={"epochs": 2}), data_dir)
    recalls = result.history["val_recall_at_50"]
    assert len(recalls) == 2 and all(0.0 <= r <= 1.0 for r in recalls)
    assert recalls[-1] > 0.2  # far above chance (50 of ~80 items minus the user's own)


def test_warm_start_maps_rows_by_id(prepared: tuple[RecsysConfig, Workdir, Path]) -> None:
    config = prepared[0]
    tf.keras.utils.set_random_seed(0)
    old = TrainedModel.build(["a", "b", "c"], ["x", "y", "z"], config.model)
    new = TrainedModel.build(["c", "new", "a"], ["z", "w"], config.model)
    fresh_user = new.query_tower.embedding.embeddings.numpy()[2].copy()  # "new"
    copied = warm_start(new, old)
    assert copied["users"] == 2 and copied["items"] == 1
    oov = config.model.oov_buckets
    old_users = old.query_tower.embedding.embeddings.numpy()
    new_users = new.query_tower.embedding.embeddings.numpy()
    np.testing.assert_array_equal(new_users[oov + 0], old_users[oov + 2])  # "c"
    np.testing.assert_array_equal(new_users[oov + 2], old_users[oov + 0])  # "a"
    np.testing.assert_array_equal(new_users[oov + 1], fresh_user)  # "new" keeps its fresh row
    np.testing.assert_array_equal(new_users[:oov], old_users[:oov])  # OOV buckets carried over
    old_items = old.candidate_tower.embedding.embeddings.numpy()
    new_items = new.candidate_tower.embedding.embeddings.numpy()
    np.testing.assert_array_equal(new_items[oov + 0], old_items[oov + 2])  # "z"
    wider = config.model.model_copy(update={"embedding_dim": config.model.embedding_dim * 2})
    with pytest.raises(ConfigError, match="warm_start_from"):
        warm_start(TrainedModel.build(["a"], ["x"], wider), old)


def test_warm_start_keeps_quality_with_fewer_epochs(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    """A champion trained 6 epochs; 1 warm epoch on a changed vocabulary beats 1 cold epoch."""
    config, workdir, data_dir = prepared
    champion_run, champion = stages.train(
        with_updates(config, training={"epochs": 6}), workdir, DATE
    )
    # The previous vocabulary differs: drop some users and items, add ids the data lacks.
    old = TrainedModel.load(champion_run / "model")
    old.users = [*old.users[5:], "gone-user"]
    old.items = [*old.items[3:], "gone-item"]
    rebuilt = TrainedModel.build(old.users, old.items, old.config, old.item_features)
    warm_start(rebuilt, TrainedModel.load(champion_run / "model"))
    rebuilt.save(tmp_path / "previous")

    def validation_recall(**training: object) -> float:
        cfg = with_updates(config, training={"epochs": 1, **training})
        return trainer.train(cfg, data_dir).history["val_recall_at_50"][-1]

    cold = validation_recall()
    warm = validation_recall(warm_start_from=str(tmp_path / "previous"))
    best = max(champion.history["val_recall_at_50"])
    assert warm > cold
    assert warm >= 0.9 * best


@pytest.mark.slow
def test_killed_run_resumes_where_it_stopped(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    """SIGKILL mid-training, start again with the same backup folder: it continues."""
    config, _, data_dir = prepared
    epochs = 12
    cfg = with_updates(config, training={"epochs": epochs, "checkpoint_every_steps": 5})
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    child = textwrap.dedent(
        """
        import json, logging, sys
        import recsys
        from pathlib import Path
        from recsys.core.config import RecsysConfig
        from recsys.training.trainer import train
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        config = RecsysConfig.model_validate_json(Path(sys.argv[1]).read_text())
        result = train(config, Path(sys.argv[2]), backup_dir=Path(sys.argv[3]))
        print("RESULT " + json.dumps(result.history), flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        "-c",
        child,
        *(str(p) for p in (tmp_path / "config.json", data_dir, tmp_path / "backup")),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    done = 0
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if line.startswith("epoch "):
            done = int(line.split()[1].split("/")[0])
        if done >= 3 or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert done >= 3, "the child never reached epoch 3"
    assert any((tmp_path / "backup").rglob("*.index")), "no checkpoint was written"
    rerun = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    history = json.loads(rerun.stdout.split("RESULT ", 1)[1])
    first_epoch = int(
        next(ln for ln in rerun.stdout.splitlines() if ln.startswith("epoch "))
        .split()[1]
        .split("/")[0]
    )
    assert first_epoch > done  # nothing finished before the kill was trained again
    assert len(history["loss"]) == epochs - first_epoch + 1
    assert not (tmp_path / "backup").exists() or not any((tmp_path / "backup").rglob("*.index"))


@pytest.mark.slow
def test_run_killed_during_the_refit_keeps_its_first_fit_and_resumes_the_refit(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    """SIGKILL after the refit's first epoch: the rerun trains neither the first fit again
    nor the refit's finished epoch."""
    config, _, data_dir = prepared
    cfg = with_updates(config, training={"epochs": 4, "refit": "all"})
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    child = textwrap.dedent(
        """
        import json, logging, sys
        import recsys
        from pathlib import Path
        from recsys.core.config import RecsysConfig
        from recsys.training.trainer import train
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        config = RecsysConfig.model_validate_json(Path(sys.argv[1]).read_text())
        result = train(config, Path(sys.argv[2]), backup_dir=Path(sys.argv[3]))
        print("RESULT " + json.dumps([result.history, result.refit_epochs]), flush=True)
        print("EVAL", result.evaluation_model is not None, flush=True)
        """
    )
    backup = tmp_path / "backup"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-c", child, str(tmp_path / "config.json"), str(data_dir), str(backup)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    refit_checkpoint = backup / trainer.REFIT_BACKUP / "chief" / "checkpoint"
    while not refit_checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert refit_checkpoint.exists(), "the child never wrote a refit checkpoint"
    assert (backup / "first_fit" / "result.json").is_file()
    rerun = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = rerun.stdout.splitlines()
    assert any("the first fit ended before the interruption" in ln for ln in lines)
    refit_at = next(i for i, ln in enumerate(lines) if ln.startswith("refit: 4 epoch"))
    assert not [ln for ln in lines[:refit_at] if ln.startswith("epoch ")]  # no first fit again
    resumed = [
        int(ln.split()[1].split("/")[0]) for ln in lines[refit_at:] if ln.startswith("epoch ")
    ]
    assert resumed and resumed[0] > 1 and resumed[-1] == 4, resumed
    history, refit_epochs = json.loads(rerun.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert len(history["loss"]) == 4 and refit_epochs == 4  # the kept first fit's record
    assert "EVAL True" in rerun.stdout  # refit all: the kept first fit is the evaluation model


def test_models_saved_by_the_first_ids_only_version_still_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A champion saved before history and item features existed loads with both off."""
    import importlib.util

    source = subprocess.run(
        ["git", "show", "fffda9c:recsys/model.py"], capture_output=True, text=True, cwd=REPO
    )
    if source.returncode != 0:
        pytest.skip("the first model version is not in this checkout's git history")
    # The old module's own imports follow the move into recsys.core; its code is unchanged.
    old_source = source.stdout.replace("from recsys.config ", "from recsys.core.config ")
    old_source = old_source.replace("from recsys.errors ", "from recsys.core.errors ")
    (tmp_path / "old_model.py").write_text(old_source)
    spec = importlib.util.spec_from_file_location("old_model", tmp_path / "old_model.py")
    old_module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    monkeypatch.setitem(sys.modules, "old_model", old_module)  # dataclasses look it up
    spec.loader.exec_module(old_module)
    old_config = json.loads(
        ModelConfig(embedding_dim=8, hidden_dims=[4], **PLAIN_MODEL).model_dump_json()
    )
    # Keys the first version did not write (later ones migrate to what it trained).
    for key in ("history_length", "share_item_embeddings", "item_features", "max_title_tokens"):
        old_config.pop(key)
    for key in PLAIN_MODEL:
        old_config.pop(key)
    old_config.pop("num_hard_negatives")
    old = old_module.TrainedModel.build(["a", "b"], ["x", "y", "z"], ModelConfig(**old_config))
    old.save(tmp_path / "model")
    (tmp_path / "model" / "model.json").write_text(json.dumps(old_config))
    loaded = TrainedModel.load(tmp_path / "model")
    assert loaded.config.history_length == 0 and not loaded.config.item_features
    np.testing.assert_allclose(loaded.item_embeddings(), old.item_embeddings(), atol=1e-6)
    np.testing.assert_allclose(
        loaded.user_embeddings(["a", "new"]), old.user_embeddings(["a", "new"]), atol=1e-6
    )


def test_dense_log_settings_apply_only_to_a_log_that_is_dense(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    """The rule's settings train the model on a log at its threshold, and are in train.json."""
    config, workdir, data_dir = prepared
    stats = json.loads((data_dir / DataFile.STATS).read_text())
    per_user = sum(stats["splits"].values()) / stats["users"]
    settings = {"model.embedding_dim": 8, "training.learning_rate": 0.02, "training.epochs": 1}
    raw = config.model_dump(mode="json")
    raw["dense_log"] = {"min_events_per_user": per_user, "settings": settings}
    dense = parse_config(raw)
    run_dir, result = stages.train(dense, workdir, DATE, data_dir=data_dir)
    assert result.model.config.embedding_dim == 8 and len(result.history["loss"]) == 1
    assert result.dense_log_settings == settings
    assert json.loads((run_dir / "train.json").read_text())["dense_log_settings"] == settings
    # The run's config.yaml is the config as given: the rule, not its outcome.
    assert "dense_log" in (run_dir / "config.yaml").read_text()

    raw["dense_log"]["min_events_per_user"] = per_user + 0.1
    result = trainer.train(parse_config(raw), data_dir)
    assert result.model.config.embedding_dim == 16 and len(result.history["loss"]) == 2
    assert result.dense_log_settings == {}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"model.embeding_dim": 8}, "dense_log.settings key 'model.embeding_dim': model has no"),
        ({"data.path": "x"}, "must be model.<setting> or training.<setting>"),
        ({"training.learning_rate": -1}, "training.learning_rate: value -1 is invalid"),
        ({"model.history_length": 50}, "raise preprocess.history_length"),
    ],
)
def test_dense_log_settings_are_checked_when_the_config_loads(
    settings: dict[str, object], message: str
) -> None:
    raw = {**SMALL, "dense_log": {"min_events_per_user": 30, "settings": settings}}
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_longer_stored_histories_train_the_same_model(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    """Histories stored longer than the model reads (a config whose `dense_log` rule has a
    longer window writes them for every log) train exactly the model 20-item files train."""
    config, _, data_dir = prepared
    raw = config.model_dump(mode="json")
    raw["preprocess"]["history_length"] = config.model.history_length + 30
    longer = parse_config(raw)
    long_dir, _ = stages.preprocess(longer, Workdir(tmp_path / "work"), DATE)
    histories = load_split(long_dir, "train", columns=[schema.HISTORY])[schema.HISTORY]
    assert max(len(h) for h in histories) > config.model.history_length  # the case at stake
    short = trainer.train(with_updates(config, training={"epochs": 1}), data_dir)
    long = trainer.train(with_updates(longer, training={"epochs": 1}), long_dir)
    for tower in ("query_tower", "candidate_tower"):
        weights = [getattr(r.model, tower).get_weights() for r in (short, long)]
        assert weights[0]
        for a, b in zip(*weights, strict=True):
            np.testing.assert_array_equal(a, b)
