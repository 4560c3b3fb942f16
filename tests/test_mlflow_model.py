"""One tiny nightly against a real `mlflow server`, killed after its first epoch and resumed.

Watching a night: each epoch reaches the night's MLflow run as it ends (step = epoch), and the
resumed training continues the same series. The registered version is an MLflow Model:
`mlflow.pyfunc.load_model("models:/<name>@champion")` in a fresh process and `mlflow models
serve` over HTTP answer with the retrieval SavedModel's own top-k.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import yaml
from mlflow import MlflowClient

from conductor import cli
from conductor.promotion import _gate_against
from recsys.core.config import parse_config
from recsys.core.layout import RunFile, Workdir
from recsys.tracking import registry
from tests.conftest import SMALL, SMALL_DATE
from tests.mlflow_server import MlflowServer, free_port, mlflow_executable, stop_group

pytestmark = pytest.mark.slow

MODEL = "mlflow-model-test"
EPOCHS = 3
# Known and unknown users, a long, a short, an empty and a missing history.
USERS = ["u1", "u2", "never-seen", "u3"]
HISTORIES: list[list[str] | None] = [["i1", "i2", "i3"], [], ["i5"], None]


@dataclass(frozen=True)
class Night:
    """The finished night, what MLflow held after the kill, and the resumed run's stderr."""

    work: Path
    config: Path
    uri: str
    run_id: str
    after_kill: dict[str, list[int]]
    status_after_kill: str
    stderr: str


