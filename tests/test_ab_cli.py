"""`recsys ab assign` / `recsys ab analyze [--promote]` against a real MLflow server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient

from conductor import cli
from recsys.ab import simulate as sim
from recsys.core.config import TrackingConfig, load_config
from recsys.tracking import registry
from tests.mlflow_server import MlflowServer, mlflow_server

MODEL = "ab-cli-model"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as running:
        yield running


@pytest.fixture(scope="module")
def config_path(server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config logging to the server, and a registered model with champion v1, challenger v2."""
    tracking = TrackingConfig(uri=server.uri, retries=2, backoff_seconds=0.1)
    config = load_config(None).model_copy(update={"tracking": tracking, "model_name": MODEL})
    path = tmp_path_factory.mktemp("cfg") / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    client = MlflowClient(server.uri)
    experiment_id = client.create_experiment("ab-cli-nightly")
    for night in ("2026-01-01", "2026-01-02"):
        run = client.create_run(experiment_id, tags={"run_date": night})
        registry.register_run(client, MODEL, run.info.run_id)
    registry.set_alias(client, MODEL, registry.CHAMPION, 1)
    registry.set_alias(client, MODEL, registry.CHALLENGER, 2)
    return path


def _events(tmp_path: Path, experiment: str, lift: float, seed: int = 0) -> Path:
    frame = sim.event_log(
        np.random.default_rng(seed), users=3000, days=10, lift=lift, experiment=experiment
    )
    path = tmp_path / f"{experiment}.parquet"
    frame.to_parquet(path)
    return path


def _champion(server: MlflowServer) -> str:
    version = registry.alias_version(MlflowClient(server.uri), MODEL, registry.CHAMPION)
    assert version is not None
    return str(version.version)


def test_assign_records_the_definition_with_pinned_versions(
    server: MlflowServer, config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    users = tmp_path / "users.txt"
    users.write_text("\n".join(f"u{i}" for i in range(1000)) + "\n")
    out = tmp_path / "assignment.csv"
    args = ["ab", "assign", "--config", str(config_path), "--workdir", str(tmp_path / "w")]
    args += ["--experiment", "home", "--users", str(users), "--output", str(out)]
    args += ["--split", "A=0.45,B=0.45", "--holdout", "0.1", "--start", "2026-01-01"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "A=champion (version 1), B=challenger (version 2)" in printed
    table = pd.read_csv(out)
    assert len(table) == 1000 and set(table["variant"]) == {"A", "B", "holdout"}
    experiment = MlflowClient(server.uri).get_experiment_by_name("ab-home")
    definition = json.loads(experiment.tags["ab.definition"])
    assert definition["versions"] == {"A": "1", "B": "2"}
    assert definition["split"] == {"A": 0.45, "B": 0.45}
    assert experiment.tags["ab.version.B"] == "2"


def test_analyze_logs_a_run_and_promote_moves_champion_to_the_winner(
    server: MlflowServer, config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["ab", "analyze", "--config", str(config_path), "--workdir", str(tmp_path / "w")]
    # The experiment recorded without --split: equal shares, versions pinned now (1 and 2).
    events = _events(tmp_path, "feed", lift=0.3)
    args = ["--experiment", "feed", "--events", str(events), "--start", "2026-01-01"]
    assert cli.main([*base, *args, "--promote"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("decision for feed: B wins")
    assert "promoted: champion -> version 2" in printed
    assert _champion(server) == "2"

    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("ab-feed")
    (run,) = client.search_runs([experiment.experiment_id])
    tags, metrics = run.data.tags, run.data.metrics
    assert tags["ab.decision"] == "winner" and tags["ab.winner"] == "B"
    assert (tags["ab.version.A"], tags["ab.version.B"]) == ("1", "2")
    assert tags["ab.promoted"] == "true" and tags["ab.srm"] == "ok"
    assert metrics["ctr.p_value"] < 0.01 and metrics["ctr.seq_low"] > 0
    assert {"srm_p_value", "ctr.ci_low", "ctr.rel", "ctr.mde", "users.A"} <= metrics.keys()
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"analysis.json", "lift.png"}
    registry.set_alias(client, MODEL, registry.CHAMPION, 1)


def test_no_decision_never_moves_champion(
    server: MlflowServer, config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = MlflowClient(server.uri)
    registry.set_alias(client, MODEL, registry.CHAMPION, 1)
    base = ["ab", "analyze", "--config", str(config_path), "--workdir", str(tmp_path / "w")]
    events = _events(tmp_path, "flat", lift=0.0, seed=3)
    args = ["--experiment", "flat", "--events", str(events), "--start", "2026-01-04"]
    assert cli.main([*base, *args, "--promote"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("decision for flat: no decision, too early")
    assert _champion(server) == "1"
    (run,) = client.search_runs([client.get_experiment_by_name("ab-flat").experiment_id])
    assert run.data.tags["ab.promoted"] == "false"


def test_bad_log_is_one_line_and_exit_code_3(
    config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("user_id,timestamp,clicks\nu1,2026-01-01,1\n")
    args = ["ab", "analyze", "--config", str(config_path), "--workdir", str(tmp_path / "w")]
    assert cli.main([*args, "--experiment", "bad", "--events", str(bad), "--no-log"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "variant" in err[0] and "Traceback" not in err[0]
