"""recsys.tracking.runs against a real `mlflow server` and the default local SQLite store."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
from pathlib import Path

import pytest
from mlflow import MlflowClient

from recsys.core.config import RecsysConfig, TrackingConfig
from recsys.core.errors import TrackingError
from recsys.tracking.runs import (
    HTTP_LIMITS,
    bounded_http_retries,
    default_tracking_uri,
    log_nightly_run,
    redact_credentials,
    resolve_tracking_uri,
)
from tests.mlflow_server import MlflowServer

RUN_DATE = dt.date(2026, 1, 5)
STATS = {"fingerprint": "fp-1234", "train_rows": 1500, "eval_rows": 150}
HISTORY = {"loss": [3.0, 2.0, 1.5], "regularization_loss": [0.1, 0.1, 0.1]}
METRICS = {"recall_at_10": 0.25, "ndcg@10": 0.125, "mrr_at_100": 0.1}
SECRET = "s3cret-t0ken"


def _artifacts(root: Path) -> list[Path]:
    """A file and a folder, like metrics.json and a model directory."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.json").write_text(json.dumps(METRICS))
    model = root / "model"
    (model / "variables").mkdir(parents=True)
    (model / "model.json").write_text('{"embedding_dim": 16}')
    (model / "variables" / "weights.bin").write_bytes(b"\x00\x01weights")
    return [root / "metrics.json", model]


def _with_tracking(config: RecsysConfig, uri: str | None, experiment: str) -> RecsysConfig:
    # A short probe backoff: the unreachable-server test need not wait 1 + 2 + 4 s.
    tracking = TrackingConfig(uri=uri, experiment=experiment, backoff_seconds=0.1)
    return config.model_copy(update={"tracking": tracking})


def _log(config: RecsysConfig, workdir: Path, **overrides: object) -> str:
    kwargs: dict[str, object] = {
        "workdir": workdir,
        "run_date": RUN_DATE,
        "stats": STATS,
        "history": HISTORY,
        "metrics": METRICS,
        "artifacts": _artifacts(workdir / "runs" / "r1"),
        **overrides,
    }
    return log_nightly_run(config, **kwargs)  # type: ignore[arg-type]


def test_logs_one_complete_run_to_a_server(
    server: MlflowServer, small_config: RecsysConfig, tmp_path: Path
) -> None:
    config = _with_tracking(small_config, server.uri, "exp-complete")
    run_id = _log(config, tmp_path, tags={"trigger": "cron"})

    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("exp-complete")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    run = runs[0]
    assert run.info.run_name == "nightly-2026-01-05"
    assert run.info.status == "FINISHED"

    params = run.data.params
    assert set(params) == set(config.flat())
    assert params["training.epochs"] == "2"
    assert params["evaluation.ks"] == "[10, 50]"
    assert params["model_name"] == "test-model"

    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [
        (0, 3.0),
        (1, 2.0),
        (2, 1.5),
    ]
    assert run.data.metrics["recall_at_10"] == 0.25
    assert run.data.metrics["ndcg_at_10"] == 0.125  # '@' is not allowed in MLflow names

    assert run.data.tags["run_date"] == "2026-01-05"
    assert run.data.tags["data_fingerprint"] == "fp-1234"
    assert run.data.tags["config_digest"] == config.digest()
    assert run.data.tags["model_name"] == "test-model"
    assert run.data.tags["trigger"] == "cron"

    top = {a.path for a in client.list_artifacts(run_id)}
    assert top == {"metrics.json", "model", "stats.json"}
    assert {a.path for a in client.list_artifacts(run_id, "model")} == {
        "model/model.json",
        "model/variables",
    }
    weights = client.download_artifacts(run_id, "model/variables/weights.bin", str(tmp_path))
    assert Path(weights).read_bytes() == b"\x00\x01weights"
    stats = client.download_artifacts(run_id, "stats.json", str(tmp_path))
    assert json.loads(Path(stats).read_text()) == STATS


