"""MLflow tracking of nightly runs: one MLflow run per nightly run, via MLflow's own client.

Where runs go, first match wins: `tracking.uri` in the config, the MLFLOW_TRACKING_URI
environment variable, else a local SQLite store under the working directory
(`<workdir>/mlflow/mlflow.db`, artifacts in `<workdir>/mlflow/artifacts`). See mlflow/README.md.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import socket
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import requests
import yaml
from mlflow import MlflowClient
from mlflow.entities import Dataset as DatasetEntity
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunStatus, ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracking.context.registry import resolve_tags
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import NoSuchModuleError, OperationalError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from recsys.core.config import RecsysConfig
from recsys.core.errors import TrackingError
from recsys.core.faults import fault_point
from recsys.core.layout import DataFile, Workdir
from recsys.core.redact import redact_text, redact_tree, redact_value

log = logging.getLogger(__name__)

# MLflow's defaults (7 retries, backoff factor 2, 120 s timeout) keep a nightly job waiting for
# minutes on a dead server. These bound one request to ~10 s of retries when the connection is
# refused (~50 s if packets are dropped). An operator's own setting of a variable wins.
HTTP_LIMITS: dict[str, str] = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

_SUPPRESS_URL = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"

# What MLflow's client raises when a store cannot be reached or written (HTTP, SQL, local files).
# What an unreachable or failing tracking server raises; callers map it with tracking_error.
TRACKING_FAILURES = (MlflowException, requests.RequestException, OSError)

# MLflow's rule for metric names (mlflow.utils.validation), minus the platform-specific colon.
_VALID_METRIC = re.compile(r"^[\w./\- ]+$")


def redact_credentials(text: str) -> str:
    """`text` without URI user:password parts and other secrets (see recsys.core.redact)."""
    return redact_text(text)


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


_STORE_TMP = ".tmp-mlflow-"  # a store being created (recsys.core.layout.TEMP_PREFIXES style)

# Tags that identify one nightly run: same date, config and data -> the same MLflow run.
IDENTITY_TAGS = ("run_date", "config_digest", "data_fingerprint")
# ... and, when given, the run folder: a run trained again into a new folder is a new run.
RUN_FOLDER_TAG = "run_folder"
# Set last, once everything was logged: a run without it is resumed, not skipped.
LOGGED_TAG = "recsys.logged"
DEFAULT_DEVICE = {"strategy": "one_device", "replicas": "1", "precision": "float32"}

Artifact = Path | tuple[Path, str]
"""A file or folder to log; with a string, under that artifact folder (a folder: as it)."""


def log_nightly_run(
    config: RecsysConfig,
    *,
    workdir: Path,
    run_date: dt.date,
    stats: dict[str, Any],
    history: dict[str, list[float]],
    metrics: dict[str, float],
    artifacts: Sequence[Artifact],
    tags: dict[str, str] | None = None,
    dataset_source: str | None = None,
    tracking_uri: str | None = None,
    params: Mapping[str, Any] | None = None,
) -> str:
    """Record one nightly run in MLflow and return the MLflow run id (idempotent).

    Params are `params` (the run's resolved settings: recsys.core.resolve.mlflow_params),
    else the flattened config; `history` gives per-epoch metrics (step = 0-based epoch);
    `metrics` the final values; `artifacts` are files or folders; `stats` is also stored as
    stats.json; `dataset_source` (the data folder) is recorded as an MLflow dataset input whose
    digest is the data fingerprint. A run with the same date, config digest and data fingerprint
    is reused: skipped if fully logged, else finished. Raises TrackingError if the run could not
    be recorded; inputs are checked before anything is written.
    """
    uri = tracking_uri or resolve_tracking_uri(config, workdir)
    run_tags = nightly_run_tags(config, run_date, stats, tags or {})
    values = config.flat() if params is None else params
    param_list = [Param(k, _param_value(v, k)) for k, v in values.items()]
    metric_list = _metric_list(history, metrics)
    _check_artifacts(artifacts)
    experiment = experiment_name(config)
    try:
        client = connect(config, workdir, uri)
        with bounded_http_retries():
            experiment_id = ensure_experiment(client, experiment, uri, workdir)
            run_id, logged = nightly_run(client, experiment_id, run_tags, run_date)
            if logged:
                return run_id  # already complete: a rerun changes nothing
            _record_run(
                client, run_id, run_tags, param_list, metric_list, stats, artifacts,
                _dataset_input(dataset_source, run_tags["data_fingerprint"]),
            )  # fmt: skip
            return run_id
    except TRACKING_FAILURES as exc:
        raise tracking_error(uri, workdir, exc) from None


def nightly_run(
    client: MlflowClient, experiment_id: str, run_tags: Mapping[str, str], run_date: dt.date
) -> tuple[str, bool]:
    """The run of these identity tags, found or created, and whether it is completely logged.

    Training opens it to log each epoch as it ends (recsys.tracking.live); publishing finds
    the same run and completes it.
    """
    run_id = find_nightly_run(client, experiment_id, run_tags)
    if run_id is None:
        created = client.create_run(
            experiment_id, tags=dict(run_tags), run_name=f"nightly-{run_date.isoformat()}"
        )
        return created.info.run_id, False
    return run_id, client.get_run(run_id).data.tags.get(LOGGED_TAG) == "true"


OWNER_TAG = "recsys.owner"
"""Run tag `<host>:<workdir>` naming where the recsys process that created a run worked."""
PID_TAG = "recsys.pid"


def owner_tags(workdir: Path) -> dict[str, str]:
    """Tags for a run this process creates: its host and working directory, and its pid."""
    owner = f"{socket.gethostname()}:{Path(workdir).resolve()}"
    return {OWNER_TAG: owner, PID_TAG: str(os.getpid())}


def end_abandoned_runs(client: MlflowClient, workdir: Path, *, dry_run: bool = False) -> list[str]:
    """Mark KILLED the runs still RUNNING that recsys processes of this workdir left.

    The caller holds the working directory's lock, so no recsys process of this host and
    workdir is running now: a run of theirs still RUNNING was left by a killed process.
    Runs of other hosts or workdirs are not touched. Returns a line per run (ended or, with
    `dry_run`, to end).
    """
    owner = owner_tags(workdir)[OWNER_TAG]
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = []
    for start in range(0, len(experiments), 100):  # MLflow's limit of experiments per search
        runs = client.search_runs(
            experiments[start : start + 100], filter_string="attributes.status = 'RUNNING'"
        )
        found += [r for r in runs if r.data.tags.get(OWNER_TAG) == owner]
    lines = []
    for run in found:
        if not dry_run:
            client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.KILLED))
        lines.append(
            f"run {run.info.run_id} ({run.info.run_name}, experiment {run.info.experiment_id}, "
            f"pid {run.data.tags.get(PID_TAG, '?')}) was left RUNNING by a process that is gone"
        )
    return lines


def supersede_unpublished(
    client: MlflowClient, experiment_id: str, run_tags: Mapping[str, str], keep: str
) -> list[str]:
    """Delete the runs a training of this workdir left unpublished in another run folder.

    Same identity (date, config, data) and owner (host and workdir, whose lock the caller
    holds), still RUNNING, never completely logged, another run folder: a training that was
    stopped and now starts again in a new folder (a bucket workdir names one per attempt).
    Returns the deleted run ids (restorable with `mlflow runs restore`).
    """
    if OWNER_TAG not in run_tags:
        return []
    keys = [*IDENTITY_TAGS, OWNER_TAG]
    query = " and ".join(f"tags.`{key}` = '{run_tags[key]}'" for key in keys)
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"{query} and attributes.status = 'RUNNING'",
        run_view_type=ViewType.ACTIVE_ONLY,
    )
    stale = [
        run.info.run_id
        for run in runs
        if run.info.run_id != keep
        and run.data.tags.get(LOGGED_TAG) != "true"
        and run.data.tags.get(RUN_FOLDER_TAG) != run_tags.get(RUN_FOLDER_TAG)
    ]
    for run_id in stale:
        client.set_tag(run_id, "recsys.superseded", "true")
        client.delete_run(run_id)
    return stale


def experiment_name(config: RecsysConfig) -> str:
    """The MLflow experiment of a model's nightly runs: tracking.experiment, else model_name."""
    return config.tracking.experiment or config.model_name


def connect(
    config: RecsysConfig, workdir: Path, uri: str | None = None, attempts: int | None = None
) -> MlflowClient:
    """A client for the run's tracking store; a server is probed first (`attempts` tries with
    backoff, default `tracking.retries`)."""
    uri = uri or resolve_tracking_uri(config, workdir)
    if uri == default_tracking_uri(workdir):
        ensure_local_store(workdir)
    if uri.startswith(("http://", "https://")):
        tries = attempts or config.tracking.retries
        wait_for_server(uri, workdir, tries, config.tracking.backoff_seconds)
    return MlflowClient(tracking_uri=uri)


def ensure_local_store(workdir: Path) -> Path:
    """The local SQLite store, created crash-safe: migrated aside, then renamed into place.

    MLflow creates its tables and runs a few dozen migrations on first use; a process killed
    in between left a half-migrated `mlflow.db` that no later run could open ("table ...
    already exists"). Here the store is built as a temporary file and appears under its name
    by one rename only when complete, so `mlflow.db` is either absent or whole. A temporary
    file of a killed creation is removed by the next one (under the workdir lock).
    """
    folder = Workdir(workdir).mlflow_store()
    store = folder / "mlflow.db"
    folder.mkdir(parents=True, exist_ok=True)
    if store.exists():
        return store
    for leftover in folder.glob(f"{_STORE_TMP}*"):
        leftover.unlink(missing_ok=True)
    tmp = folder / f"{_STORE_TMP}{uuid.uuid4().hex[:8]}.db"
    log.info("creating the local MLflow store %s", store)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp.resolve()}")
    client.search_experiments(max_results=1)  # creates the tables and runs the migrations
    client.search_registered_models(max_results=1)
    fault_point("tracking:store-migrated", tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, store)
    return store


