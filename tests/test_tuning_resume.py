"""`recsys tune` survives and scales: a killed search resumes its study, workers share one.

The study lives in Optuna's RDB storage (SQLite under the working directory, or the tracking
store's PostgreSQL database); the MLflow runs are checked with MlflowClient against the store
the search wrote. Trials are tiny (SMALL data, one epoch).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow import MlflowClient
from optuna.trial import TrialState

from conductor.cli import main
from recsys import tuning, tuning_study
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.errors import ConfigError
from recsys.core.layout import Workdir
from tests.conftest import REPO, SMALL, SMALL_DATE
from tests.postgres_server import PostgresServer, count, postgres_or_skip

SPACE = {
    "model.embedding_dim": {"choices": [8, 16]},
    "training.learning_rate": {"low": 0.005, "high": 0.05, "log": True},
}
RAW = {
    **SMALL,
    "training": {**SMALL["training"], "epochs": 1},
    "tune": {"space": SPACE, "startup_trials": 1, "metric": "recall_at_10"},
}
EXPERIMENT = "test-model-tune"


def _store(work: Path) -> str:
    return f"sqlite:///{work.resolve() / 'mlflow' / 'mlflow.db'}"


def _study(work: Path) -> optuna.Study:
    storage = f"sqlite:///{Workdir(work).study_store()}"
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage)


def _runs(uri: str) -> list:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    return client.search_runs([experiment.experiment_id], max_results=1000)


def _cli(config: Path, work: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "conductor.cli", "tune", "--config", str(config),
            "--workdir", str(work), "--date", SMALL_DATE, *extra]  # fmt: skip


def _search(tmp_path: Path, *extra: str) -> tuple[Path, Path, list[str], dict[str, str]]:
    """A search to run in a subprocess: its workdir, its log, its command and environment."""
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(RAW))
    work = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return work, tmp_path / "first.log", _cli(config, work, *extra), env


def _wait_for(log: Path, text: str, process: subprocess.Popen[bytes]) -> None:
    """Until `text` is in the log; a process that ended first or hangs fails the test."""
    deadline = time.monotonic() + 600
    while text not in log.read_text(errors="replace"):
        if process.poll() is not None:
            pytest.fail(f"recsys tune exited ({process.returncode}) before {text!r}:\n"
                        + log.read_text(errors="replace")[-3000:])  # fmt: skip
        if time.monotonic() > deadline:
            pytest.fail(f"no {text!r} in the log after 600 s")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_killed_search_resumes_its_study_and_leaves_no_run_running(tmp_path: Path) -> None:
    work, log, command, env = _search(tmp_path, "--trials", "4")
    with log.open("wb") as out:
        first = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 cwd=REPO)  # fmt: skip
        # Trial 0 ended and trial 1 is training (its MLflow run exists before this line).
        _wait_for(log, "recsys.tuning: trial 1: ", first)
        first.send_signal(signal.SIGKILL)
        first.wait()
    # What the kill left: the parent and the running trial RUNNING, trial 1 RUNNING in Optuna.
    killed = {r.info.run_name: r for r in _runs(_store(work)) if r.info.status == "RUNNING"}
    assert set(killed) == {f"tune-{SMALL_DATE}", "trial-1"}
    interrupted = _study(work).trials[1]
    assert interrupted.state == TrialState.RUNNING

    again = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                           timeout=900)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "1 before it" in again.stdout and "3 ended in this run" in again.stdout

    runs = _runs(_store(work))
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
    parents = [r for r in runs if "optuna.trial" not in r.data.tags]
    (parent,) = parents  # the resumed search reused its parent run
    assert parent.info.run_id == killed[f"tune-{SMALL_DATE}"].info.run_id
    assert parent.info.status == "FINISHED" and parent.data.tags["recsys.resumes"] == "1"
    trial_1 = next(r for r in runs if r.info.run_name == "trial-1")
    assert trial_1.info.status == "KILLED"
    assert trial_1.data.tags[tuning.STATE_TAG] == "killed"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 5  # trials 0-4: the killed one and its rerun included

    # The study continued: its 4-trial budget counts the trial ended before the kill.
    study = _study(work)
    states = [(t.number, t.state, bool(t.user_attrs.get(tuning_study.KILLED_ATTR)))
              for t in study.trials]  # fmt: skip
    assert states == [
        (0, TrialState.COMPLETE, False),
        (1, TrialState.FAIL, True),
        (2, TrialState.COMPLETE, False),
        (3, TrialState.COMPLETE, False),
        (4, TrialState.COMPLETE, False),
    ]
    # The interrupted trial was the first one rerun, with its settings.
    rerun = study.trials[2]
    assert rerun.user_attrs[tuning_study.RETRY_ATTR] == 1
    assert rerun.params == interrupted.params
    assert next(r for r in runs if r.info.run_name == "trial-2").data.tags[
        "recsys.retry_of"
    ] == "1"  # fmt: skip
    assert tuning_study.trials_ended(study) == 4
    best = max((t for t in study.trials if t.value is not None), key=lambda t: t.value)
    assert parent.data.tags["best_trial_run_id"] == best.user_attrs["mlflow_run_id"]

    # Run once more: the budget is spent, nothing runs, nothing is left RUNNING.
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 ended in this run" in done.stdout and len(_study(work).trials) == 5
    assert all(r.info.status != "RUNNING" for r in _runs(_store(work)))


@pytest.mark.slow
def test_two_workers_run_trials_in_two_processes_on_one_study(tmp_path: Path, capsys) -> None:
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(RAW))
    work = tmp_path / "work"
    code = main(["tune", "--config", str(config), "--workdir", str(work), "--date", SMALL_DATE,
                 "--trials", "4", "--workers", "2"])  # fmt: skip
    assert code == 0
    assert "4 ended in this run" in capsys.readouterr().out
    study = _study(work)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    pids = {t.user_attrs[tuning_study.PID_ATTR] for t in study.trials}
    workers = {t.user_attrs[tuning_study.WORKER_ATTR] for t in study.trials}
    assert len(pids) == 2 and os.getpid() not in pids and workers == {0, 1}
    runs = _runs(_store(work))
    (parent,) = [r for r in runs if "optuna.trial" not in r.data.tags]
    children = [r for r in runs if "optuna.trial" in r.data.tags]
    assert len(children) == 4
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert {int(r.data.tags["recsys.pid"]) for r in children} == pids
    assert all(r.info.status == "FINISHED" for r in runs)
    # Trial 0 is still the base config's settings, whichever worker ran it.
    assert study.trials[0].user_attrs.get(tuning_study.BASELINE_ATTR) is True


@pytest.mark.slow
def test_a_killed_worker_fails_the_search_and_its_trial_is_rerun(tmp_path: Path) -> None:
    work, log, command, env = _search(tmp_path, "--trials", "4", "--workers", "2")
    with log.open("wb") as out:
        first = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 cwd=REPO)  # fmt: skip
        _wait_for(log, "[worker 1]: trial ", first)
        pids = re.search(r"tuning workers started: pids \[(\d+), (\d+)\]", log.read_text())
        assert pids is not None
        os.kill(int(pids[2]), signal.SIGKILL)  # worker 1, in the middle of its trial
        assert first.wait(timeout=900) == 10
    text = log.read_text(errors="replace")
    assert f"tuning worker 1 (pid {pids[2]}) was killed by signal 9" in text
    killed = [t for t in _study(work).trials if t.user_attrs.get(tuning_study.KILLED_ATTR)]
    assert [t.user_attrs[tuning_study.PID_ATTR] for t in killed] == [int(pids[2])]
    assert all(r.info.status != "RUNNING" for r in _runs(_store(work)))

    again = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                           timeout=900)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    study = _study(work)
    assert tuning_study.trials_ended(study) == 4
    reruns = [t for t in study.trials if t.user_attrs.get(tuning_study.RETRY_ATTR) is not None]
    assert [(t.user_attrs[tuning_study.RETRY_ATTR], t.params) for t in reruns] == [
        (killed[0].number, killed[0].params)
    ]
    assert all(r.info.status != "RUNNING" for r in _runs(_store(work)))


def test_a_search_continues_its_study_over_runs_and_budgets(
    prepared: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    _, workdir, data_dir = prepared
    config = parse_config(RAW)
    date = dt.date.fromisoformat(SMALL_DATE)
    output = tmp_path / "best.yaml"

    def search(trials: int) -> tuning.TuneResult:
        return tuning.tune(config, data_dir, output, workdir=workdir.root, trials=trials,
                           run_date=date)  # fmt: skip

    first = search(2)
    assert (first.trials_before, first.trials_run) == (0, 2)
    # The same search again: its budget is spent, the same parent run is finished again.
    same = search(2)
    assert (same.trials_before, same.trials_run, same.parent_run_id) == (
        2, 0, first.parent_run_id
    )  # fmt: skip
    # A larger budget continues the study; the finished parent keeps what it chose.
    more = search(3)
    assert (more.trials_before, more.trials_run) == (2, 1)
    assert more.parent_run_id != first.parent_run_id
    client = MlflowClient(tuning.tracking.resolve_tracking_uri(config, workdir.root))
    continued = client.get_run(more.parent_run_id)
    assert continued.data.tags[tuning.CONTINUES_TAG] == first.parent_run_id
    assert continued.data.params["baseline"] == "trial 0"
    assert more.best_value == max(
        t.value for t in _study_of(config, workdir, data_dir).trials if t.value is not None
    )


def _study_of(config: RecsysConfig, workdir: Workdir, data_dir: Path) -> optuna.Study:
    import json

    stats = json.loads((data_dir / "stats.json").read_text())
    name = tuning_study.study_name(config, stats, dt.date.fromisoformat(SMALL_DATE))
    return optuna.load_study(study_name=name, storage=f"sqlite:///{workdir.study_store()}")


def test_stale_trials_are_failed_and_queued_again(tmp_path: Path) -> None:
    storage = tuning_study.open_storage(f"sqlite:///{tmp_path / 'optuna.db'}")
    sampler, pruner = optuna.samplers.RandomSampler(seed=0), optuna.pruners.NopPruner()
    resumed = tuning_study.resume(storage, "s", sampler, pruner)
    assert resumed.new and resumed.killed == []
    study = resumed.study
    done = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    study.tell(done, 0.5)
    study.enqueue_trial({"x": 0.25}, user_attrs={tuning_study.BASELINE_ATTR: True})
    running = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    assert running.params == {"x": 0.25}
    # The process running it dies here: it stays RUNNING until the search is resumed.
    again = tuning_study.resume(storage, "s", sampler, pruner)
    assert not again.new and again.uid == resumed.uid
    assert [t.number for t in again.killed] == [running.number]
    trials = again.study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING]
    assert trials[1].user_attrs[tuning_study.KILLED_ATTR] is True
    assert trials[2].user_attrs == {tuning_study.BASELINE_ATTR: True, tuning_study.RETRY_ATTR: 1}
    # The killed trial counts toward neither budget, and is the next one run, as it was.
    assert tuning_study.trials_ended(again.study) == 1
    assert again.study.ask({"x": optuna.distributions.FloatDistribution(0, 1)}).params == {
        "x": 0.25
    }


def test_time_spent_counts_overlapping_trials_once(tmp_path: Path) -> None:
    storage = tuning_study.open_storage(f"sqlite:///{tmp_path / 'optuna.db'}")
    study = optuna.create_study(study_name="t", storage=storage)
    start = dt.datetime(2026, 1, 1, 12, 0, 0)
    spans = [(0, 60), (30, 90), (200, 210)]  # two workers overlap, then a gap
    for begin, end in spans:
        study.add_trial(optuna.trial.FrozenTrial(
            number=0, trial_id=0, state=TrialState.COMPLETE, value=0.0, params={},
            distributions={}, user_attrs={}, system_attrs={}, intermediate_values={},
            datetime_start=start + dt.timedelta(seconds=begin),
            datetime_complete=start + dt.timedelta(seconds=end),
        ))  # fmt: skip
    assert tuning_study.seconds_spent(study) == pytest.approx(100.0)
    assert tuning_study.trials_ended(study) == 3


def test_budgets_and_workers_are_bounded() -> None:
    for key, value, why in [
        ("trials", 10**9, "less than or equal to 100000"),
        ("timeout_seconds", math.inf, "finite number"),
        ("timeout_seconds", math.nan, "finite number"),
        ("timeout_seconds", 1e300, "less than or equal to 2592000"),
        ("workers", 0, "greater than or equal to 1"),
        ("workers", 10_000, "less than or equal to 256"),
        ("startup_trials", 10**9, "less than or equal to 100000"),
        ("seed", -1, "greater than or equal to 0"),
        ("storage", "mysql://u:secret@db/x", "mysql://... is not supported"),
    ]:
        with pytest.raises(ConfigError, match=why) as caught:
            parse_config({"tune": {key: value}})
        assert f"tune.{key}" in str(caught.value) and "secret" not in str(caught.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trials", "1000000000"], "--trials must be at most 100,000, got 1,000,000,000"),
        (["--timeout", "inf"], "--timeout must be a positive number of seconds up to 2,592,000"),
        (["--timeout", "nan"], "--timeout must be a positive number of seconds up to 2,592,000"),
        (["--timeout", "1e300"], "--timeout must be a positive number of seconds up to"),
        (["--workers", "0"], "--workers must be at least 1, got 0"),
        (["--workers", "100000"], "--workers must be at most 256, got 100,000"),
    ],
)
def test_cli_rejects_unbounded_budgets(tmp_path: Path, capsys, args: list[str], message: str):
    assert main(["tune", "--workdir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"recsys: error: {message}") and "\n" not in err
    assert not (tmp_path / "tune").exists()  # refused before anything ran


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_or_skip() as server:
        yield server


@pytest.mark.slow
def test_the_study_lives_beside_a_postgresql_tracking_store(
    prepared: tuple[RecsysConfig, Workdir, Path], postgres: PostgresServer, tmp_path: Path
) -> None:
    _, workdir, data_dir = prepared
    config = parse_config({**RAW, "tracking": {"uri": postgres.uri}})
    url = tuning_study.study_storage_url(config, workdir.root, postgres.uri)
    assert url == postgres.uri
    result = tuning.tune(config, data_dir, tmp_path / "best.yaml", workdir=workdir.root,
                         trials=1, run_date=dt.date.fromisoformat(SMALL_DATE))  # fmt: skip
    assert result.trials_run == 1 and "mlflow-test-password" not in result.storage
    # Optuna's tables are in their own schema; MLflow's stay where MLflow put them.
    schema = tuning_study.PG_SCHEMA
    assert count(postgres.uri, f"SELECT count(*) FROM {schema}.trials") == 1
    assert count(postgres.uri, f"SELECT count(*) FROM {schema}.studies") == 1
    assert count(postgres.uri, "SELECT count(*) FROM public.runs") == 2  # parent + trial
    assert not workdir.study_store().exists() or _no_study_named(workdir, result.study)
    # The same search again finds its study there.
    again = tuning.tune(config, data_dir, tmp_path / "best.yaml", workdir=workdir.root,
                        trials=1, run_date=dt.date.fromisoformat(SMALL_DATE))  # fmt: skip
    assert (again.trials_before, again.trials_run) == (1, 0)
    assert again.parent_run_id == result.parent_run_id


def _no_study_named(workdir: Workdir, name: str) -> bool:
    storage = f"sqlite:///{workdir.study_store()}"
    return name not in {s.study_name for s in optuna.get_all_study_summaries(storage)}