def test_default_store_is_sqlite_under_the_workdir(
    small_config: RecsysConfig, tmp_path: Path
) -> None:
    workdir = tmp_path / "recsys-work"
    run_id = _log(small_config, workdir)

    uri = default_tracking_uri(workdir)
    assert uri == f"sqlite:///{workdir.resolve()}/mlflow/mlflow.db"
    assert (workdir / "mlflow" / "mlflow.db").is_file()
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(small_config.model_name)
    assert experiment is not None
    assert experiment.artifact_location == (workdir / "mlflow" / "artifacts").resolve().as_uri()
    assert client.get_run(run_id).data.tags["run_date"] == "2026-01-05"
    on_disk = workdir / "mlflow" / "artifacts" / run_id / "artifacts" / "model" / "model.json"
    assert on_disk.is_file()


def test_uri_precedence(
    small_config: RecsysConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_tracking_uri(small_config, tmp_path) == default_tracking_uri(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env-host:5000")
    assert resolve_tracking_uri(small_config, tmp_path) == "http://env-host:5000"
    configured = _with_tracking(small_config, "http://config-host:5000", "e")
    assert resolve_tracking_uri(configured, tmp_path) == "http://config-host:5000"


@pytest.mark.timeout(120)  # bounded: MLflow's defaults would retry for minutes
def test_unreachable_server_raises_tracking_error(
    small_config: RecsysConfig, tmp_path: Path
) -> None:
    # A bound but not listening socket: connections are refused and no one else gets the port.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        config = _with_tracking(small_config, f"http://bob:{SECRET}@127.0.0.1:{port}", "e")
        with pytest.raises(TrackingError) as caught:
            _log(config, tmp_path)
    message = str(caught.value)
    assert f"http://127.0.0.1:{port}" in message and "after 4 attempts" in message
    assert "outputs on disk" in message and "intact" in message
    assert SECRET not in message


def test_credentials_never_logged(
    server: MlflowServer, small_config: RecsysConfig, tmp_path: Path
) -> None:
    # The server has no auth, so it ignores the credentials; they must still not be recorded.
    with_secret = server.uri.replace("http://", f"http://alice:{SECRET}@")
    config = _with_tracking(small_config, with_secret, "exp-credentials")
    data = small_config.data.model_copy(update={"path": f"https://u:{SECRET}@data.example/log.csv"})
    config = config.model_copy(update={"data": data})
    run_id = _log(config, tmp_path, tags={"source": f"s3://key:{SECRET}@bucket/x"})

    run = MlflowClient(server.uri).get_run(run_id)
    recorded = json.dumps({**run.data.params, **run.data.tags})
    assert SECRET not in recorded
    assert run.data.params["tracking.uri"] == server.uri
    assert run.data.params["data.path"] == "https://data.example/log.csv"
    assert run.data.tags["source"] == "s3://bucket/x"


def test_http_limits_apply_only_inside_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in HTTP_LIMITS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")  # an operator's choice wins
    with bounded_http_retries():
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "3"
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "60"
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "60"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://u:p@host:5000/x", "http://host:5000/x"),
        ("postgresql://user:pw@db/mlflow", "postgresql://db/mlflow"),
        ("https://token@host", "https://host"),
        ("sqlite:////abs/mlflow.db", "sqlite:////abs/mlflow.db"),
        ("see http://a:b@h1 and https://c:d@h2/p", "see http://h1 and https://h2/p"),
        ("mail me at bob@example.com", "mail me at bob@example.com"),
    ],
)
def test_redact_credentials(text: str, expected: str) -> None:
    assert redact_credentials(text) == expected


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"metrics": {"recall#10": 1.0}}, "not valid in MLflow"),
        ({"metrics": {"loss": 1.0}}, "both in the per-epoch history"),
        ({"stats": {"rows": 1}}, "no 'fingerprint'"),
        ({"artifacts": [Path("/nonexistent/model")]}, "do not exist"),
    ],
)
def test_bad_inputs_fail_before_anything_is_written(
    small_config: RecsysConfig, tmp_path: Path, overrides: dict[str, object], fragment: str
) -> None:
    with pytest.raises(TrackingError, match=fragment):
        _log(small_config, tmp_path, **overrides)
    assert not (tmp_path / "mlflow").exists()