def check_tracking_store(config: RecsysConfig, workdir: Path, uri: str | None = None) -> str:
    """Check the tracking store before any work; returns its URI, else TrackingError (exit 6).

    A server must answer and accept the credentials (MLFLOW_TRACKING_USERNAME/PASSWORD or
    TOKEN); a database store's driver must import and the database accept a connection. The
    local store under the working directory needs neither (it is created on first write).
    Nothing is created or written; the message never holds a password (redact_text).
    """
    uri = uri or resolve_tracking_uri(config, workdir)
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    try:
        with bounded_http_retries():
            if scheme in ("http", "https"):
                wait_for_server(uri, workdir, config.tracking.retries,
                                config.tracking.backoff_seconds)  # fmt: skip
                MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
            elif scheme in _DATABASES:
                _check_database(uri, config.tracking.retries, config.tracking.backoff_seconds)
    except TrackingError:
        raise
    except (*TRACKING_FAILURES, ImportError, SQLAlchemyError) as exc:
        raise store_error(uri, exc) from None
    return uri


# SQLAlchemy dialects MLflow's database store accepts (mlflow.store.db.db_types).
_DATABASES = ("postgresql", "mysql", "mssql")


def _check_database(uri: str, attempts: int, backoff_seconds: float) -> None:
    """The driver imports and the database accepts a connection (tries with backoff)."""
    url = make_url(uri)
    try:
        url.get_dialect().import_dbapi()
    except (ImportError, NoSuchModuleError) as exc:
        installed = (
            " (e.g. postgresql+psycopg2://...)" if url.get_backend_name() == "postgresql" else ""
        )
        raise TrackingError(
            f"the MLflow tracking store {redact_credentials(uri)} needs the database driver of "
            f"{url.drivername!r}, which is not installed ({type(exc).__name__}: {exc}); name an "
            f"installed driver in tracking.uri{installed} or install it. Nothing was started"
        ) from None
    timeout = {"connect_timeout": 10} if url.get_backend_name() in ("postgresql", "mysql") else {}
    engine = create_engine(url, connect_args=timeout, poolclass=NullPool)
    try:
        for attempt in range(max(attempts, 1)):
            try:
                with engine.connect():
                    return
            except OperationalError as exc:
                # Wrong credentials do not get better by waiting.
                if _refused_credentials(exc) or attempt + 1 >= attempts:
                    raise
            time.sleep(backoff_seconds * 2**attempt)
    finally:
        engine.dispose()


