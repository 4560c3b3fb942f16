"""The step budget and the sampled evaluation of a real (small) training run."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import tensorflow as tf

from conductor import stages
from recsys.core.config import RecsysConfig
from recsys.core.layout import Workdir
from recsys.training.trainer import train
from tests.conftest import SMALL_DATE, plain_prepared


@pytest.fixture(scope="module")
def prepared(prepared: tuple[RecsysConfig, Workdir, Path]) -> tuple[RecsysConfig, Workdir, Path]:
    """SMALL's data with the plain model (conftest.PLAIN_MODEL): these tests check the step
    budget and sampled evaluation, not the model (a refit would add its own steps)."""
    return plain_prepared(prepared)


class _Steps(tf.keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.train, self.test = 0, 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.train += 1

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.test += 1


def test_step_budget_caps_epochs_and_sampled_evaluation_reports_intervals(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    config, workdir, data_dir = prepared
    update = {
        "training": config.training.model_copy(
            update={"max_steps_per_epoch": 2, "batch_size": 16, "epochs": 2}
        ),
        "evaluation": config.evaluation.model_copy(update={"sample_users": 40}),
    }
    config = config.model_copy(update=update)
    steps = _Steps()
    result = train(config, data_dir, callbacks=[steps])
    assert steps.train == 4 and steps.test == 4  # 2 epochs x 2 train and 2 validation steps
    # Examples are the positions the capped steps trained (windows of about 16 positions).
    assert 2 * 2 * 8 <= result.examples <= 2 * 2 * 32
    rows = train(
        config.model_copy(
            update={"training": config.training.model_copy(update={"input": "rows"})}
        ),
        data_dir,
    )
    assert rows.examples == 2 * 2 * 16
    run_dir, _ = stages.train(config, workdir, dt.date.fromisoformat(SMALL_DATE), data_dir)
    _, report = stages.evaluate(config, workdir, dt.date.fromisoformat(SMALL_DATE), run_dir.name)
    population = json.loads((data_dir / "stats.json").read_text())["splits"]["test"]
    assert (report.sample.users, report.sample.of) == (40, population) and population > 40
    lo, hi = report.intervals["model"]["recall_at_10"]
    assert lo < report.model["recall_at_10"] < hi
    assert report.model["eval_users"] == 40
