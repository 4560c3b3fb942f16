"""Where a `recsys tune` search lives between runs: its Optuna study and its MLflow runs.

The study is kept in an Optuna RDB storage next to tracking (`study_storage_url`), named by
what the search depends on (`study_name`), so the same command finds the same study after a
kill and continues it. A killed process leaves its trials RUNNING in Optuna and its runs
RUNNING in MLflow; `resume` fails those trials (and queues their settings again, so the
interrupted trial is the first one rerun) and marks those runs KILLED. Budgets count the whole
study: `trials_ended` and `seconds_spent` say how much of it earlier runs used.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import sqlalchemy
from mlflow import MlflowClient
from mlflow.entities import RunStatus
from optuna.trial import FrozenTrial, TrialState

from recsys.core.config import RecsysConfig, check_study_storage
from recsys.core.errors import ConfigError, TrackingError
from recsys.core.layout import Workdir
from recsys.core.redact import redact_text

log = logging.getLogger(__name__)

# Study user attributes: the id that tags the search's MLflow runs, its parent run.
STUDY_TAG = "recsys.study"
PARENT_ATTR = "mlflow_parent_run_id"
# Trial user attributes: who ran it, and whether its process died under it.
PID_ATTR = "pid"
WORKER_ATTR = "worker"
KILLED_ATTR = "killed"
BASELINE_ATTR = "baseline"  # trial 0: the base config's own settings
RETRY_ATTR = "retry_of"  # the killed trial this one reruns
STATE_TAG = "recsys.trial_state"
# A PostgreSQL tracking database keeps the study in its own schema: Optuna and MLflow would
# otherwise share one `alembic_version` table, each migrating the other's schema.
PG_SCHEMA = "optuna"
_TMP_PREFIX = ".tmp-optuna-"
ENDED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def study_storage_url(config: RecsysConfig, workdir: Path, tracking_uri: str) -> str:
    """The study's storage: tune.storage, OPTUNA_STORAGE, a PostgreSQL tracking store, or
    the SQLite file under the working directory, first match wins."""
    given = config.tune.storage or os.environ.get("OPTUNA_STORAGE")
    if given:
        try:
            return check_study_storage(given)
        except ValueError as exc:
            raise ConfigError(f"OPTUNA_STORAGE: {exc}") from None
    if tracking_uri.startswith("postgresql"):
        return tracking_uri
    return f"sqlite:///{Workdir(workdir).study_store().resolve()}"


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """The Optuna storage at `url`; an unreachable database is a TrackingError (exit 6)."""
    try:
        if url.startswith("sqlite:///"):
            _create_sqlite(Path(url.removeprefix("sqlite:///")))
            storage = optuna.storages.RDBStorage(
                url, engine_kwargs={"connect_args": {"timeout": 60}}
            )
        else:
            _create_schema(url)
            options = {"options": f"-csearch_path={PG_SCHEMA}"}
            storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": options})
    except ImportError as exc:
        raise ConfigError(
            f"the database driver of the tuning study's storage {redact_text(url)} is not "
            f"installed ({exc.name}): name the installed one, e.g. postgresql+psycopg2://..."
        ) from None
    except sqlalchemy.exc.SQLAlchemyError as exc:
        reason = redact_text((str(exc).strip().splitlines() or [""])[0])[:300]
        raise TrackingError(
            f"could not open the tuning study's storage {redact_text(url)} "
            f"({type(exc).__name__}: {reason}); check the database or set tune.storage / "
            "OPTUNA_STORAGE"
        ) from None
    # Optuna's in-process cache over the database, as optuna.storages.get_storage builds it.
    return optuna.storages.get_storage(storage)


def _create_sqlite(path: Path) -> None:
    """The SQLite file, created whole: built aside, then renamed into place.

    Optuna creates its tables and stamps their version on first use; a process killed in
    between would leave a file no later run can open. Callers hold the workdir lock.
    """
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.glob(f"{_TMP_PREFIX}*"):
        leftover.unlink(missing_ok=True)
    tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex[:8]}.db"
    optuna.storages.RDBStorage(f"sqlite:///{tmp}").engine.dispose()
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _create_schema(url: str) -> None:
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(sqlalchemy.text(f"CREATE SCHEMA IF NOT EXISTS {PG_SCHEMA}"))
    finally:
        engine.dispose()


def study_name(config: RecsysConfig, stats: dict[str, Any], run_date: dt.date | None) -> str:
    """The study of a search: same model, date, base config, search settings and data.

    The budgets (trials, timeout), the workers and the storage are not part of it: a search
    resumed with more trials or more workers continues the same study.
    """
    tune = config.tune.model_dump(
        mode="json", exclude={"trials", "timeout_seconds", "workers", "storage"}
    )
    payload = {"config": config.digest(), "tune": tune, "data": stats.get("fingerprint")}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
    return f"{config.model_name}-{run_date or 'undated'}-{digest}"


@dataclass
class Resumed:
    """What a run of a search starts from."""

    study: optuna.Study
    uid: str  # tags every MLflow run of the study (STUDY_TAG)
    new: bool
    killed: list[FrozenTrial]  # trials whose process died: failed now, queued again


def resume(
    storage: optuna.storages.BaseStorage,
    name: str,
    sampler: optuna.samplers.BaseSampler,
    pruner: optuna.pruners.BasePruner,
) -> Resumed:
    """Load (or create) the study; fail the trials a dead process left RUNNING, queue them again.

    Callers hold the workdir lock and no worker of theirs runs yet: every RUNNING trial
    belongs to a process that is gone.
    """
    study = optuna.create_study(
        study_name=name, storage=storage, sampler=sampler, pruner=pruner,
        direction="maximize", load_if_exists=True,
    )  # fmt: skip
    known = study.user_attrs.get(STUDY_TAG)
    new = known is None
    uid = uuid.uuid4().hex if known is None else str(known)
    if new:
        study.set_user_attr(STUDY_TAG, uid)
    killed = requeue_running(study, storage)
    if killed:
        log.warning("resumed study %s: trials %s were running when their process died: failed, "
                    "queued again", name, [t.number for t in killed])  # fmt: skip
    return Resumed(study, uid, new, killed)


def requeue_running(study: optuna.Study, storage: optuna.storages.BaseStorage) -> list[FrozenTrial]:
    """Fail the study's RUNNING trials as killed and queue their settings again.

    Only when no process of the search runs: every RUNNING trial is then one whose process
    died. The interrupted trial runs again first, with the same settings and role.
    """
    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    study_id = storage.get_study_id_from_name(study.study_name)
    for trial in stale:
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        storage.set_trial_user_attr(trial_id, KILLED_ATTR, True)
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
        attrs = {k: v for k, v in trial.user_attrs.items() if k == BASELINE_ATTR}
        study.enqueue_trial(trial.params, user_attrs={**attrs, RETRY_ATTR: trial.number})
    return stale


def counted(study: optuna.Study) -> list[FrozenTrial]:
    """The trials that count toward the budgets: ended, and not killed with their process."""
    return [
        t
        for t in study.get_trials(deepcopy=False, states=ENDED)
        if not t.user_attrs.get(KILLED_ATTR)
    ]


def trials_ended(study: optuna.Study) -> int:
    """How many trials of the trial budget the study has used."""
    return len(counted(study))


def seconds_spent(study: optuna.Study) -> float:
    """How much of the time budget the study has used: the time its counted trials ran.

    Trials that ran at once (parallel workers) count once: the union of their intervals.
    """
    spans = sorted(
        (t.datetime_start, t.datetime_complete)
        for t in counted(study)
        if t.datetime_start is not None and t.datetime_complete is not None
    )
    total, end = 0.0, None
    for start, stop in spans:
        if end is None or start > end:
            total += (stop - start).total_seconds()
            end = stop
        elif stop > end:
            total += (stop - end).total_seconds()
            end = stop
    return total


def sampler_seed(seed: int, existing: int, worker: int) -> int:
    """The sampler's seed for one process of one run of the search.

    A fresh single-process search uses `tune.seed` itself; a resumed one, or another worker,
    gets a seed of its own, else it would propose the same settings the first run tried.
    """
    if existing == 0 and worker == 0:
        return seed
    return int(np.random.SeedSequence([seed, existing, worker]).generate_state(1)[0])


def mark_killed_runs(
    client: MlflowClient, experiment_id: str, uid: str, keep: str | None = None
) -> list[str]:
    """Mark the study's MLflow runs still RUNNING (their process died) KILLED; ids returned.

    `keep` (the parent run the resumed search reuses) is left to the caller.
    """
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{STUDY_TAG}` = '{uid}' and attributes.status = 'RUNNING'",
        max_results=10_000,
    )
    killed = []
    for run in runs:
        if run.info.run_id == keep:
            continue
        if "optuna.trial" in run.data.tags:  # a trial's run, not the parent
            client.set_tag(run.info.run_id, STATE_TAG, "killed")
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.KILLED))
        killed.append(run.info.run_id)
    if killed:
        log.warning("marked %d MLflow run(s) of the interrupted search KILLED", len(killed))
    return killed