def _refused_credentials(exc: Exception) -> bool:
    text = str(exc).lower()
    return any(word in text for word in ("authentication", "password", "access denied"))


def store_error(uri: str, exc: BaseException) -> TrackingError:
    """The one-line TrackingError of a store found unusable before any work started."""
    reason = getattr(exc, "orig", None) or exc  # SQLAlchemy wraps the driver's own error
    first = redact_credentials((str(reason).strip().splitlines() or [""])[0])[:300]
    return TrackingError(
        f"the MLflow tracking store at {redact_credentials(uri)} cannot be used "
        f"({type(reason).__name__}: {first}). Nothing was started; fix tracking.uri or "
        "MLFLOW_TRACKING_URI (credentials: MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, "
        "or the database's) or start the store (mlflow/README.md), then rerun"
    )


def wait_for_server(uri: str, workdir: Path, attempts: int, backoff_seconds: float) -> None:
    """Return once the server answers HTTP at all; else TrackingError after `attempts` tries."""
    error: Exception | None = None
    for attempt in range(attempts):
        try:
            # Any HTTP answer (even 401/404) means reachable; MLflow's calls report the rest.
            requests.get(f"{uri.rstrip('/')}/health", timeout=5)
            return
        except requests.RequestException as exc:
            error = exc
        if attempt + 1 < attempts:
            time.sleep(backoff_seconds * 2**attempt)
    assert error is not None
    raise tracking_error(uri, workdir, error, attempts=attempts)


