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

from benchmarks import candidate_pruning
from conductor import cli
from recsys.core.config import RecsysConfig, parse_config, set_values
from recsys.core.errors import ConfigError
from recsys.core.layout import RunFile, Workdir
from recsys.core.records import CandidateRecord, read_train
from recsys.training.candidates import CandidatePruner, bar_at, chosen, pruning_bar
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


def _trial(index: int, score: float, curve: list[float | None] | None = None) -> CandidateRecord:
    return CandidateRecord(
        index=index,
        settings={},
        metric="recall_at_50",
        validation=score,
        best_epoch=None,
        epochs=len(curve or [score]),
        seconds=1.0,
        curve=curve or [score],
    )


def test_the_best_validation_score_wins_and_ties_keep_the_earlier() -> None:
    assert chosen([_trial(0, 0.2), _trial(1, 0.3), _trial(2, 0.25)]) == 1
    assert chosen([_trial(0, 0.3), _trial(1, 0.3)]) == 0
    assert chosen([_trial(0, math.nan), _trial(1, 0.1)]) == 1
    assert chosen([_trial(0, math.nan), _trial(1, math.nan)]) == 0


def test_the_pruning_bar_is_the_best_any_earlier_fit_had_reached_by_each_epoch() -> None:
    early = _trial(0, 0.5, [0.1, 0.5, 0.4])  # stopped early: holds its best after
    late = _trial(1, 0.6, [0.3, 0.2, 0.35, 0.45, 0.6])
    unscored = _trial(2, math.nan, [None, None])
    assert pruning_bar([early, late, unscored]) == pytest.approx([0.3, 0.5, 0.5, 0.5, 0.6])
    assert pruning_bar([]) == []
    assert all(math.isnan(v) for v in pruning_bar([unscored]))
    bar = pruning_bar([early, late])
    assert [bar_at(bar, e) for e in (1, 5, 9)] == pytest.approx([0.3, 0.6, 0.6])  # holds past end
    assert math.isnan(bar_at([], 1))


def test_a_candidate_record_of_an_earlier_release_still_reads() -> None:
    # train.json written before pruning: no curve, no pruned_after.
    old = {"index": 1, "settings": {"model.embedding_dim": 8}, "metric": "recall_at_50",
           "validation": 0.25, "best_epoch": 3, "epochs": 5, "seconds": 2.0}  # fmt: skip
    record = CandidateRecord(**old)
    assert record.curve == [] and record.pruned_after is None
    assert record.line() == "model.embedding_dim=8: validation recall_at_50 0.2500"
    unscored = CandidateRecord(**{**old, "validation": math.nan, "curve": [math.nan, 0.1]})
    assert unscored.validation is None and unscored.curve == [None, 0.1]
    assert unscored.line().endswith("no score")


def test_the_documented_pruning_replay_of_the_beauty_curves() -> None:
    # docs/BENCHMARKS.md, "Candidate pruning": from epoch 2 the transformer is kept, the
    # narrow mean stops after epoch 2 of 9, the wide one after 3 of 7 (it leads at epoch 2).
    path = Path(__file__).parent.parent / "benchmarks/results/candidate_curves_amazon_beauty.json"
    (row,) = candidate_pruning.run_rows(path, [2])
    assert row["kept_full"] == row["kept_pruned"] == 0
    assert row["pruned_after"] == [None, 2, 3] and row["epochs_full"] == [10, 9, 7]
    assert 0.5 < row["seconds"] / row["seconds_full"] < 0.65
    (off,) = candidate_pruning.run_rows(path, [0])
    assert off["pruned_after"] == [None, None, None] and off["seconds"] == off["seconds_full"]


class _Scores(tf.keras.callbacks.Callback):
    """Writes a given validation score into each epoch's logs (what the validator does)."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        assert logs is not None
        logs["val_recall_at_50"] = self.scores[epoch]


def _epochs_run(
    scores: list[float], bar: list[float], after: int, initial_epoch: int = 0
) -> tuple[int, int | None]:
    """Epochs a real Keras fit runs with the pruner, and the epoch it was pruned after."""
    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    pruner = CandidatePruner("recall_at_50", bar, after)
    history = model.fit(
        np.ones((4, 2)),
        np.ones(4),
        epochs=len(scores),
        initial_epoch=initial_epoch,  # > 0: as BackupAndRestore resumes a fit
        verbose=0,
        callbacks=[_Scores(scores), pruner],
    )
    return len(history.history["loss"]), pruner.pruned_after


def test_a_candidate_that_trails_the_bar_from_the_prune_epoch_on_stops() -> None:
    bar = [0.3, 0.5, 0.5, 0.6]
    # Behind at epoch 1 is allowed (after=2); behind at epoch 2 stops it.
    assert _epochs_run([0.1, 0.4, 0.9, 0.9], bar, after=2) == (2, 2)
    # Its best so far counts, not the epoch's value: 0.55 by epoch 3 is above 0.5.
    assert _epochs_run([0.1, 0.55, 0.2, 0.7], bar, after=2) == (4, None)
    # Ahead of the bar everywhere, or pruning off (0), or no bar: the whole fit.
    assert _epochs_run([0.4, 0.6, 0.6, 0.7], bar, after=1) == (4, None)
    assert _epochs_run([0.1, 0.1, 0.1, 0.1], bar, after=0) == (4, None)
    assert _epochs_run([0.1, 0.1, 0.1, 0.1], [], after=1) == (4, None)
    # Past the bar's last epoch, its last value is the bar; the last epoch is never pruned.
    assert _epochs_run([0.1, 0.5, 0.55, 0.58, 0.59, 0.6], [0.3, 0.5, 0.59], after=4) == (4, 4)
    assert _epochs_run([0.1, 0.1, 0.1], bar, after=3) == (3, None)
    # A resumed fit (its epochs before the resume unseen) is not pruned: 3 epochs of 4 run.
    assert _epochs_run([0.1, 0.1, 0.1, 0.1], bar, after=2, initial_epoch=1) == (3, None)


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
    # The random towers trail the trained candidate by epoch 2 (candidates_prune_after) and
    # stop there; the config's own and the winner run their whole first fits.
    assert [c["pruned_after"] for c in result.candidates] == [None, None, 2]
    assert [len(c["curve"]) for c in result.candidates] == [3, 3, 2]
    assert result.candidates[2]["epochs"] == 2
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
    assert record.candidates[2].pruned_after == 2 and len(record.candidates[2].curve) == 2
    assert lines[2].endswith("(pruned after epoch 2)"), lines[2]
    summary = (run_dir / RunFile.SUMMARY).read_text()
    assert "Candidates (first fits, chosen on validation):" in summary
    for line in lines:
        assert line in summary and line in out.getvalue()
    assert run.data.tags["candidate.kept"] == "1"
    assert run.data.tags["candidate.1"] == record.candidates[1].line()
    assert run.data.tags["candidate.2"].endswith("(pruned after epoch 2)")
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
