"""Trainer and model on small generated data preprocessed by the real Beam job."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pytest

from conductor import stages
from recsys.core.config import RecsysConfig
from recsys.core.layout import Workdir
from recsys.data_io import load_split
from recsys.model import TrainedModel
from recsys.training.dataset import item_log_probabilities, training_dataset
from tests.conftest import SMALL_DATE, build_model

DATE = dt.date.fromisoformat(SMALL_DATE)


def test_dataset_batches_are_model_indices(prepared: tuple[RecsysConfig, Workdir, Path]) -> None:
    config, _, data_dir = prepared
    model = build_model(data_dir, config.model)
    batch = next(iter(training_dataset(data_dir, "train", model, 64)))
    oov = config.model.oov_buckets
    assert batch["user_index"].shape == (64,)
    # Every training id is in the vocabulary: no OOV index appears in the train split.
    assert int(batch["user_index"].numpy().min()) >= oov
    assert int(batch["item_index"].numpy().min()) >= oov
    log_q = item_log_probabilities(data_dir, model)
    assert np.exp(log_q).sum() == pytest.approx(1.0, rel=1e-5)
    # The most frequent item (first in the vocabulary) has the highest sampling probability.
    assert int(np.argmax(log_q)) == oov


def test_training_lowers_loss_and_round_trips(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    config, workdir, _ = prepared
    config = config.model_copy(
        update={"training": config.training.model_copy(update={"epochs": 4})}
    )
    run_dir, result = stages.train(config, workdir, DATE)
    loss = result.history["loss"]
    assert len(loss) == 4 and all(np.isfinite(loss))
    assert loss[-1] < loss[0]
    assert "val_loss" in result.history
    reloaded = TrainedModel.load(run_dir / "model")
    np.testing.assert_allclose(reloaded.item_embeddings(), result.model.item_embeddings())
    # The default model on SMALL's sparse log has no user table: the query is the history.
    histories = [reloaded.items[:3], reloaded.items[3:5]]
    vectors = reloaded.user_embeddings(["u1", "never-seen-user"], histories)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)


def test_evaluate_writes_metrics_and_per_user_values(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    config, workdir, data_dir = prepared
    stages.train(config, workdir, DATE)
    run_dir, report = stages.evaluate(config, workdir, DATE)
    test_rows = len(load_split(data_dir, "test")["user_id"])
    assert report.model["eval_users"] == test_rows > 0
    for name in ("recall_at_10", "recall_at_50", "ndcg_at_10", "mrr_at_100", "coverage_at_10"):
        assert 0.0 <= report.model[name] <= 1.0
        assert name in report.baselines["popularity"]
    import pyarrow.parquet as pq

    per_user = pq.read_table(run_dir / "per_user_eval.parquet")
    assert per_user.num_rows == test_rows
    assert np.mean(per_user["recall_at_10"].to_numpy()) == pytest.approx(
        report.model["recall_at_10"]
    )


def test_refit_all_run_serves_the_refit_and_evaluates_the_first_fit(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    """The test split reaches the served model only: metrics.json scores `eval_model`."""
    from recsys.model_evaluation import evaluate_model

    config, workdir, data_dir = prepared
    training = config.training.model_copy(update={"refit": "all", "epochs": 1})
    config = config.model_copy(update={"training": training})
    run_dir, _ = stages.train(config, workdir, DATE)
    assert run_dir is not None and (run_dir / "eval_model").is_dir()
    served, first = TrainedModel.load(run_dir / "model"), TrainedModel.load(run_dir / "eval_model")
    assert not np.allclose(served.item_embeddings(), first.item_embeddings())
    _, report = stages.evaluate(config, workdir, DATE, run_dir.name)
    assert report.evaluated_model == "eval_model"
    _, of_first = evaluate_model(config, run_dir / "eval_model", data_dir)
    _, of_served = evaluate_model(config, run_dir / "model", data_dir)
    assert report.model["recall_at_50"] == pytest.approx(of_first.metrics["recall_at_50"])
    # The served model trained on these very test items: it must not be what is reported.
    assert of_served.metrics["recall_at_50"] != pytest.approx(of_first.metrics["recall_at_50"])