def find_nightly_run(
    client: MlflowClient, experiment_id: str, tags: Mapping[str, str]
) -> str | None:
    """The newest active run with the same identity tags (date, config, data, run folder)."""
    keys = [*IDENTITY_TAGS, *([RUN_FOLDER_TAG] if RUN_FOLDER_TAG in tags else [])]
    query = " and ".join(f"tags.{key} = '{tags[key]}'" for key in keys)
    runs = client.search_runs(
        [experiment_id],
        filter_string=query,
        run_view_type=ViewType.ACTIVE_ONLY,
        max_results=1,
        order_by=["attributes.start_time DESC"],
    )
    return runs[0].info.run_id if runs else None


def git_commit() -> str:
    """The commit of the recsys source tree ('unknown' outside a git checkout)."""
    repo = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _dataset_input(source: str | None, fingerprint: str) -> DatasetInput | None:
    if source is None:
        return None
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    with warnings.catch_warnings():
        # MLflow warns that a local path matches two equivalent source types; either is right.
        warnings.simplefilter("ignore")
        dataset_source = resolve_dataset_source(redact_credentials(source))
    # MLflow stores at most 36 characters of digest; 32 hex digits of sha256 are plenty.
    # MLflow's documented class; its base declares `profile` abstract but is no ABC.
    dataset = MetaDataset(  # type: ignore[abstract]
        dataset_source, name=Path(source).name or source, digest=fingerprint[:32]
    )
    # The public Dataset.to_dict() fields are exactly mlflow.entities.Dataset's arguments.
    fields = dataset.to_dict()
    entity = DatasetEntity(
        name=fields["name"],
        digest=fields["digest"],
        source_type=fields["source_type"],
        source=fields["source"],
        schema=fields.get("schema"),
        profile=fields.get("profile"),
    )
    return DatasetInput(entity, tags=[InputTag("mlflow.data.context", "training")])


