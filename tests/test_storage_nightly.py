"""Bucket to bucket: the CLI with its input and its working directory in object storage.

Real servers on 127.0.0.1 (moto's S3, fake-gcs-server, `mlflow server`), the real `recsys`
CLI in its own process, reaching the stores only through the standard environment. A second
machine is played by a second local copy (`RECSYS_CACHE_DIR`): what it sees is what the
bucket holds, committed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from recsys.core import mirror, storage
from recsys.core.config import parse_config
from recsys.synthetic import write_csv
from tests.conftest import SMALL, SMALL_DATE, use_store
from tests.mlflow_server import MlflowServer
from tests.object_stores import ACCESS_KEY_ID, SECRET_ACCESS_KEY, ObjectStore

pytestmark = pytest.mark.slow

MODELS = ("query", "candidate", "retrieval")


def recsys(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI in its own process, with `env` added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "conductor.cli", *args],
        capture_output=True, text=True, timeout=900, env={**os.environ, **env},
    )  # fmt: skip


def committed_view(uri: str, where: Path) -> Path:
    """What a reader of the bucket gets: its committed state, in a fresh local folder."""
    mirror.Mirror(uri, where).pull()
    return where


def _raw_in_bucket(store: ObjectStore, tmp_path: Path) -> tuple[str, str]:
    """SMALL's synthetic log uploaded to a new bucket: (bucket, log URI)."""
    log = write_csv(parse_config(SMALL).data.synthetic, tmp_path / "raw" / "log.csv")
    bucket = store.new_bucket()
    storage.write_bytes(f"{bucket}/raw/events.csv", log.read_bytes())
    return bucket, f"{bucket}/raw/events.csv"


def test_nightly_from_and_into_an_s3_bucket(
    s3_store: ObjectStore,
    server: MlflowServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    use_store(s3_store, monkeypatch)
    bucket, log_uri = _raw_in_bucket(s3_store, tmp_path)
    work = f"{bucket}/work"
    config = tmp_path / "config.yaml"
    raw = {**SMALL, "tracking": {"uri": server.uri}, "gate": {"bootstrap_samples": 200}}
    config.write_text(yaml.safe_dump(raw))
    env = {**s3_store.env, "RECSYS_CACHE_DIR": str(tmp_path / "machine-a")}
    common = ["--config", str(config), "--workdir", work, "--date", SMALL_DATE]
    first = recsys(env, "nightly", *common, "--input", log_uri)
    assert first.returncode == 0, first.stderr[-4000:]
    assert f"data:        {work}/data/{SMALL_DATE}" in first.stdout
    assert f"savedmodel:  retrieval -> {work}/export/retrieval/1" in first.stdout

    view = committed_view(work, tmp_path / "reader")
    data = view / "data" / SMALL_DATE
    stats = json.loads((data / "stats.json").read_text())
    assert stats["input_files"] == [{"path": log_uri, "bytes": stats["input_files"][0]["bytes"]}]
    assert (data / "_SUCCESS.preprocess").is_file()
    assert sorted(p.name for p in (view / "embeddings").iterdir()) == ["1"]
    for name in MODELS:
        assert (view / "export" / name / "1" / "saved_model.pb").is_file()
        assert storage.committed(f"{work}/export/{name}/1") is not None
    served = (view / "export" / "models.config").read_text()
    assert f'base_path: "{work}/export/retrieval"' in served  # TF Serving reads the bucket
    run = next((view / "runs" / SMALL_DATE).iterdir())
    assert json.loads((run / "train.json").read_text())["data_dir"] == f"{work}/data/{SMALL_DATE}"
    assert not list(view.rglob(".backup-*")) and not (view / "mlflow").exists()

    # Another machine (an empty local copy) finds every stage done: the bucket holds it all.
    env_b = {**env, "RECSYS_CACHE_DIR": str(tmp_path / "machine-b")}
    again = recsys(env_b, "nightly", *common, "--input", log_uri)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"nightly {SMALL_DATE}: already done, nothing to do" in again.stdout

    # A read-only command on another machine, writing its output into the bucket.
    exported = recsys(env_b, "embeddings", "export", "--workdir", work, "--version", "1",
                      "--format", "npy", "--output", f"{bucket}/index-input")  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"wrote:       {bucket}/index-input/" in exported.stdout
    listed = storage.committed(f"{bucket}/index-input") or {}
    assert any(name.endswith(".npy") for name in listed)

    client = MlflowClient(server.uri)
    mlflow_run = client.get_run(json.loads((run / "_SUCCESS.publish").read_text())["mlflow_run_id"])
    assert mlflow_run.data.tags["run_dir"] == f"{work}/runs/{SMALL_DATE}/{run.name}"
    # The credentials were in the environment of every process: they are in nothing written.
    texts = [first.stdout, first.stderr, again.stdout, again.stderr,
             json.dumps(mlflow_run.data.params), json.dumps(mlflow_run.data.tags)]  # fmt: skip
    texts += [p.read_bytes().decode("latin-1") for p in view.rglob("*") if p.is_file()]
    texts += [p.read_bytes().decode("latin-1") for p in (tmp_path / "machine-a").rglob("*")
              if p.is_file()]  # fmt: skip
    for secret in (SECRET_ACCESS_KEY, ACCESS_KEY_ID):
        assert not [t for t in texts if secret in t]


def test_stages_one_by_one_in_a_gcs_bucket(
    gcs_store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_store(gcs_store, monkeypatch)
    bucket, log_uri = _raw_in_bucket(gcs_store, tmp_path)
    work = f"{bucket}/work"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**SMALL, "training": {**SMALL["training"], "epochs": 1}}))
    common = ["--config", str(config), "--workdir", work, "--date", SMALL_DATE]
    for step, cache in (("preprocess", "a"), ("train", "b"), ("evaluate", "c")):
        # Each stage on another machine: it reads the previous one's output from the bucket.
        env = {**gcs_store.env, "RECSYS_CACHE_DIR": str(tmp_path / cache)}
        done = recsys(env, step, *common, "--input", log_uri)
        assert done.returncode == 0, f"{step}: {done.stderr[-3000:]}"
    view = committed_view(work, tmp_path / "reader")
    run = next((view / "runs" / SMALL_DATE).iterdir())
    assert json.loads((run / "metrics.json").read_text())["model"]["recall_at_10"] >= 0
    assert (run / "_SUCCESS").is_file() and (view / "data" / SMALL_DATE / "_SUCCESS").is_file()
    assert "metrics: " + f"{work}/runs/{SMALL_DATE}/{run.name}/metrics.json" in done.stdout


def test_a_bucket_workdir_needs_a_tracking_server(s3_store: ObjectStore, tmp_path: Path) -> None:
    work = f"{s3_store.new_bucket()}/work"
    env = {**s3_store.env, "RECSYS_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = recsys(env, "nightly", "--workdir", work, "--date", SMALL_DATE)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("recsys: error")]
    assert len(errors) == 1 and "set tracking.uri" in errors[0]
