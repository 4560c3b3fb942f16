"""The nightly's classic baseline: implicit ALS chosen on validation, scored like the model.

The search runs on hand-made per-user sequences (no TensorFlow); the evaluate stage on SMALL's
log preprocessed by the real Beam job and a plain model trained one epoch.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from conductor import commands, stages
from recsys import als_baseline
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.layout import RunFile, Workdir
from recsys.core.records import read_metrics
from recsys.data_io import Sequences
from tests.conftest import SMALL, SMALL_DATE, plain, plain_prepared

DATE = dt.date.fromisoformat(SMALL_DATE)


@pytest.fixture(scope="module")
def prepared(prepared: tuple[RecsysConfig, Workdir, Path]) -> tuple[RecsysConfig, Workdir, Path]:
    """SMALL's data with the plain model: these tests check the baseline, not the model."""
    return plain_prepared(prepared)


def clustered_sequences(users: int = 120, items: int = 60, length: int = 12) -> Sequences:
    """Users in 4 taste groups, each drawing mostly from its own quarter of the catalog; each
    user's last position is the test one, the one before it the validation one."""
    rng = np.random.default_rng(7)
    quarter = items // 4
    seqs = []
    for u in range(users):
        own = np.arange(quarter) + (u % 4) * quarter
        pool = np.concatenate([own, rng.choice(items, 4, replace=False)])
        seqs.append(rng.choice(np.unique(pool), length, replace=False))
    splits = np.tile(np.array([0] * (length - 2) + [1, 2], np.int8), users)
    offsets = np.arange(users + 1, dtype=np.int64) * length
    return Sequences([f"u{u}" for u in range(users)], offsets, np.concatenate(seqs), splits)


def small_grid(**changes: Any) -> RecsysConfig:
    """SMALL with a 2 x 2 x 2 ALS grid of few factors (milliseconds per fit)."""
    baseline = {"factors": [4, 8], "regularization": [0.1, 10.0], "alpha": [1.0, 10.0]}
    evaluation = {**SMALL["evaluation"], "classic_baseline": {**baseline, **changes}}
    return parse_config({**plain(SMALL), "evaluation": evaluation})


def test_the_choice_reads_no_test_position() -> None:
    sequences = clustered_sequences()
    evaluation = small_grid().evaluation
    chosen = als_baseline.choose(sequences, 60, evaluation, "ndcg_at_10")
    assert len(chosen.trials) == 8 and not chosen.budget_exhausted
    assert len({t.validation for t in chosen.trials}) > 1  # the settings differ on validation
    # Every test position replaced by another item: not one validation score changes.
    test = sequences.splits == 2
    items = sequences.items.copy()
    items[test] = (items[test] + 29) % 60
    other = als_baseline.choose(
        dataclasses.replace(sequences, items=items), 60, evaluation, "ndcg_at_10"
    )
    assert [(t.setting, t.validation) for t in other.trials] == [
        (t.setting, t.validation) for t in chosen.trials
    ]
    assert other.best.setting == chosen.best.setting


def test_matrices_hold_only_the_splits_asked_for() -> None:
    sequences = clustered_sequences(users=5, items=60, length=12)
    train = als_baseline.interactions(sequences, 60, "train")
    both = als_baseline.interactions(sequences, 60, "validation")
    assert train.nnz == 5 * 10 and both.nnz == 5 * 11
    rows = sequences.user_of_position()
    for split, matrix in ((1, train), (2, train), (2, both)):
        held = sequences.splits == split
        assert not np.asarray(matrix[rows[held], sequences.items[held]]).any()


def test_a_spent_budget_keeps_the_best_so_far() -> None:
    sequences = clustered_sequences()
    evaluation = small_grid(max_seconds=1e-6).evaluation
    chosen = als_baseline.choose(sequences, 60, evaluation, "ndcg_at_10")
    # The first setting always runs; then the budget is spent and the grid stops.
    assert len(chosen.trials) == 1 and chosen.budget_exhausted and chosen.grid_size == 8
    assert chosen.best.setting == als_baseline.AlsSetting(4, 0.1, 1.0)