def record_ab_metric(
    config: RecsysConfig,
    workdir: Path,
    *,
    experiment: str,
    variant: str,
    metric: str,
    value: float,
    date: dt.date | None = None,
    model_run_id: str | None = None,
) -> str:
    """Log one observed online A/B metric to the variant's run of experiment `ab-<name>`.

    One MLflow run per (experiment, variant), reused on every call; each value is a new step of
    the metric, so a series of daily observations reads as a curve next to the offline runs.
    """
    key = metric_key(metric)
    number = _as_float(key, value)
    uri = resolve_tracking_uri(config, workdir)
    tags = {"ab.experiment": experiment, "ab.variant": variant, "model_name": config.model_name}
    if model_run_id:
        tags["offline_run_id"] = model_run_id
    try:
        client = connect(config, workdir, uri)
        with bounded_http_retries():
            experiment_id = ensure_experiment(client, f"ab-{experiment}", uri, workdir)
            runs = client.search_runs(
                [experiment_id],
                filter_string=f"tags.`ab.variant` = '{variant}'",
                max_results=1,
                order_by=["attributes.start_time ASC"],
            )
            if runs:
                run_id = runs[0].info.run_id
            else:
                run_id = client.create_run(
                    experiment_id, tags=tags, run_name=f"variant-{variant}"
                ).info.run_id
            for name, tag in tags.items():
                client.set_tag(run_id, name, tag)
            step = len(client.get_metric_history(run_id, key))
            when = dt.datetime.combine(date, dt.time(), tzinfo=dt.UTC) if date else None
            stamp = int((when or dt.datetime.now(dt.UTC)).timestamp() * 1000)
            client.log_metric(run_id, key, number, timestamp=stamp, step=step)
            if date:
                client.set_tag(run_id, "ab.last_date", date.isoformat())
            return run_id
    except TRACKING_FAILURES as exc:
        raise tracking_error(uri, workdir, exc) from None


@contextmanager
def bounded_http_retries() -> Iterator[None]:
    """Within the block, MLflow's HTTP retries/timeouts are HTTP_LIMITS unless set by the user."""
    added = [name for name in HTTP_LIMITS if name not in os.environ]
    # MLflow reads these variables on every request, so setting them for the block is enough.
    # Not thread-safe: the nightly pipeline logs from one thread.
    os.environ.update({name: HTTP_LIMITS[name] for name in added})
    # MLflow prints "View run at <tracking URI>/#/..." on set_terminated, user:password@ and
    # all: forced off (whatever the operator set), restored after the block.
    printing = os.environ.get(_SUPPRESS_URL)
    os.environ[_SUPPRESS_URL] = "true"
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
        if printing is None:
            os.environ.pop(_SUPPRESS_URL, None)
        else:
            os.environ[_SUPPRESS_URL] = printing


def nightly_run_tags(
    config: RecsysConfig, run_date: dt.date, stats: Mapping[str, Any], extra: dict[str, str]
) -> dict[str, str]:
    """A nightly run's tags: its identity (date, config digest, data fingerprint) and context."""
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
        "git_commit": git_commit(),
    }
    # Context tags (user, source, git commit) come from MLflow; the caller's and ours override.
    resolved = resolve_tags({**extra, **ours})
    return {key: str(redact_value(key, str(value))) for key, value in resolved.items()}


def _param_value(value: Any, key: str = "") -> str:
    # Lists/None as JSON so `[10, 50]` and `null` read back unambiguously; secrets redacted
    # before serialising, so a secret-named key's value is `***` whatever its type.
    value = redact_value(key, value)
    return value if isinstance(value, str) else json.dumps(value)


def metric_key(name: str) -> str:
    """`name` as an MLflow metric key (`@` -> `_at_`); TrackingError if MLflow rejects it."""
    key = name.replace("@", "_at_")
    if not _VALID_METRIC.match(key) or ".." in key or key.startswith("/"):
        raise TrackingError(
            f"metric name {name!r} is not valid in MLflow (use letters, digits, _ - . / and "
            "spaces, e.g. 'recall_at_10'); nothing was logged"
        )
    return key


def _metric_list(history: dict[str, list[float]], final: dict[str, float]) -> list[Metric]:
    now = int(time.time() * 1000)
    per_epoch = {metric_key(name): values for name, values in history.items()}
    finals = {metric_key(name): value for name, value in final.items()}
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


def _local(artifact: Artifact) -> tuple[Path, str | None]:
    return (Path(artifact[0]), artifact[1]) if isinstance(artifact, tuple) else (artifact, None)


def _check_artifacts(artifacts: Sequence[Artifact]) -> None:
    missing = [str(_local(a)[0]) for a in artifacts if not _local(a)[0].exists()]
    if missing:
        raise TrackingError(f"artifacts to log do not exist: {missing}; nothing was logged")