@pytest.fixture(scope="module")
def night(server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> Night:
    root = tmp_path_factory.mktemp("night")
    raw = {
        **SMALL,
        "model_name": MODEL,
        "training": {**SMALL["training"], "epochs": EPOCHS},
        "tracking": {"uri": server.uri, "retries": 2, "backoff_seconds": 0.2},
        "export": {**SMALL["export"], "verify": False},
    }
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    work = root / "work"
    args = ["nightly", "--config", str(config), "--workdir", str(work), "--date", SMALL_DATE]
    # First try: SIGKILLed right after its first epoch reached MLflow (and its checkpoint).
    env = {**os.environ, "RECSYS_FAULT": "train:epoch-logged:kill"}
    killed = subprocess.run(
        [sys.executable, "-m", "conductor.cli", *args], env=env, capture_output=True, text=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    client = MlflowClient(server.uri)
    runs = client.search_runs([client.get_experiment_by_name(MODEL).experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run_id = runs[0].info.run_id
    seen = {key: _steps(client, run_id, key) for key in ("loss", "epoch_seconds")}
    status = client.get_run(run_id).info.status
    # The rerun resumes from the checkpoint and finishes the night (in-process: TF loads once).
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(args) == 0, stderr.getvalue()[-3000:]
    return Night(work, config, server.uri, run_id, seen, status, stderr.getvalue())


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_each_epoch_reaches_mlflow_as_it_ends_and_a_resume_continues_it(night: Night) -> None:
    # While the night was down after its first epoch, that epoch was already in its run.
    assert night.after_kill == {"loss": [0], "epoch_seconds": [0]}
    assert night.status_after_kill == "RUNNING"
    client = MlflowClient(night.uri)
    published = client.get_run(night.run_id)  # the same run, completed by publishing
    assert published.data.tags["recsys.logged"] == "true"
    assert published.data.tags["registered_version"] == "1"
    # Each epoch once, at its own step: the resumed epochs after the first one, and
    # publishing (whose history file holds only the resumed epochs) added no second series.
    for key in ("loss", "val_loss", "val_recall_at_50", "epoch_seconds"):
        assert _steps(client, night.run_id, key) == list(range(EPOCHS)), key
    assert all(m.value > 0 for m in client.get_metric_history(night.run_id, "epoch_seconds"))


def test_the_resumed_night_shows_progress(night: Night) -> None:
    lines = night.stderr.splitlines()
    assert any(" train: " in line and "(100%)" in line for line in lines), night.stderr[-2000:]
    assert any(" evaluate: " in line and " users " in line for line in lines)
    assert any(" export: " in line and " steps " in line for line in lines)


def test_the_registered_version_is_an_mlflow_model_from_code(night: Night, tmp_path: Path) -> None:
    client = MlflowClient(night.uri)
    version = client.get_model_version_by_alias(MODEL, "champion")
    assert version.source.endswith(f"/{registry.MLFLOW_MODEL}")
    assert registry.legacy_reason(MODEL, version) is None
    local = Path(client.download_artifacts(version.run_id, registry.MLFLOW_MODEL, str(tmp_path)))
    spec = yaml.safe_load((local / "MLmodel").read_text())
    pyfunc = spec["flavors"]["python_function"]
    # Models from code: the code file, a SavedModel artifact, and nothing pickled.
    assert pyfunc["loader_module"] == "mlflow.pyfunc.loaders.code_model"
    assert (local / Path(pyfunc["model_code_path"]).name).is_file()
    assert (local / pyfunc["artifacts"]["retrieval"]["path"] / "saved_model.pb").is_file()
    assert not [p for p in local.rglob("*") if p.suffix in (".pkl", ".pickle")]
    assert json.loads(spec["signature"]["params"]) == [
        {"name": "k", "default": 10, "shape": None, "type": "long"}
    ]
    assert {c["name"] for c in json.loads(spec["signature"]["inputs"])} == {"user_id", "history"}
    # The example as a REST request: a known user with history, an unknown one without.
    info = spec["saved_input_example_info"]
    example = json.loads((local / info["serving_input_path"]).read_text())
    assert example["dataframe_split"]["columns"] == ["user_id", "history"]
    assert [row[0] for row in example["dataframe_split"]["data"]][1:] == ["new-user"]
    assert example["params"] == {"k": 10}


_LOAD = """
import json, sys
import mlflow, pandas as pd
users, histories = json.loads(sys.argv[1])
model = mlflow.pyfunc.load_model(f"models:/{sys.argv[2]}@champion")
frame = pd.DataFrame({"user_id": users, "history": histories})
answers = {"k3": model.predict(frame, params={"k": 3}).to_dict("list"),
           "default": model.predict(frame[["user_id"]]).to_dict("list")}
try:
    model.predict(frame, params={"k": 11})
except Exception as exc:
    answers["too_many"] = str(exc)
print(json.dumps(answers))
"""


def test_champion_loads_in_a_fresh_process_with_the_savedmodel_s_answers(night: Night) -> None:
    env = {**os.environ, "MLFLOW_TRACKING_URI": night.uri}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, json.dumps([USERS, HISTORIES]), MODEL],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    _assert_same(answers["k3"], _savedmodel(night, USERS, HISTORIES, 3))
    # No k: 10 (SMALL's export.top_k); no history column: no history.
    _assert_same(answers["default"], _savedmodel(night, USERS, [None] * len(USERS), 10))
    assert "k must be an integer from 1 to 10" in answers["too_many"]


def test_mlflow_models_serve_answers_an_http_request(night: Night, tmp_path: Path) -> None:
    request = {
        "dataframe_split": {"columns": ["user_id", "history"], "data": [["u1", ["i1", "i2"]]]},
        "params": {"k": 4},
    }
    with _model_server(f"models:/{MODEL}@champion", night.uri, tmp_path) as url:
        body = json.dumps(request).encode()
        post = urllib.request.Request(
            f"{url}/invocations", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(post, timeout=60) as response:
            predictions = json.loads(response.read())["predictions"]
    rows = {
        "item_ids": [p["item_ids"] for p in predictions],
        "scores": [p["scores"] for p in predictions],
    }
    _assert_same(rows, _savedmodel(night, ["u1"], [["i1", "i2"]], 4))


def test_a_champion_registered_before_mlflow_models_is_still_gated(night: Night) -> None:
    """A version whose source is the old `savedmodels/` folder: MLflow cannot load it (the
    registry says why), and the gate still re-evaluates it from its run."""
    client = MlflowClient(night.uri)
    current = client.get_model_version_by_alias(MODEL, "champion")
    run = client.get_run(current.run_id)
    legacy = client.create_model_version(
        MODEL, f"{run.info.artifact_uri}/{registry.SAVEDMODELS}", run_id=current.run_id
    )
    reason = registry.legacy_reason(MODEL, legacy)
    assert reason is not None and f"version {legacy.version}" in reason
    run_dir = Path(run.data.tags["run_dir"])
    data_dir = Path(run.data.tags["data_dir"])
    config = parse_config(yaml.safe_load((run_dir / RunFile.CONFIG).read_text()))
    decision = _gate_against(
        client, config, Workdir(night.work), run_dir, data_dir, legacy, force=False
    )
    assert decision.primary is not None, decision.reasons  # compared, not "cannot load"
    assert decision.primary.delta == 0.0  # the same model on the same users


def _savedmodel(
    night: Night, users: list[str], histories: list[list[str] | None], k: int
) -> dict[str, list[Any]]:
    """The exported retrieval SavedModel's answer (TF Serving's), trimmed to real items."""
    model = tf.saved_model.load(str(night.work / "export" / "retrieval" / "1"))
    rows = [h or [] for h in histories]
    width = max(len(h) for h in rows)
    padded = [h + [""] * (width - len(h)) for h in rows]
    out = model.signatures["serving_default"](
        user_id=tf.constant(users),
        history=tf.constant(padded, tf.string, shape=[len(users), width]),
        k=tf.fill([len(users)], k),
    )
    ids, scores = out["item_ids"].numpy(), out["scores"].numpy()
    return {
        "item_ids": [[i.decode() for i in row if i] for row in ids],
        "scores": [[float(s) for s, i in zip(srow, irow, strict=True) if i]
                   for srow, irow in zip(scores, ids, strict=True)],
    }  # fmt: skip


def _assert_same(got: dict[str, list[Any]], expected: dict[str, list[Any]]) -> None:
    assert got["item_ids"] == expected["item_ids"]
    for a, b in zip(got["scores"], expected["scores"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@contextlib.contextmanager
def _model_server(model_uri: str, tracking_uri: str, log_dir: Path) -> Iterator[str]:
    """`mlflow models serve --env-manager local` on 127.0.0.1; stopped with its group."""
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)  # it runs `uvicorn` from PATH
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": tracking_uri,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    command = [
        mlflow_executable(), "models", "serve", "-m", model_uri, "--env-manager", "local",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    log = log_dir / "models-serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                output = log.read_text(errors="replace")
                raise AssertionError(f"mlflow models serve exited: {output[-3000:]}")
            if _answers(f"{url}/ping"):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("mlflow models serve did not answer /ping within 300 s")
        yield url
    finally:
        stop_group(proc)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False  # not listening yet
