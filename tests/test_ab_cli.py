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


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("recsys: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def _winning_log(experiment: str) -> pd.DataFrame:
    return sim.event_log(np.random.default_rng(0), users=3000, days=10, lift=0.3,
                         experiment=experiment)  # fmt: skip


def test_impossible_rows_are_rejected_with_a_reason_and_counted(
    config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frame = _winning_log("rows")
    period = frame[frame["timestamp"] >= pd.Timestamp("2026-01-01", tz="UTC")]
    # One control row with a million clicks on one impression outweighs 1,500 real users.
    control = period[period["variant"] == "A"].iloc[[0]].assign(clicks=1_000_000, impressions=1)
    negative = period[period["variant"] == "B"].iloc[[0]].assign(clicks=-5)
    events = tmp_path / "rows.parquet"
    pd.concat([frame, control, negative], ignore_index=True).to_parquet(events)
    out = tmp_path / "report"
    args = ["ab", "analyze", "--config", str(config_path), "--workdir", str(tmp_path / "w"),
            "--experiment", "rows", "--events", str(events), "--start", "2026-01-01",
            "--output", str(out), "--no-log"]  # fmt: skip
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert printed.strip().splitlines()[-1].startswith("decision for rows: B wins")
    rows = len(frame) + 2
    assert (f"rows.parquet: 2 of {rows} rows rejected as impossible "
            "(clicks_exceed_impressions 1, negative_clicks 1;") in printed  # fmt: skip
    rejected = pd.read_csv(out / "rejected.csv")
    assert sorted(rejected["reason"]) == ["clicks_exceed_impressions", "negative_clicks"]
    # A log with more impossible rows than the definition tolerates is refused.
    many = frame.assign(clicks=frame["impressions"] + 1)
    many.to_parquet(events)
    assert cli.main(args) == 3
    line = _error_line(capsys.readouterr().err)
    assert "rows are impossible (clicks_exceed_impressions" in line and "row 0" in line


def test_integer_epoch_seconds_are_read_as_seconds_and_the_unit_is_named(
    config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frame = _winning_log("epoch")
    # The form the preprocessing job reads: integer seconds since 1970.
    seconds = (frame["timestamp"] - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(seconds=1)
    events = tmp_path / "epoch.csv"
    frame.assign(timestamp=seconds.astype("int64")).to_csv(events, index=False)
    args = ["ab", "analyze", "--config", str(config_path), "--workdir", str(tmp_path / "w"),
            "--experiment", "epoch", "--events", str(events), "--start", "2026-01-01",
            "--no-log"]  # fmt: skip
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "2026-01-01..2026-01-10 (10 days)" in printed
    assert "epoch.csv: numeric timestamps read as seconds since 1970 UTC (by magnitude" in printed
    assert printed.strip().splitlines()[-1].startswith("decision for epoch: B wins")
    # Declared, the unit wins: the same numbers as milliseconds are all on 1970-01-21.
    assert cli.main([*args, "--timestamp-unit", "ms"]) == 3
    assert "no rows on or after the start date" in _error_line(capsys.readouterr().err)


def test_assign_keeps_one_row_per_user_by_a_stated_rule(
    config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = [f"u{i}" for i in range(199)] + ["007"]
    users = tmp_path / "users.csv"
    pd.DataFrame({"user_id": ids + ids[:50] + [" u1", "u1 "]}).to_csv(users, index=False)
    out = tmp_path / "assignment.csv"
    args = [
        "ab",
        "assign",
        "--config",
        str(config_path),
        "--workdir",
        str(tmp_path / "w"),
        "--experiment",
        "dedup",
        "--users",
        str(users),
        "--output",
        str(out),
        "--no-log",
    ]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert ("input:      200 unique of 252 rows (52 duplicates dropped, 2 ids stripped of "
            "surrounding whitespace)") in printed  # fmt: skip
    table = pd.read_csv(out, dtype={"user_id": str})
    assert len(table) == 200 and table["user_id"].is_unique
    assert sorted(table["user_id"]) == sorted(ids)  # '007' stays text, ' u1' is u1


def test_two_variants_on_one_version_are_refused_unless_asked(
    server: MlflowServer, config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert registry.alias_version(MlflowClient(server.uri), MODEL, "challenger").version == "2"
    users = tmp_path / "users.txt"
    users.write_text("u1\nu2\nu3\n")
    out = tmp_path / "assignment.csv"
    args = ["ab", "assign", "--config", str(config_path), "--workdir", str(tmp_path / "w"),
            "--experiment", "same", "--users", str(users), "--output", str(out),
            "--variants", "A=challenger,B=v2"]  # fmt: skip
    assert cli.main(args) == 2
    line = _error_line(capsys.readouterr().err)
    assert "variants A and B both serve registered version 2" in line
    assert "--allow-same-version" in line
    assert not out.exists()
    assert MlflowClient(server.uri).get_experiment_by_name("ab-same") is None  # not recorded
    assert cli.main([*args, "--allow-same-version"]) == 0
    assert "A=challenger (version 2), B=v2 (version 2)" in capsys.readouterr().out