def ensure_experiment(client: MlflowClient, name: str, uri: str, workdir: Path) -> str:
    """The id of the named experiment, created (artifacts under the workdir for SQLite)."""
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
    run_id: str,
    tags: dict[str, str],
    params: list[Param],
    metric_list: list[Metric],
    stats: dict[str, Any],
    artifacts: Sequence[Artifact],
    dataset: DatasetInput | None,
) -> None:
    run = client.get_run(run_id)
    # A resumed run keeps what it already has: re-logging a metric would duplicate its history.
    metric_list = [m for m in metric_list if m.key not in run.data.metrics]
    params = [p for p in params if p.key not in run.data.params]
    try:
        # log_batch splits into MLflow's per-request limits itself.
        client.log_batch(run_id, metrics=metric_list, params=params)
        for key, value in tags.items():
            if run.data.tags.get(key) != value:
                client.set_tag(run_id, key, value)
        if dataset is not None and not (run.inputs and run.inputs.dataset_inputs):
            client.log_inputs(run_id, datasets=[dataset])
        safe_stats = redact_tree(json.loads(json.dumps(stats, default=str)))
        client.log_dict(run_id, safe_stats, DataFile.STATS)
        for artifact in artifacts:
            path, folder = _local(artifact)
            if path.is_dir():
                client.log_artifacts(run_id, str(path), artifact_path=folder or path.name)
            else:
                log_file_redacted(client, run_id, path, folder)
        client.set_tag(run_id, LOGGED_TAG, "true")
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    except TRACKING_FAILURES:
        _mark_failed(client, run_id)
        raise


# Text files that may quote the config (tracking URI, data paths): logged as redacted copies.
_TEXT_SUFFIXES = {".json", ".yaml", ".yml", ".txt", ".md", ".log"}
# Larger files are data, not settings: not read into memory for redaction.
_MAX_REDACTED_BYTES = 16 << 20


def log_file_redacted(
    client: MlflowClient, run_id: str, path: Path, folder: str | None = None
) -> None:
    """Log one file; a text file that holds a secret is logged as a redacted copy (same name)."""
    clean = redacted_text_file(path)
    if clean is None:
        client.log_artifact(run_id, str(path), artifact_path=folder)
        return
    with tempfile.TemporaryDirectory(prefix="recsys-redacted-") as tmp:
        copy = Path(tmp) / path.name
        copy.write_text(clean, encoding="utf-8")
        client.log_artifact(run_id, str(copy), artifact_path=folder)


def redacted_text_file(path: Path) -> str | None:
    """The redacted text of a small JSON/YAML/text file, or None if nothing had to change."""
    if path.suffix.lower() not in _TEXT_SUFFIXES or path.stat().st_size > _MAX_REDACTED_BYTES:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None
    # Structured files are redacted by key too (`password: a b` has a space the text rule stops at).
    parsed: Any = None
    with suppress(ValueError, yaml.YAMLError):
        if path.suffix.lower() == ".json":
            parsed = json.loads(text)
        elif path.suffix.lower() in {".yaml", ".yml"}:
            parsed = yaml.safe_load(text)
    if isinstance(parsed, dict | list):
        clean_tree = redact_tree(parsed)
        if clean_tree == parsed:
            return None
        if path.suffix.lower() == ".json":
            return json.dumps(clean_tree, indent=2, sort_keys=True) + "\n"
        return yaml.safe_dump(clean_tree, sort_keys=False)
    clean = redact_text(text)
    return None if clean == text else clean


def _mark_failed(client: MlflowClient, run_id: str) -> None:
    # Best effort: the store may be the thing that failed; the original error is what matters.
    with suppress(*TRACKING_FAILURES):
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))


def tracking_error(
    uri: str, workdir: Path, exc: Exception, attempts: int | None = None
) -> TrackingError:
    """The TrackingError (exit code, one actionable line) for a failure in TRACKING_FAILURES."""
    # The first line names the cause; MLflow's full text repeats urllib3's retry history.
    reason = redact_credentials((str(exc).strip().splitlines() or [""])[0])
    reason = reason if len(reason) <= 300 else reason[:300] + "..."
    tries = f" after {attempts} attempts" if attempts else ""
    return TrackingError(
        f"could not record the run in MLflow at {redact_credentials(uri)}{tries} "
        f"({type(exc).__name__}: {reason}). The run's outputs on disk under {workdir} are "
        "intact; check the server (mlflow/README.md) or set tracking.uri / MLFLOW_TRACKING_URI"
    )
