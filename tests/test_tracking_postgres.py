"""Tracking as production runs it: `mlflow server` on PostgreSQL, artifacts proxied to S3, auth.

A real PostgreSQL (tests/postgres_server.py: initdb + pg_ctl, skipped with the reason when the
OS package is missing) and real `mlflow server` processes. Runs are published with the nightly's
own code (conductor.promotion.publish_run) from hand-built run folders, as in
tests/test_tracking_registry.py.
"""

from __future__ import annotations

import configparser
import json
import multiprocessing
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import ViewType
from mlflow.exceptions import MlflowException

from conductor.promotion import PENDING, publish_run
from recsys.core import storage
from recsys.core.config import RecsysConfig
from recsys.core.errors import TrackingError
from recsys.core.layout import Workdir
from recsys.tracking import registry
from tests.conftest import SMALL, use_store
from tests.mlflow_server import MlflowServer, free_port, mlflow_server
from tests.object_stores import ObjectStore
from tests.postgres_server import PostgresServer, count, create_database
from tests.test_tracking_registry import DATE, PER_USER, configured, fake_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def artifact_bucket(s3_store: ObjectStore) -> str:
    """Where the server keeps artifacts: an S3 bucket (moto's server on 127.0.0.1)."""
    return f"{s3_store.new_bucket()}/mlflow-artifacts"


@pytest.fixture(scope="module")
def server(
    postgres: PostgresServer,
    tmp_path_factory: pytest.TempPathFactory,
    s3_store: ObjectStore,
    artifact_bucket: str,
) -> Iterator[MlflowServer]:
    """The production form: PostgreSQL metadata, artifacts proxied into the S3 bucket.

    Only the server has the bucket's endpoint and credentials; clients upload through it.
    """
    root = tmp_path_factory.mktemp("mlflow-pg")
    with mlflow_server(
        root, backend_uri=postgres.uri, serve_artifacts=True,
        artifacts_destination=artifact_bucket, env=s3_store.env,
    ) as running:  # fmt: skip
        yield running


def _config(uri: str, model: str) -> RecsysConfig:
    from recsys.core.config import parse_config

    return configured(parse_config(SMALL), uri, model)


def test_publish_on_postgres_with_artifacts_proxied_to_s3(
    server: MlflowServer,
    postgres: PostgresServer,
    artifact_bucket: str,
    s3_store: ObjectStore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The client has no S3 endpoint or credentials: every artifact goes through the server.
    for name in s3_store.env:
        monkeypatch.delenv(name, raising=False)
    config = _config(server.uri, "pg-first")
    workdir = Workdir(tmp_path)
    result = publish_run(config, workdir, DATE, fake_run(workdir, config, DATE, PER_USER))
    assert (result.version, result.champion_version) == ("1", "1")
    client = MlflowClient(server.uri)
    run = client.get_run(result.mlflow_run_id)
    # Proxied: the client only knows the server's artifact URI, the server stores the bytes.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    downloaded = Path(
        client.download_artifacts(result.mlflow_run_id, "metrics.json", str(tmp_path))
    )
    assert json.loads(downloaded.read_text())["model"]
    use_store(s3_store, monkeypatch)
    stored = {name.rsplit("/", 1)[-1] for name in storage.list_files(artifact_bucket)}
    assert {"metrics.json", "per_user_eval.parquet", "saved_model.pb"} <= stored
    assert not (server.root / "artifacts").exists()
    # ... and the metadata lives in PostgreSQL, not in a file next to the server.
    query = f"SELECT count(*) FROM runs WHERE run_uuid = '{result.mlflow_run_id}'"
    assert count(postgres.uri, query) == 1
    assert not (server.root / "mlflow.db").exists()


def _publish_in_child(uri: str, model: str, root: str) -> tuple[str, str]:
    """One nightly's publish, in its own process (spawned: a fresh interpreter)."""
    config = _config(uri, model)
    workdir = Workdir(Path(root))
    result = publish_run(config, workdir, DATE, fake_run(workdir, config, DATE, PER_USER))
    return result.mlflow_run_id, result.version


def test_two_nightlies_of_different_models_publish_at_once(
    server: MlflowServer, tmp_path: Path
) -> None:
    models = ["pg-nightly-a", "pg-nightly-b"]
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        jobs = [
            pool.apply_async(_publish_in_child, (server.uri, m, str(tmp_path / m))) for m in models
        ]
        results = [job.get(timeout=300) for job in jobs]
    client = MlflowClient(server.uri)
    for model, (run_id, version) in zip(models, results, strict=True):
        assert version == "1"
        versions = client.search_model_versions(f"name = '{model}'")
        assert [v.run_id for v in versions] == [run_id]
        assert registry.alias_version(client, model, registry.CHAMPION).run_id == run_id
        experiment = client.get_experiment_by_name(model)
        runs = client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL)
        assert [r.info.run_id for r in runs] == [run_id]
        assert runs[0].info.status == "FINISHED"


