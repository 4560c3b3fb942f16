"""`recsys tune`: Optuna trials as MLflow child runs, validation split only, a usable config."""

from __future__ import annotations

import shutil
from pathlib import Path

import optuna
import pytest
import tensorflow as tf
import yaml
from mlflow import MlflowClient

from conductor.cli import main
from recsys import tuning
from recsys.core.config import (
    RecsysConfig,
    SearchDimension,
    load_config,
    parse_config,
    set_values,
)
from recsys.core.errors import ConfigError
from recsys.core.layout import Workdir
from recsys.data_io import load_split
from tests.conftest import SMALL, SMALL_DATE
from tests.mlflow_server import MlflowServer

SPACE = {
    "model.embedding_dim": {"choices": [8, 16]},
    "model.history_length": {"choices": [5, 10]},
    "training.learning_rate": {"low": 0.005, "high": 0.05, "log": True},
}


def _config(uri: str | None = None) -> RecsysConfig:
    raw = {
        **SMALL,
        # Every base value lies in SPACE, so trial 0 is the baseline.
        "model": {**SMALL["model"], "history_length": 10},
        "tune": {"space": SPACE, "trials": 3, "startup_trials": 1, "metric": "recall_at_10"},
    }
    if uri:
        raw["tracking"] = {"uri": uri}
    return parse_config(raw)


def _poisoned_copy(data_dir: Path, root: Path) -> Path:
    """The data folder with every test shard replaced by bytes no reader can parse."""
    copy = root / "poisoned"
    shutil.copytree(data_dir, copy)
    shards = sorted(copy.glob("test-*.tfrecord*"))
    assert shards
    for shard in shards:
        shard.write_bytes(b"\x1f\x8b not a gzip TFRecord: reading the test split is a bug")
    return copy


def test_trials_are_child_runs_and_the_test_split_is_never_read(
    prepared: tuple[RecsysConfig, Workdir, Path], server: MlflowServer, tmp_path: Path
) -> None:
    _, workdir, data_dir = prepared
    data = _poisoned_copy(data_dir, tmp_path)
    # The poison works: anything that reads the test split fails.
    with pytest.raises(tf.errors.OpError):
        load_split(data, "test")
    config = _config(server.uri)
    output = tmp_path / "best.yaml"
    result = tuning.tune(config, data, output, workdir=workdir.root, trials=3)

    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("test-model-tune")
    assert experiment is not None and result.experiment == "test-model-tune"
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.params["space.model.embedding_dim"] == '{"choices": [8, 16], "log": false}'
    children = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'",
    )
    assert len(children) == 3
    for child in children:
        assert child.data.tags[tuning.STATE_TAG] in {"complete", "pruned"}
        assert set(child.data.params) == set(SPACE)
        curve = client.get_metric_history(child.info.run_id, "val_recall_at_10")
        assert [m.step for m in curve] == list(range(len(curve))) and curve
    # Trial 0 trained the base config's own settings, so the winner is measured against them.
    roles = {c.data.tags["optuna.trial"]: c.data.tags[tuning.ROLE_TAG] for c in children}
    assert roles == {"0": "baseline", "1": "sampled", "2": "sampled"}
    (baseline,) = [c for c in children if c.data.tags[tuning.ROLE_TAG] == "baseline"]
    assert baseline.data.params == {
        "model.embedding_dim": "16", "model.history_length": "10", "training.learning_rate": "0.01"
    }  # fmt: skip
    assert parent.data.params["baseline"] == "trial 0"
    assert (
        result.baseline_value
        == pytest.approx(baseline.data.metrics["validation_recall_at_10"])
        == pytest.approx(parent.data.metrics["baseline_validation_recall_at_10"])
    )
    assert result.best_value >= result.baseline_value
    best_child = client.get_run(parent.data.tags["best_trial_run_id"])
    assert best_child.data.metrics["validation_recall_at_10"] == pytest.approx(result.best_value)
    assert parent.data.metrics["best_validation_recall_at_10"] == pytest.approx(result.best_value)
    assert "best.yaml" in [a.path for a in client.list_artifacts(result.parent_run_id)]

    written = load_config(output)  # loads and validates as any config
    for key, value in result.best_params.items():
        section, name = key.split(".")
        assert getattr(getattr(written, section), name) == value
    assert written.training.early_stopping_metric == "recall_at_10"
    assert written.preprocess.history_length >= written.model.history_length
    assert written.data == config.data and written.tune == config.tune


