"""Shared fixtures: small generated data and configs, so most tests need no external files."""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conductor import stages
from recsys.core.config import ModelConfig, RecsysConfig, parse_config
from recsys.core.layout import DataFile, Workdir
from recsys.core.resolve import resolve_config
from recsys.model import TrainedModel
from recsys.synthetic import write_csv
from tests.mlflow_server import MlflowServer, mlflow_server
from tests.object_stores import ObjectStore, gcs_server, s3_server
from tests.postgres_server import PostgresServer, find_bin, postgres_server

REPO = Path(__file__).resolve().parent.parent


def _ml100k_folder() -> Path:
    """$RECSYS_ML100K, else the repository's datasets/ml-100k, else the CI machine's copy."""
    if os.environ.get("RECSYS_ML100K"):
        return Path(os.environ["RECSYS_ML100K"])
    local = REPO / "datasets" / "ml-100k"
    return local if (local / "u.data").is_file() else REPO.parent / "shared" / "data" / "ml-100k"


ML100K = _ml100k_folder()

SMALL = {
    "model_name": "test-model",
    "data": {
        "source": "synthetic",
        "synthetic": {
            "num_users": 150,
            "num_items": 80,
            "mean_interactions_per_user": 12,
            "days": 5,
            "start_date": "2026-01-01",
        },
    },
    "model": {"embedding_dim": 16},
    # One fit, of the model a test names: training.candidates (on by default) could keep
    # another model on so small a log; tests/test_candidates.py covers them.
    "training": {"batch_size": 128, "epochs": 2, "shuffle_buffer": 1000, "candidates": []},
    "evaluation": {"ks": [10, 50]},
    "export": {"top_k": 10},
}
SMALL_DATE = "2026-01-05"  # the last day of SMALL's synthetic log

# SMALL trains the default (benchmarked) model. Tests of a stage's plumbing rather than of the
# model pin these instead, the cheapest model the code offers: mean pooling, in-batch
# negatives, a per-user table and one fit without early stopping.
PLAIN_MODEL = {"query_encoder": "mean", "negatives": "in_batch", "user_embedding": True}
PLAIN_TRAINING = {
    "learning_rate_schedule": "constant",
    "early_stopping_patience": 0,
    "refit": "off",
}


def plain(raw: dict[str, Any]) -> dict[str, Any]:
    """A raw config (e.g. SMALL) with PLAIN_MODEL and PLAIN_TRAINING pinned."""
    model = {**raw.get("model", {}), **PLAIN_MODEL}
    return {**raw, "model": model, "training": {**raw.get("training", {}), **PLAIN_TRAINING}}


def plain_prepared(
    prepared: tuple[RecsysConfig, Workdir, Path],
) -> tuple[RecsysConfig, Workdir, Path]:
    """`prepared` with SMALL's config replaced by plain(SMALL) (same data), for a module whose
    tests check a stage's plumbing: it overrides its `prepared` fixture with this."""
    _, workdir, data_dir = prepared
    return parse_config(plain(SMALL)), workdir, data_dir


def decided(config: RecsysConfig, data_dir: Path) -> RecsysConfig:
    """`config` with its `auto` settings decided for data_dir's stats.json, as training does."""
    stats = json.loads((data_dir / DataFile.STATS).read_text())
    return resolve_config(config, stats).config


def build_model(data_dir: Path, model: ModelConfig) -> TrainedModel:
    """Untrained towers for data_dir's vocabularies; `auto` settings decided for its data."""
    users = (data_dir / DataFile.USER_VOCAB).read_text().split()
    items = (data_dir / DataFile.ITEM_VOCAB).read_text().split()
    return TrainedModel.build(users, items, decided(RecsysConfig(model=model), data_dir).model)


@pytest.fixture
def small_config() -> RecsysConfig:
    """A config whose whole pipeline runs in seconds."""
    return parse_config(SMALL)


@pytest.fixture
def small_csv(tmp_path: Path, small_config: RecsysConfig) -> Path:
    """SMALL's synthetic log as a CSV with header user_id,item_id,timestamp,weight."""
    return write_csv(small_config.data.synthetic, tmp_path / "raw" / "interactions.csv")


@pytest.fixture
def ml100k() -> Path:
    """The MovieLens 100K folder, or a skip naming where it was looked for."""
    if not (ML100K / "u.data").is_file():
        pytest.skip(f"MovieLens 100K not found at {ML100K} (datasets/README.md, or RECSYS_ML100K)")
    return ML100K


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[RecsysConfig, Workdir, Path]:
    """SMALL's synthetic log, preprocessed by the real Beam job once per test module."""
    import datetime as dt

    config = parse_config(SMALL)
    workdir = Workdir(tmp_path_factory.mktemp("work"))
    data_dir, _ = stages.preprocess(config, workdir, dt.date.fromisoformat(SMALL_DATE))
    return config, workdir, data_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One real `mlflow server` per test module that asks for it (it takes seconds to start)."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as running:
        yield running


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL cluster per test module that asks for it (skipped, with the reason,
    where PostgreSQL is not installed)."""
    bin_dir, reason = find_bin()
    if bin_dir is None:
        pytest.skip(reason)
    with postgres_server(bin_dir) as running:
        yield running


@pytest.fixture(autouse=True)
def _no_ambient_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's MLflow settings must not redirect or weaken the tests."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObjectStore]:
    """moto's S3 server on 127.0.0.1, once per session (tests/object_stores.py)."""
    with s3_server(tmp_path_factory.mktemp("s3")) as running:
        yield running


@pytest.fixture(scope="session")
def gcs_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObjectStore]:
    """fake-gcs-server on 127.0.0.1, once per session (tests/object_stores.py)."""
    with gcs_server(tmp_path_factory.mktemp("gcs")) as running:
        yield running


@pytest.fixture(params=["s3", "gs"])
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    """Each object store in turn, with the standard environment pointing at it."""
    running = request.getfixturevalue("s3_store" if request.param == "s3" else "gcs_store")
    use_store(running, monkeypatch)
    return running


def use_store(running: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point this process's standard storage environment at `running` (and only there)."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in running.env.items():
        monkeypatch.setenv(name, value)
