"""MLflow tracking of nightly runs: one MLflow run per nightly run, via MLflow's own client.

Where runs go, first match wins: `tracking.uri` in the config, the MLFLOW_TRACKING_URI
environment variable, else a local SQLite store under the working directory
(`<workdir>/mlflow/mlflow.db`, artifacts in `<workdir>/mlflow/artifacts`). See mlflow/README.md.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import requests
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking.context.registry import resolve_tags

from recsys.config import RecsysConfig
from recsys.errors import TrackingError
from recsys.layout import Workdir

# MLflow's defaults (7 retries, backoff factor 2, 120 s timeout) keep a nightly job waiting for
# minutes on a dead server. These bound one request to ~10 s of retries when the connection is
# refused (~50 s if packets are dropped). An operator's own setting of a variable wins.
HTTP_LIMITS: dict[str, str] = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

# What MLflow's client raises when a store cannot be reached or written (HTTP, SQL, local files).
_TRACKING_FAILURES = (MlflowException, requests.RequestException, OSError)

# `scheme://user:password@host`: the user-info part is a credential and must never be logged.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/?#\s@]+@")
# MLflow's rule for metric names (mlflow.utils.validation), minus the platform-specific colon.
_VALID_METRIC = re.compile(r"^[\w./\- ]+$")


def redact_credentials(text: str) -> str:
    """`text` with the user:password part of every URI in it removed."""
    return _USERINFO.sub(r"\1", text)


def default_tracking_uri(workdir: Path) -> str:
    """The local SQLite store under the working directory (artifacts next to it)."""
    return f"sqlite:///{(Workdir(workdir).mlflow_store() / 'mlflow.db').resolve()}"


def resolve_tracking_uri(config: RecsysConfig, workdir: Path) -> str:
    """The tracking URI of a run: config, then MLFLOW_TRACKING_URI, then the local store."""
    return (
        config.tracking.uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or default_tracking_uri(workdir)
    )


def log_nightly_run(
    config: RecsysConfig,
    *,
    workdir: Path,
    run_date: dt.date,
    stats: dict[str, Any],
    history: dict[str, list[float]],
    metrics: dict[str, float],
    artifacts: list[Path],
    tags: dict[str, str] | None = None,
) -> str:
    """Record one nightly run in MLflow and return the MLflow run id.

    Params are the flattened config; `history` gives per-epoch metrics (step = 0-based epoch);
    `metrics` the final values; `artifacts` are files or folders; `stats` is also stored as
    stats.json. Raises TrackingError if the run could not be recorded; inputs are checked before
    anything is written, and a run that fails half-way is left with status FAILED.
    """
    uri = resolve_tracking_uri(config, workdir)
    run_tags = _run_tags(config, run_date, stats, tags or {})
    params = [Param(k, _param_value(v)) for k, v in config.flat().items()]
    metric_list = _metric_list(history, metrics)
    _check_artifacts(artifacts)
    experiment = config.tracking.experiment or config.model_name
    try:
        if uri == default_tracking_uri(workdir):
            Workdir(workdir).mlflow_store().mkdir(parents=True, exist_ok=True)
        with bounded_http_retries():
            client = MlflowClient(tracking_uri=uri)
            experiment_id = _ensure_experiment(client, experiment, uri, workdir)
            run_name = f"nightly-{run_date.isoformat()}"
            return _record_run(
                client, experiment_id, run_name, run_tags, params, metric_list, stats, artifacts
            )
    except _TRACKING_FAILURES as exc:
        raise _tracking_error(uri, workdir, exc) from None


@contextmanager
def bounded_http_retries() -> Iterator[None]:
    """Within the block, MLflow's HTTP retries/timeouts are HTTP_LIMITS unless set by the user."""
    added = [name for name in HTTP_LIMITS if name not in os.environ]
    # MLflow reads these variables on every request, so setting them for the block is enough.
    # Not thread-safe: the nightly pipeline logs from one thread.
    os.environ.update({name: HTTP_LIMITS[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _run_tags(
    config: RecsysConfig, run_date: dt.date, stats: Mapping[str, Any], extra: dict[str, str]
) -> dict[str, str]:
    if "fingerprint" not in stats:
        raise TrackingError(
            "stats has no 'fingerprint' (the Beam job's stats.json writes one): "
            "cannot tag the MLflow run with its data; nothing was logged"
        )
    ours = {
        "run_date": run_date.isoformat(),
        "data_fingerprint": str(stats["fingerprint"]),
        "config_digest": config.digest(),
        "model_name": config.model_name,
    }
    # Context tags (user, source, git commit) come from MLflow; the caller's and ours override.
    resolved = resolve_tags({**extra, **ours})
    return {key: redact_credentials(str(value)) for key, value in resolved.items()}


def _param_value(value: Any) -> str:
    # Lists/None as JSON so `[10, 50]` and `null` read back unambiguously.
    text = value if isinstance(value, str) else json.dumps(value)
    return redact_credentials(text)


def _metric_key(name: str) -> str:
    key = name.replace("@", "_at_")
    if not _VALID_METRIC.match(key) or ".." in key or key.startswith("/"):
        raise TrackingError(
            f"metric name {name!r} is not valid in MLflow (use letters, digits, _ - . / and "
            "spaces, e.g. 'recall_at_10'); nothing was logged"
        )
    return key


def _metric_list(history: dict[str, list[float]], final: dict[str, float]) -> list[Metric]:
    now = int(time.time() * 1000)
    per_epoch = {_metric_key(name): values for name, values in history.items()}
    finals = {_metric_key(name): value for name, value in final.items()}
    clash = sorted(per_epoch.keys() & finals.keys())
    if clash:
        # One key would hold both a curve and a final value, and MLflow's "latest" would be
        # whichever has the higher step: ambiguous, so the caller must name them apart.
        raise TrackingError(
            f"metrics {clash} appear both in the per-epoch history and the final metrics: "
            "rename one side (e.g. 'test_' prefix); nothing was logged"
        )
    metric_list = [
        Metric(key, _as_float(key, value), now, epoch)
        for key, values in per_epoch.items()
        for epoch, value in enumerate(values)
    ]
    metric_list += [Metric(key, _as_float(key, value), now, 0) for key, value in finals.items()]
    return metric_list


def _as_float(key: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TrackingError(
            f"metric {key!r} is not a number: {value!r}; nothing was logged"
        ) from None
    # NaN/inf are kept: MLflow stores them, and a diverged epoch should be visible, not dropped.
    return number


def _check_artifacts(artifacts: list[Path]) -> None:
    missing = [str(p) for p in artifacts if not Path(p).exists()]
    if missing:
        raise TrackingError(f"artifacts to log do not exist: {missing}; nothing was logged")


def _ensure_experiment(client: MlflowClient, name: str, uri: str, workdir: Path) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = _local_artifact_location(uri, workdir)
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException as exc:
            # Another process created it between our lookup and create: use theirs.
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise TrackingError(
            f"MLflow experiment {name!r} is deleted: restore it (`mlflow experiments restore "
            f"--experiment-id {experiment.experiment_id}`) or set tracking.experiment"
        )
    return experiment.experiment_id


def _local_artifact_location(uri: str, workdir: Path) -> str | None:
    """Artifacts of a SQLite store live under the workdir; servers choose their own."""
    if not uri.startswith("sqlite:"):
        return None
    artifacts = Workdir(workdir).mlflow_store() / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    return artifacts.resolve().as_uri()


def _record_run(
    client: MlflowClient,
    experiment_id: str,
    run_name: str,
    tags: dict[str, str],
    params: list[Param],
    metric_list: list[Metric],
    stats: dict[str, Any],
    artifacts: list[Path],
) -> str:
    run_id = client.create_run(experiment_id, tags=tags, run_name=run_name).info.run_id
    try:
        # log_batch splits into MLflow's per-request limits itself.
        client.log_batch(run_id, metrics=metric_list, params=params)
        client.log_dict(run_id, json.loads(json.dumps(stats, default=str)), "stats.json")
        for path in map(Path, artifacts):
            if path.is_dir():
                client.log_artifacts(run_id, str(path), artifact_path=path.name)
            else:
                client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    except _TRACKING_FAILURES:
        _mark_failed(client, run_id)
        raise
    return run_id


def _mark_failed(client: MlflowClient, run_id: str) -> None:
    # Best effort: the store may be the thing that failed; the original error is what matters.
    with suppress(_TRACKING_FAILURES):
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))


def _tracking_error(uri: str, workdir: Path, exc: Exception) -> TrackingError:
    # The first line names the cause; MLflow's full text repeats urllib3's retry history.
    reason = redact_credentials((str(exc).strip().splitlines() or [""])[0])
    reason = reason if len(reason) <= 300 else reason[:300] + "..."
    return TrackingError(
        f"could not record the run in MLflow at {redact_credentials(uri)} "
        f"({type(exc).__name__}: {reason}). The run's outputs on disk under {workdir} are "
        "intact; check the server (mlflow/README.md) or set tracking.uri / MLFLOW_TRACKING_URI"
    )
