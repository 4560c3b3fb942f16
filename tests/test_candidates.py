"""`training.candidates`: first fits of a few settings, the best on validation kept.

The config's own settings train at a learning rate of 1e-6 (its random initial towers, in
effect); one candidate trains at 0.05 with another embedding width, one at 1e-6 again. The
trained candidate must win on validation, be the model the run keeps (its width, its settings
in the resolved record), and an interrupted run must not train the finished fits again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import yaml
from mlflow import MlflowClient

from conductor import cli
from recsys.core.config import RecsysConfig, parse_config, set_values
from recsys.core.errors import ConfigError
from recsys.core.layout import RunFile, Workdir
from recsys.core.records import read_train
from recsys.training.candidates import CandidateTrial, chosen
from recsys.training.trainer import train
from tests.conftest import SMALL, SMALL_DATE, plain
from tests.mlflow_server import MlflowServer

GOOD = {"training.learning_rate": 0.05, "model.embedding_dim": 12}
RANDOM = {"training.learning_rate": 1e-6, "model.embedding_dim": 6}


def _raw() -> dict[str, Any]:
    base = plain(SMALL)
    training = {**base["training"], "epochs": 3, "learning_rate": 1e-6, "refit": "all"}
    return {**base, "training": {**training, "candidates": [GOOD, RANDOM]}}


class _FitCounter(tf.keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.fits = 0

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        self.fits += 1


@pytest.mark.parametrize(
    ("candidate", "message"),
    [
        ({}, "sets nothing"),
        ({"training.seed": 3}, "cannot differ between candidates"),
        ({"training.early_stopping_metric": "ndcg_at_10"}, "cannot differ between candidates"),
        ({"model.no_such_setting": 1}, "model has no setting 'no_such_setting'"),
        ({"model.embedding_dim": -1}, "model.embedding_dim: value -1 is invalid"),
        ({"data.source": "csv"}, "must be model.<setting> or training.<setting>"),
    ],
)
def test_a_bad_candidate_is_a_config_error(candidate: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"training\.candidates\[1\]") as err:
        set_values(RecsysConfig(), {"training.candidates": [candidate]})
    assert message in str(err.value)


def test_at_most_four_candidates() -> None:
    with pytest.raises(ConfigError, match="at most 4"):
        set_values(RecsysConfig(), {"training.candidates": [{"model.embedding_dim": 8}] * 5})


def test_the_best_validation_score_wins_and_ties_keep_the_earlier() -> None:
    def trial(index: int, score: float) -> CandidateTrial:
        return CandidateTrial(index, {}, "recall_at_50", score, None, 1, 1.0)

    assert chosen([trial(0, 0.2), trial(1, 0.3), trial(2, 0.25)]) == 1
    assert chosen([trial(0, 0.3), trial(1, 0.3)]) == 0
    assert chosen([trial(0, math.nan), trial(1, 0.1)]) == 1
    assert chosen([trial(0, math.nan), trial(1, math.nan)]) == 0


def test_the_run_keeps_the_candidate_that_wins_on_validation(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    _, _, data_dir = prepared
    config = parse_config(_raw())
    counter = _FitCounter()
    result = train(config, data_dir, backup_dir=tmp_path / "backup", callbacks=[counter])
    assert counter.fits == 4  # three first fits and the winner's refit
    scores = [c["validation"] for c in result.candidates]
    assert [c["settings"] for c in result.candidates] == [{}, GOOD, RANDOM]
    assert scores[1] > max(scores[0], scores[2])  # the premise: training beats random towers
    assert result.chosen_candidate == 1
    # The kept run is the candidate's: its width, its settings recorded as trained.
    assert result.model.config.embedding_dim == 12 and result.model.output_dim == 12
    assert result.evaluation_model is not None
    assert result.evaluation_model.config.embedding_dim == 12
    assert result.resolved["model.embedding_dim"]["value"] == 12
    assert result.resolved["training.learning_rate"]["value"] == 0.05
    assert result.validation_score == pytest.approx(scores[1])

    # Killed during the refit: every first fit is kept, none trains again.
    for index in range(3):
        assert (tmp_path / "backup" / f"candidate-{index}" / "first_fit").is_dir()
    again = _FitCounter()
    rerun = train(config, data_dir, backup_dir=tmp_path / "backup", callbacks=[again])
    assert again.fits == 1  # the refit alone
    assert rerun.candidates == result.candidates and rerun.chosen_candidate == 1
    np.testing.assert_allclose(
        rerun.evaluation_model.item_embeddings(),  # type: ignore[union-attr]
        result.evaluation_model.item_embeddings(),
    )


def test_without_candidates_nothing_is_recorded(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    _, _, data_dir = prepared
    training = {**plain(SMALL)["training"], "epochs": 1, "candidates": []}
    result = train(parse_config({**plain(SMALL), "training": training}), data_dir)
    assert result.candidates == [] and result.chosen_candidate is None
    assert result.validation_score is not None and result.validation_score >= 0


@pytest.mark.slow
def test_a_night_reports_its_candidates_in_the_summary_and_mlflow(
    server: MlflowServer, tmp_path: Path
) -> None:
    raw = {
        **_raw(),
        "model_name": "candidates",
        "tracking": {"uri": server.uri, "retries": 2, "backoff_seconds": 0.2},
        "export": {**SMALL["export"], "verify": False},  # checked elsewhere; seconds here
        "evaluation": {**SMALL["evaluation"], "classic_baseline": {"enabled": False}},
    }
    path = tmp_path / "candidates.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = io.StringIO()
    args = ["nightly", "--config", str(path), "--date", SMALL_DATE]
    with contextlib.redirect_stdout(out):
        code = cli.main([*args, "--workdir", str(tmp_path / "work")])
    assert code == 0, out.getvalue()
    client = MlflowClient(server.uri)
    (version,) = client.search_model_versions("name = 'candidates'")
    assert version.run_id is not None
    run = client.get_run(version.run_id)
    run_dir = Path(run.data.tags["run_dir"])
    record = read_train(run_dir)
    assert record.chosen_candidate == 1 and len(record.candidates) == 3
    lines = record.candidate_lines()
    assert lines[1].endswith("(kept)") and "model.embedding_dim=12" in lines[1]
    assert not lines[0].endswith("(kept)")
    summary = (run_dir / RunFile.SUMMARY).read_text()
    assert "Candidates (first fits, chosen on validation):" in summary
    for line in lines:
        assert line in summary and line in out.getvalue()
    assert run.data.tags["candidate.kept"] == "1"
    assert run.data.tags["candidate.1"] == record.candidates[1].line()
    # Each candidate's epochs were watched live under its own prefix.
    assert "candidate1_val_recall_at_50" in run.data.metrics, sorted(run.data.metrics)
    assert "candidate2_val_recall_at_50" in run.data.metrics
    assert run.data.params["model.embedding_dim"] == "12"  # as trained
    date = dt.date.fromisoformat(SMALL_DATE)
    assert run_dir.parent.name == date.isoformat()


def test_the_default_tries_narrow_and_wide_mean_pooling_beside_the_transformer() -> None:
    config = RecsysConfig()
    assert config.model.query_encoder == "transformer" and config.model.history_mean
    mean = {"model.query_encoder": "mean", "model.history_mean": False, "model.history_length": 50}
    assert config.training.candidates == [mean, {**mean, "model.embedding_dim": 256}]


def test_a_candidate_the_config_already_is_not_trained_again(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> None:
    _, _, data_dir = prepared
    raw = plain(SMALL)  # the mean encoder already
    training = {**raw["training"], "epochs": 1, "candidates": [{"model.query_encoder": "mean"}]}
    counter = _FitCounter()
    result = train(parse_config({**raw, "training": training}), data_dir, callbacks=[counter])
    assert counter.fits == 1
    own, twin = result.candidates
    assert twin["validation"] == own["validation"] and twin["seconds"] == 0.0
    assert result.chosen_candidate == 0  # a tie keeps the earlier


def test_a_warm_started_run_skips_its_candidates(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    _, _, data_dir = prepared
    raw = plain(SMALL)
    first = train(parse_config({**raw, "training": {**raw["training"], "epochs": 1}}), data_dir)
    first.model.save(tmp_path / "previous")
    training = {
        **raw["training"],
        "epochs": 1,
        "warm_start_from": str(tmp_path / "previous"),
        "candidates": [GOOD],
    }
    counter = _FitCounter()
    result = train(parse_config({**raw, "training": training}), data_dir, callbacks=[counter])
    assert counter.fits == 1 and result.candidates == [] and result.chosen_candidate is None
    assert result.model.config.embedding_dim == SMALL["model"]["embedding_dim"]