def test_without_validation_positions_nothing_is_fitted_to_choose() -> None:
    sequences = clustered_sequences()
    splits = np.where(sequences.splits == 1, 0, sequences.splits).astype(np.int8)
    chosen = als_baseline.choose(
        dataclasses.replace(sequences, splits=splits), 60, small_grid().evaluation, "ndcg_at_10"
    )
    (trial,) = chosen.trials
    assert np.isnan(trial.validation) and trial.seconds == 0 and not chosen.budget_exhausted
    assert chosen.best.setting == als_baseline.AlsSetting(4, 0.1, 1.0)


# --- the evaluate stage ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(prepared: tuple[RecsysConfig, Workdir, Path]) -> tuple[Workdir, Path]:
    """A plain model trained one epoch on SMALL's log: (workdir, run folder)."""
    config, workdir, _ = prepared
    training = config.training.model_copy(update={"epochs": 1})
    run_dir, _ = stages.train(config.model_copy(update={"training": training}), workdir, DATE)
    assert run_dir is not None
    return workdir, run_dir


def test_metrics_json_carries_als_beside_the_model(
    trained: tuple[Workdir, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    workdir, run_dir = trained
    config = small_grid()
    _, report = stages.evaluate(config, workdir, DATE, run_dir.name)
    metric = config.gate.primary_metric
    als = report.als
    assert als is not None and als.metric == metric == "recall_at_50"
    assert set(report.baselines) == {"popularity", "als"}
    assert set(report.intervals) == {"model", "popularity", "als"}
    assert report.baselines["als"]["eval_users"] == report.model["eval_users"]
    # Chosen on validation: the best of the grid's validation scores, all recorded.
    assert als.grid_size == len(als.trials) == 8 and not als.budget_exhausted
    assert als.validation == max(t.validation for t in als.trials)
    best = next(t for t in als.trials if t.validation == als.validation)
    assert (als.factors, als.regularization, als.alpha) == (
        best.factors,
        best.regularization,
        best.alpha,
    )
    assert als.seconds >= sum(t.seconds for t in als.trials) > 0
    # Paired on the model's own test users: the per-user mean difference is the difference
    # of the two reported means, and the interval brackets it.
    c = als.comparison
    assert c.users == report.model["eval_users"]
    assert c.model == pytest.approx(report.model[metric])
    assert c.baseline == pytest.approx(report.baselines["als"][metric])
    assert c.delta == pytest.approx(c.model - c.baseline)
    assert c.ci_low <= c.delta <= c.ci_high and c.confidence == 0.95
    per_user = pq.read_table(run_dir / RunFile.PER_USER_EVAL)
    assert set(per_user.column_names) == {
        "user_id", "rank", "recall_at_10", "recall_at_50", "ndcg_at_10", "mrr_at_100",
    }  # fmt: skip  # the model's own, as before: the gate reads them
    assert read_metrics(run_dir) == report
    commands._print_metrics(report)  # `recsys evaluate` and the nightly's report
    printed = capsys.readouterr().out
    assert c.line("ALS") in printed and "ALS setting (chosen on validation)" in printed
    assert ("ALS beat the model" in printed) == (c.delta < 0)


def test_a_spent_budget_is_recorded(trained: tuple[Workdir, Path]) -> None:
    workdir, run_dir = trained
    _, report = stages.evaluate(small_grid(max_seconds=1e-6), workdir, DATE, run_dir.name)
    assert report.als is not None
    assert report.als.budget_exhausted and len(report.als.trials) == 1
    assert (report.als.factors, report.als.regularization, report.als.alpha) == (4, 0.1, 1.0)
    assert "stopped by max_seconds" in report.als.settings()


def test_disabled_writes_what_it_wrote_before(trained: tuple[Workdir, Path]) -> None:
    workdir, run_dir = trained
    _, report = stages.evaluate(small_grid(enabled=False), workdir, DATE, run_dir.name)
    assert report.als is None and set(report.baselines) == {"popularity"}
    written = json.loads((run_dir / RunFile.METRICS).read_text())
    assert "als" not in written and set(written["intervals"]) == {"model", "popularity"}