def test_server_restarted_mid_publish_completes_on_retry_without_duplicates(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    root, port = tmp_path / "server", free_port()
    config = _config(f"http://127.0.0.1:{port}", "pg-restart")
    workdir = Workdir(tmp_path / "work")
    run_dir = fake_run(workdir, config, DATE, PER_USER)
    # A large model file keeps the upload busy long enough to stop the server under it.
    (run_dir / "model" / "weights.bin").write_bytes(b"\x01" * (48 << 20))
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            publish_run(config, workdir, DATE, run_dir)
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    experiment_runs = (
        "SELECT count(*) FROM runs r JOIN experiments e ON r.experiment_id = e.experiment_id "
        "WHERE e.name = 'pg-restart'"
    )
    with mlflow_server(root, port=port, backend_uri=postgres.uri, serve_artifacts=True):
        worker = threading.Thread(target=publish)
        worker.start()
        deadline = time.monotonic() + 120
        while count(postgres.uri, experiment_runs) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    # Leaving the block killed the server's process group: the publish is cut mid-way.
    worker.join(timeout=180)
    assert not worker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], TrackingError), errors
    assert (run_dir / PENDING).is_file()
    logged = "SELECT count(*) FROM tags WHERE key = 'recsys.logged' AND value = 'true'"
    assert count(postgres.uri, experiment_runs) == 1
    before = count(postgres.uri, logged)

    with mlflow_server(root, port=port, backend_uri=postgres.uri, serve_artifacts=True) as again:
        result = publish_run(config, workdir, DATE, run_dir)
        client = MlflowClient(again.uri)
        experiment = client.get_experiment_by_name("pg-restart")
        runs = client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL)
        assert [r.info.run_id for r in runs] == [result.mlflow_run_id]
        assert runs[0].info.status == "FINISHED"
        assert runs[0].data.tags["recsys.logged"] == "true"
        versions = client.search_model_versions("name = 'pg-restart'")
        assert [v.version for v in versions] == ["1"]
        weights = client.download_artifacts(result.mlflow_run_id, "trained_model/weights.bin")
        assert Path(weights).stat().st_size == 48 << 20
    assert count(postgres.uri, logged) == before + 1
    assert not (run_dir / PENDING).exists()


def _auth_config(path: Path, database_uri: str) -> Path:
    parser = configparser.ConfigParser()
    parser["mlflow"] = {
        "default_permission": "READ",
        "database_uri": database_uri,
        "admin_username": "admin",
        "admin_password": "admin-password-1234",
        "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
    }
    with path.open("w") as handle:
        parser.write(handle)
    return path


def test_basic_auth_nightly_writes_reader_cannot(
    postgres: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth_db = create_database(postgres, "mlflow_auth")
    auth_ini = _auth_config(tmp_path / "auth.ini", auth_db)
    env = {"MLFLOW_AUTH_CONFIG_PATH": str(auth_ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": "test"}
    with mlflow_server(
        tmp_path / "server", backend_uri=postgres.uri, serve_artifacts=True,
        app_name="basic-auth", env=env,
    ) as server:  # fmt: skip
        from mlflow.server import get_app_client

        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "admin-password-1234")
        admin = get_app_client("basic-auth", tracking_uri=server.uri)
        admin.create_user("nightly", "nightly-password-1234")
        admin.create_user("reader", "reader-password-1234")

        monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
        monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
        with pytest.raises(MlflowException, match=r"401|nauthori|credentials"):
            MlflowClient(server.uri).search_experiments()

        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "nightly")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "nightly-password-1234")
        config = _config(server.uri, "pg-auth")
        workdir = Workdir(tmp_path / "work")
        result = publish_run(config, workdir, DATE, fake_run(workdir, config, DATE, PER_USER))
        assert result.version == "1"

        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "reader")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "reader-password-1234")
        reader = MlflowClient(server.uri)
        run = reader.get_run(result.mlflow_run_id)  # reading is allowed (default READ)
        assert run.data.tags["registered_version"] == "1"
        with pytest.raises(MlflowException, match=r"PERMISSION_DENIED|403|ermission"):
            reader.log_metric(result.mlflow_run_id, "tampered", 1.0)
        with pytest.raises(MlflowException, match=r"PERMISSION_DENIED|403|ermission"):
            reader.set_registered_model_alias("pg-auth", "champion", "1")
        # The nightly's own code, as the reader: refused, named as a tracking failure.
        with pytest.raises(TrackingError):
            publish_run(config, workdir, DATE, fake_run(workdir, config, DATE, PER_USER,
                                                        fingerprint="fp-2"))  # fmt: skip