def test_rerun_is_idempotent_and_a_new_config_is_a_new_run(
    server: MlflowServer, small_config: RecsysConfig, tmp_path: Path
) -> None:
    config = _with_tracking(small_config, server.uri, "exp-idempotent")
    first = _log(config, tmp_path / "a", dataset_source=str(tmp_path / "data"))
    again = _log(config, tmp_path / "b", dataset_source=str(tmp_path / "data"))
    assert again == first
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("exp-idempotent")
    assert experiment is not None
    assert len(client.search_runs([experiment.experiment_id])) == 1
    assert len(client.get_metric_history(first, "loss")) == 3  # not logged twice
    run = client.get_run(first)
    assert [d.dataset.digest for d in run.inputs.dataset_inputs] == ["fp-1234"]
    assert run.data.tags["recsys.logged"] == "true"

    epochs = small_config.training.model_copy(update={"epochs": 7})
    other = _with_tracking(
        small_config.model_copy(update={"training": epochs}), server.uri, "exp-idempotent"
    )
    assert _log(other, tmp_path / "c") != first
    assert len(client.search_runs([experiment.experiment_id])) == 2


def test_an_interrupted_run_is_finished_not_duplicated(
    server: MlflowServer, small_config: RecsysConfig, tmp_path: Path
) -> None:
    config = _with_tracking(small_config, server.uri, "exp-resume")
    client = MlflowClient(server.uri)
    experiment_id = client.create_experiment("exp-resume")
    # What a crash half-way leaves: the run exists with its identity and some metrics.
    identity = {
        "run_date": RUN_DATE.isoformat(),
        "config_digest": config.digest(),
        "data_fingerprint": STATS["fingerprint"],
    }
    crashed = client.create_run(experiment_id, tags=identity).info.run_id
    client.log_metric(crashed, "loss", 3.0, step=0)
    assert _log(config, tmp_path) == crashed
    run = client.get_run(crashed)
    assert run.info.status == "FINISHED" and run.data.tags["recsys.logged"] == "true"
    assert len(client.get_metric_history(crashed, "loss")) == 1  # kept, not duplicated
    assert run.data.metrics["recall_at_10"] == 0.25
    assert len(client.search_runs([experiment_id])) == 1


def test_ab_record_logs_online_metrics_per_variant(
    server: MlflowServer, small_config: RecsysConfig, tmp_path: Path
) -> None:
    from recsys.tracking.runs import record_ab_metric

    config = _with_tracking(small_config, server.uri, "unused")
    kwargs = {"experiment": "homepage", "metric": "ctr"}
    a1 = record_ab_metric(config, tmp_path, variant="A", value=0.031, **kwargs)
    a2 = record_ab_metric(
        config, tmp_path, variant="A", value=0.033, date=dt.date(2026, 1, 6), **kwargs
    )
    b1 = record_ab_metric(config, tmp_path, variant="B", value=0.036, model_run_id="abc", **kwargs)
    assert a1 == a2 != b1
    client = MlflowClient(server.uri)
    history = client.get_metric_history(a1, "ctr")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.031), (1, 0.033)]
    run_b = client.get_run(b1)
    assert run_b.data.tags["ab.variant"] == "B" and run_b.data.tags["offline_run_id"] == "abc"
    assert client.get_experiment(run_b.info.experiment_id).name == "ab-homepage"
    with pytest.raises(TrackingError, match="not valid"):
        record_ab_metric(config, tmp_path, variant="A", value=1.0, experiment="x", metric="c#tr")