def test_a_trial_below_the_median_is_pruned_and_stops_training(server: MlflowServer) -> None:
    client = MlflowClient(server.uri)
    experiment_id = client.create_experiment("pruning")
    study = optuna.create_study(
        direction="maximize",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0),
    )
    good = study.ask()
    for epoch, value in enumerate([0.5, 0.6]):
        good.report(value, epoch)
    study.tell(good, 0.6)
    trial = study.ask()
    run_id = client.create_run(experiment_id).info.run_id
    reporter = tuning._Reporter(trial, client, run_id, "ndcg_at_10")
    reporter.set_model(tf.keras.Sequential())
    # Optuna's median rule compares the trial's best value so far with the median at the step.
    reporter.on_epoch_end(0, {"loss": 3.0, "val_ndcg_at_10": 0.55})
    assert not reporter.pruned and not reporter.model.stop_training
    reporter.on_epoch_end(1, {"loss": 2.0, "val_ndcg_at_10": 0.1})
    assert reporter.pruned and reporter.model.stop_training
    history = client.get_metric_history(run_id, "val_ndcg_at_10")
    assert [(m.step, m.value) for m in history] == [(0, 0.55), (1, 0.1)]


def test_cli_tune_writes_a_config_the_nightly_accepts(tmp_path: Path, capsys) -> None:
    space = {
        "model.embedding_dim": {"choices": [8, 16]},
        "model.user_embedding": {"choices": [True, False]},
    }
    raw = {**SMALL, "model": {**SMALL["model"], "user_embedding": "auto"}, "tune": {"space": space}}
    source = tmp_path / "small.yaml"
    source.write_text(yaml.safe_dump(raw))
    work = tmp_path / "work"
    code = main(["tune", "--config", str(source), "--workdir", str(work),
                 "--date", SMALL_DATE, "--trials", "1"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    best = work / "tune" / SMALL_DATE / "best.yaml"
    assert f"config:      {best}" in out
    # One trial is the baseline alone: what is written is the base config's own settings.
    assert "baseline:    trial 0 (the base config's settings), validation " in out
    assert out.rstrip().count("no sampled trial beat it") == 1
    text = best.read_text()
    assert text.startswith("# Written by `recsys tune`")
    assert "the base config's own settings: no sampled trial beat them" in " ".join(
        line.lstrip("# ") for line in text.splitlines()
    )
    written = load_config(best)
    # As written: the baseline trained `auto` resolved for the data, and `auto` it stays.
    assert written.model.embedding_dim == 16 and written.model.user_embedding == "auto"
    assert written.model_name == "test-model"
    # The local SQLite store under the workdir holds the search.
    store = f"sqlite:///{work.resolve() / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("test-model-tune")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if "best.model.user_embedding" in r.data.params]
    # The parent's best.* params say what the file says, not the value `auto` resolved to.
    assert parent.data.params["best.model.user_embedding"] == '"auto"'
    assert "  model.user_embedding = auto" in out


def test_cli_tune_rejects_a_bad_trial_count(tmp_path: Path, capsys) -> None:
    code = main(["tune", "--workdir", str(tmp_path), "--trials", "0"])
    assert code == 2
    assert capsys.readouterr().err.strip() == "recsys: error: --trials must be at least 1, got 0"


def test_search_space_keys_and_values_are_validated() -> None:
    with pytest.raises(ConfigError, match="model has no setting 'embeding_dim'"):
        parse_config({"tune": {"space": {"model.embeding_dim": {"choices": [8]}}}})
    with pytest.raises(ConfigError, match=r"must be model\.<setting> or training\.<setting>"):
        parse_config({"tune": {"space": {"data.path": {"choices": ["x"]}}}})
    with pytest.raises(ConfigError, match="value 1 is invalid"):
        parse_config({"tune": {"space": {"model.embedding_dim": {"choices": [1, 8]}}}})
    with pytest.raises(ConfigError, match="low > 0"):
        parse_config({"tune": {"space": {"training.learning_rate": {"low": 0, "high": 1,
                                                                    "log": True}}}})  # fmt: skip
    # The space never changes a nightly run's identity.
    assert parse_config({"tune": {"trials": 5}}).digest() == parse_config({}).digest()


def test_the_baseline_trial_is_skipped_with_the_reason_when_the_space_excludes_it() -> None:
    space = {**SPACE, "model.temperature": {"low": 0.05, "high": 0.5, "step": 0.05}}
    model = {"embedding_dim": 16, "history_length": 10, "temperature": 0.1}
    base = parse_config({"model": model, "tune": {"space": space}})
    assert tuning.baseline_params(base) == (
        {"model.embedding_dim": 16, "model.history_length": 10, "model.temperature": 0.1,
         "training.learning_rate": 0.01},
        None,
    )  # fmt: skip
    for change, why in [
        ({"history_length": 20}, "history_length=20 is outside tune.space ({'choices': [5, 10]})"),
        ({"temperature": 0.12}, "model.temperature=0.12 is outside"),  # off the step
        ({"temperature": 0.55}, "model.temperature=0.55 is outside"),  # above the range
    ]:  # fmt: skip
        params, reason = tuning.baseline_params(
            parse_config({"model": {**model, **change}, "tune": {"space": space}})
        )
        assert params == {} and reason is not None and why in reason
    # The shipped configs' own settings lie in the default space once `auto` is resolved for
    # the data (user_embedding: auto is outside its true/false choices until then).
    for shipped in sorted(Path("configs").glob("*.yaml")):
        config = load_config(shipped)
        assert "user_embedding='auto'" in (tuning.baseline_params(config)[1] or "")
        for events, table in ((8, False), (106, True)):
            stats = {"items": 1682, "users": 10, "splits": {"train": 10 * events}}
            params, reason = tuning.baseline_params(config, stats)
            assert reason is None and params["model.user_embedding"] is table, shipped
    # A searched schedule: `auto` becomes the schedule training would use on that log.
    scheduled = set_values(
        load_config(Path("configs/default.yaml")),
        {"tune.space": {"training.learning_rate_schedule": {"choices": ["constant", "cosine"]}}},
    )
    for events, schedule in ((8, "constant"), (106, "cosine")):
        stats = {"items": 1682, "users": 10, "splits": {"train": 10 * events}}
        params, reason = tuning.baseline_params(scheduled, stats)
        assert reason is None and params == {"training.learning_rate_schedule": schedule}
    # Typed: a boolean is not the choice 1, an integer range takes no float.
    assert not SearchDimension(choices=[1, 2]).contains(True)
    assert not SearchDimension(low=1, high=4).contains(2.0)
    assert SearchDimension(low=1, high=4).contains(2)


def test_trials_train_without_the_refit_their_score_would_leak_into(tmp_path: Path) -> None:
    # A refit trains on the validation split a trial is scored on: trials never refit, while
    # the written best config keeps the base config's refit for the nightly.
    base = parse_config({"training": {"refit": True, "early_stopping_patience": 2}})
    trial = tuning.trial_config(base, {"model.embedding_dim": 16})
    assert trial.training.refit == "off" and trial.model.embedding_dim == 16
    best = load_config(tuning.write_config(base, {"model.embedding_dim": 16}, tmp_path / "b.yaml"))
    assert best.training.refit == "validation" and best.model.embedding_dim == 16


def test_trials_and_the_written_winner_ignore_the_dense_log_rule(tmp_path: Path) -> None:
    # A trial is scored for the settings it proposed: a shape rule must not replace them on a
    # dense log, in the trial or in the config the nightly then runs.
    rule = {"min_events_per_user": 1, "settings": {"model.embedding_dim": 128}}
    base = parse_config({"dense_log": rule})
    assert tuning.trial_config(base, {"model.embedding_dim": 16}).dense_log is None
    best = load_config(tuning.write_config(base, {"model.embedding_dim": 16}, tmp_path / "b.yaml"))
    assert best.dense_log is None and best.model.embedding_dim == 16


def test_the_timeout_also_stops_the_running_trial_after_its_epoch(
    prepared: tuple[RecsysConfig, Workdir, Path], server: MlflowServer, tmp_path: Path
) -> None:
    # Optuna's own timeout only keeps new trials from starting: one slow trial could run
    # for hours past the budget. The search's deadline ends the running trial too.
    _, workdir, data_dir = prepared
    raw = _config(server.uri).model_dump(mode="json")
    raw["training"]["epochs"] = 4
    raw["training"]["early_stopping_patience"] = 0
    raw["tune"]["baseline"] = False  # also: a search without its baseline trial
    config = parse_config(raw)
    result = tuning.tune(
        config, data_dir, tmp_path / "best.yaml", workdir=workdir.root, trials=3,
        timeout_seconds=0.01,
    )  # fmt: skip
    client = MlflowClient(server.uri)
    children = client.search_runs(
        [client.get_experiment_by_name(result.experiment).experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'",
    )
    assert len(children) == 1  # no trial starts after the deadline
    (child,) = children
    assert child.data.tags[tuning.STATE_TAG] == "timed_out"
    assert child.data.tags[tuning.ROLE_TAG] == "sampled"
    parent = client.get_run(result.parent_run_id)
    assert parent.data.params["baseline"] == "tune.baseline is false"
    assert result.baseline_value is None and result.baseline_skipped == "tune.baseline is false"
    assert len(client.get_metric_history(child.info.run_id, "val_recall_at_10")) == 1
    # The epochs it ran still count: its value is what the written config was chosen by.
    assert result.best_value == pytest.approx(child.data.metrics["validation_recall_at_10"])
    assert load_config(tmp_path / "best.yaml").model.embedding_dim in (8, 16)
