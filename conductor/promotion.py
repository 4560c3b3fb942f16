"""After export: log the run -> register a version -> set `challenger` -> gate -> promote or keep.

Everything is read back from the run folder (train.json, history.json, metrics.json,
export.json, per_user_eval.parquet), so `recsys sync --date D` can publish a run later, after
the tracking server was down: a pending marker (`mlflow_pending.json`) stays in the run folder
until the whole sequence succeeded. Every step is idempotent (see docs/TRACKING.md).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from recsys.core.config import RecsysConfig
from recsys.core.errors import StageNotReadyError, TrackingError
from recsys.core.layout import (
    ModelFile,
    RunDir,
    RunFile,
    Workdir,
    missing_inputs,
    temp_prefix,
)
from recsys.core.records import (
    AlsRecord,
    ExportRecord,
    MetricsRecord,
    TrainRecord,
    read_export,
    read_metrics,
    read_stats,
    read_train,
)
from recsys.core.redact import redact_text, redact_tree
from recsys.core.resolve import mlflow_params, read_settings
from recsys.model_evaluation import evaluate_model
from recsys.serving_state import ServingState, sync_serving
from recsys.tracking import gate, registry
from recsys.tracking.runs import (
    DEFAULT_DEVICE,
    RUN_FOLDER_TAG,
    TRACKING_FAILURES,
    Artifact,
    bounded_http_retries,
    check_tracking_store,
    connect,
    log_nightly_run,
    owner_tags,
    resolve_tracking_uri,
    tracking_error,
)
from serving_export.mlflow_model import run_mlflow_model

log = logging.getLogger(__name__)

PENDING = RunFile.PENDING
EMBEDDINGS_ARTIFACTS = "embeddings"
EVALUATION_MODEL_ARTIFACT = "evaluation_model"
"""training.refit all: the first fit, which a later gate scores in place of the served model."""
GATE_JSON = RunFile.GATE
# Where the champion's per-user values on today's data are written (and logged).
GATE_DIR = "gate"


@dataclass
class PublishResult:
    """What publishing one run to MLflow did."""

    mlflow_run_id: str
    version: str
    decision: gate.GateDecision
    champion_version: str
    notes: list[str] = field(default_factory=list)


def device_layout(trained: Any) -> dict[str, str]:
    """Strategy / replicas / precision of a training result, else the one-device default."""
    return {
        key: str(getattr(trained, key, None) or default) for key, default in DEFAULT_DEVICE.items()
    }


def _device_of_run(run_dir: Path) -> dict[str, str]:
    """The device layout train.json recorded."""
    return read_train(run_dir).device()


def pending_runs(workdir: Workdir, date: dt.date) -> list[Path]:
    """The date's run folders still waiting to be published to MLflow."""
    return sorted(p.parent for p in workdir.runs(date).glob(f"*/{PENDING}"))


def publish_run(
    config: RecsysConfig,
    workdir: Workdir,
    date: dt.date,
    run_dir: Path,
    *,
    timings: dict[str, float] | None = None,
    device: dict[str, str] | None = None,
    force_promote: bool = False,
    tracking_uri: str | None = None,
) -> PublishResult:
    """Log, register, gate and promote one finished run; a pending marker is left on failure."""
    missing = missing_inputs("publish", run_dir)
    if missing:
        raise StageNotReadyError(
            f"{run_dir} lacks {missing}: run `recsys evaluate` and `recsys export` for it first"
        )
    marker = run_dir / PENDING
    state = json.loads(marker.read_text()) if marker.is_file() else {}
    state = {
        "date": date.isoformat(),
        "timings": timings if timings is not None else state.get("timings", {}),
        "device": device or state.get("device") or _device_of_run(run_dir),
        "force_promote": force_promote or bool(state.get("force_promote")),
        "last_error": state.get("last_error"),
    }
    _write_json(marker, state)
    uri = tracking_uri or resolve_tracking_uri(config, workdir.root)
    try:
        check_tracking_store(config, workdir.root, uri)
        with bounded_http_retries():
            result = _publish(config, workdir, date, run_dir, state, uri)
    except (TrackingError, *TRACKING_FAILURES) as exc:
        error = exc if isinstance(exc, TrackingError) else tracking_error(uri, workdir.root, exc)
        _write_json(marker, {**state, "last_error": str(error)})
        raise TrackingError(
            f"{error}. Pending marker left at {marker}: run `recsys sync --date {date}` once "
            "the server is back"
        ) from None
    marker.unlink()
    return result


@dataclass(frozen=True)
class RunRecords:
    """What publishing reads back from a finished run folder (its typed stage records)."""

    run_dir: Path
    data_dir: Path
    train: TrainRecord
    metrics: MetricsRecord
    exported: ExportRecord

    @classmethod
    def read(cls, run_dir: Path, workdir: Workdir) -> RunRecords:
        """The run's train, metrics and export records (RecordError if one is not current)."""
        train = read_train(run_dir)
        return cls(
            run_dir,
            workdir.local(train.data_dir),
            train,
            read_metrics(run_dir),
            read_export(run_dir),
        )


def _publish(
    config: RecsysConfig,
    workdir: Workdir,
    date: dt.date,
    run_dir: Path,
    state: dict[str, Any],
    uri: str,
) -> PublishResult:
    """Record -> register -> decide -> move the aliases -> write the serving config.

    Invariant: the registry's aliases are the only truth about what serves; champion.json and
    models.config are rewritten from them last. Crash behaviour: every step is idempotent, so
    the rerun (or `recsys sync`) repeats them all: the MLflow run is found again by its run
    folder tag, the version by its run id, the gate's decision is the one recorded on the run
    (unless forcing over a "keep"), and the aliases are set to the values they should have.
    """
    run = RunRecords.read(run_dir, workdir)
    run_id = _record_run(config, workdir, date, run, state, uri)
    client = connect(config, workdir.root, uri)
    name = config.model_name
    version = registry.register_run(client, name, run_id)
    champion = registry.alias_version(client, name, registry.CHAMPION)
    if champion is not None and (legacy := registry.legacy_reason(name, champion)):
        log.warning("champion: %s", legacy)
    decision, current = _decide(
        client, config, workdir, run, run_id, version, champion, bool(state["force_promote"])
    )
    if decision.promote and current:
        registry.set_alias(client, name, registry.CHAMPION, version.version)
    notes = [note] if (note := move_challenger(client, name, version, date)) else []
    now_champion = registry.alias_version(client, name, registry.CHAMPION)
    sync_serving(client, name, workdir, config.export.serving_base_path)
    log.info("%s (version %s of %s)", decision.summary(), version.version, name)
    return PublishResult(
        run_id,
        str(version.version),
        decision,
        str(now_champion.version) if now_champion else "none",
        notes,
    )


def _record_run(
    config: RecsysConfig,
    workdir: Workdir,
    date: dt.date,
    run: RunRecords,
    state: dict[str, Any],
    uri: str,
) -> str:
    """Log the run to MLflow (metrics, params, artifacts, tags, the MLflow Model); its id.

    Idempotent: the MLflow run of this run folder is reused (its run_folder tag), so a rerun
    after a crash completes the same run instead of logging a second one.
    """
    run_dir, data_dir, exported = run.run_dir, run.data_dir, run.exported
    metrics = {f"test_{k}": v for k, v in run.metrics.model.items()}
    for baseline, values in run.metrics.baselines.items():
        metrics.update({f"{baseline}_{k}": v for k, v in values.items()})
    als = run.metrics.als
    if als is not None:
        c = als.comparison
        metrics.update(
            {
                "als_seconds": als.seconds,
                f"als_validation_{als.metric}": als.validation,
                f"model_minus_als_{c.metric}": c.delta,
                f"model_minus_als_{c.metric}_ci_low": c.ci_low,
                f"model_minus_als_{c.metric}_ci_high": c.ci_high,
            }
        )
    metrics.update(state["timings"])
    metrics["train_examples_per_second"] = run.train.examples_per_second
    metrics["train_loop_seconds"] = run.train.seconds
    metrics["model_version"] = float(exported.version)
    resolved = run_dir / RunFile.RESOLVED_CONFIG
    evaluated = RunDir(run_dir).evaluated_model
    # Paths as everyone else finds them: local paths, or URIs for a workdir in a bucket.
    tags = {
        # One MLflow run (and registered version) per run folder: a rerun that trains again
        # (--rerun-from train or earlier) is a new candidate, not the old run (runs.py).
        RUN_FOLDER_TAG: run_dir.name,
        "run_dir": workdir.public(run_dir),
        "model_path": workdir.public(run_dir / RunFile.MODEL),
        # The model a later gate scores as champion (the served one unless it saw the test).
        "evaluated_model": evaluated.name,
        "evaluated_model_path": workdir.public(evaluated),
        "data_dir": workdir.public(data_dir),
        "model_version": str(exported.version),
        **{f"device.{k}": str(v) for k, v in state["device"].items()},
        # What the config's dense_log rule changed for this log ({}: nothing); the params hold
        # every value as trained, and `written.<key>` the value it replaced.
        "dense_log_settings": json.dumps(run.train.dense_log_settings, sort_keys=True),
        **owner_tags(workdir.root),
        **(_als_tags(als) if als is not None else {}),
        **_candidate_tags(run.train),
    }
    return log_nightly_run(
        config,
        workdir=workdir.root,
        run_date=date,
        stats=read_stats(data_dir).as_dict(),
        history=_read(run_dir / RunFile.HISTORY),
        metrics=metrics,
        artifacts=_run_artifacts(config, workdir, run),
        tags=tags,
        dataset_source=workdir.public(data_dir),
        tracking_uri=uri,
        params=mlflow_params(read_settings(resolved)) if resolved.is_file() else None,
    )


def _candidate_tags(train: TrainRecord) -> dict[str, str]:
    """training.candidates: what each first fit scored on validation and which was kept."""
    if not train.candidates:
        return {}
    tags = {f"candidate.{c.index}": c.line() for c in train.candidates}
    tags["candidate.kept"] = str(train.chosen_candidate)
    return tags


def _als_tags(als: AlsRecord) -> dict[str, str]:
    """The classic baseline's chosen setting and search, as tags: a rerun of the evaluate
    stage may choose another setting, which an MLflow param could not take."""
    return {
        "als.factors": str(als.factors),
        "als.regularization": f"{als.regularization:g}",
        "als.alpha": f"{als.alpha:g}",
        "als.iterations": str(als.iterations),
        "als.metric": als.metric,
        "als.settings_tried": f"{len(als.trials)} of {als.grid_size}",
        "als.budget_exhausted": str(als.budget_exhausted).lower(),
        "als.verdict": als.comparison.line("ALS"),
    }


def _run_artifacts(config: RecsysConfig, workdir: Workdir, run: RunRecords) -> list[Artifact]:
    """The files logged with the run: its records, both models, the SavedModels, the
    embeddings' manifest (not the vectors: they live in embeddings/<version>/) and the
    retrieval SavedModel as an MLflow Model, which is what gets registered."""
    run_dir, exported = run.run_dir, run.exported
    resolved = run_dir / RunFile.RESOLVED_CONFIG
    artifacts: list[Artifact] = [
        run_dir / RunFile.CONFIG,
        *([resolved] if resolved.is_file() else []),  # runs trained before it was written
        run_dir / RunFile.METRICS,
        run_dir / RunFile.PER_USER_EVAL,
        run_dir / RunFile.HISTORY,
        run_dir / RunFile.EXPORT,
        (run_dir / RunFile.MODEL, "trained_model"),
    ]
    evaluated = RunDir(run_dir).evaluated_model
    if evaluated.name == RunFile.EVAL_MODEL:
        artifacts.append((evaluated, EVALUATION_MODEL_ARTIFACT))
    artifacts.append((workdir.local(exported.embeddings_manifest), EMBEDDINGS_ARTIFACTS))
    artifacts += [
        (workdir.local(path), f"{registry.SAVEDMODELS}/{name}")
        for name, path in exported.models.items()
    ]
    retrieval = workdir.local(exported.models["retrieval"])
    mlflow_model = run_mlflow_model(run_dir, run.data_dir, retrieval, config.export.top_k)
    artifacts.append((mlflow_model, registry.MLFLOW_MODEL))
    return artifacts


def _decide(
    client: MlflowClient,
    config: RecsysConfig,
    workdir: Workdir,
    run: RunRecords,
    run_id: str,
    version: ModelVersion,
    champion: ModelVersion | None,
    force: bool,
) -> tuple[gate.GateDecision, bool]:
    """The gate's decision for this version, recorded on its MLflow run and in gate.json, and
    whether it still applies to today's champion (a recorded one: only if that has not moved).

    Invariant: one decision per run. A rerun returns the recorded one (its statistics are not
    recomputed on a champion that may have moved since), except that --force-promote
    overrides a recorded "keep". A recorded "promote" moves `champion` only while the champion
    is still the version it was compared with: a crash between recording and moving the alias
    is completed, a newer champion is never replaced by a stale decision. The first model is
    promoted without comparison (unless it loses to ALS under policy refuse).
    """
    recorded = _recorded_decision(client, run_id)
    if recorded is not None and not (force and not recorded.promote):
        log.info("gate already decided for run %s: %s", run_id, recorded.decision)
        compared = client.get_run(run_id).data.tags.get("gate.champion_version")
        now = str(champion.version) if champion else "none"
        return recorded, compared in (now, str(version.version))
    if champion is None:
        decision = _held_against_als(config, run.metrics, gate.first_model_decision(), force)
    elif str(champion.version) == str(version.version):
        decision = gate.GateDecision(True, [f"version {version.version} is already champion"])
    else:
        decision = _gate_against(
            client, config, workdir, run.run_dir, run.data_dir, champion, force
        )
        decision = _held_against_als(config, run.metrics, decision, force)
    _log_decision(client, run_id, run.run_dir, decision, champion)
    return decision, True


def _held_against_als(
    config: RecsysConfig, metrics: MetricsRecord, decision: gate.GateDecision, force: bool
) -> gate.GateDecision:
    """evaluation.classic_baseline.policy refuse: the decision once the challenger is held
    against the night's ALS (metrics.json); warn: the decision as the gate made it."""
    if config.evaluation.classic_baseline.policy != "refuse":
        return decision
    if metrics.als is None:
        log.warning(
            "gate: %s is refuse but metrics.json has no ALS comparison (classic_baseline "
            "disabled when it was evaluated): gated without it",
            gate.BASELINE_POLICY,
        )
        return decision
    return gate.with_baseline(decision, metrics.als.comparison, "ALS", force=force)


def sync_serving_state(
    config: RecsysConfig, workdir: Workdir, tracking_uri: str | None = None
) -> ServingState:
    """models.config and champion.json rewritten from the registry's aliases (TrackingError
    when the store cannot be read; nothing is written then)."""
    uri = tracking_uri or resolve_tracking_uri(config, workdir.root)
    try:
        with bounded_http_retries():
            client = connect(config, workdir.root, uri)
            return sync_serving(client, config.model_name, workdir, config.export.serving_base_path)
    except TRACKING_FAILURES as exc:
        raise tracking_error(uri, workdir.root, exc) from None


def move_challenger(
    client: MlflowClient, name: str, version: ModelVersion, date: dt.date
) -> str | None:
    """Point `challenger` at `version` unless it holds a newer one; else say why it stays.

    `challenger` is the newest candidate, by run date, then registration: a backfill or a late
    sync of an older date registers its version without taking the alias from a newer date.
    """
    current = registry.alias_version(client, name, registry.CHALLENGER)
    if current is not None and str(current.version) != str(version.version):
        held = (_run_date(client, current), int(current.version))
        if held > (date.isoformat(), int(version.version)):
            note = (
                f"challenger stays version {current.version} (run date {held[0]}): this run's "
                f"date {date} is older, so version {version.version} is registered but does "
                "not take it"
            )
            log.warning(note)
            return note
    registry.set_alias(client, name, registry.CHALLENGER, version.version)
    return None


def _run_date(client: MlflowClient, version: ModelVersion) -> str:
    """The run date of a registered version (its tag, else its run's tag; '' if neither)."""
    date = (version.tags or {}).get("run_date")
    if date or version.run_id is None:
        return date or ""
    return client.get_run(version.run_id).data.tags.get("run_date", "")


def _gate_against(
    client: MlflowClient,
    config: RecsysConfig,
    workdir: Workdir,
    run_dir: Path,
    data_dir: Path,
    champion: Any,
    force: bool,
) -> gate.GateDecision:
    """Evaluate the champion on today's test split and gate the challenger against it."""
    # Under the workdir, where the next run removes what a killed one left (clean_temporaries).
    prefix = temp_prefix("tmp", "recsys-champion")
    with tempfile.TemporaryDirectory(prefix=prefix, dir=run_dir.parent) as tmp:
        model_dir = _champion_model(client, champion.run_id, Path(tmp), workdir)
        if model_dir is None:
            reason = (
                f"champion version {champion.version}: its model is neither at its run folder "
                "nor in its run's artifacts (trained_model/, evaluation_model/); cannot compare"
            )
            return gate.not_compared_decision(reason, force=force)
        try:
            users, per_user, summary = evaluate_champion(config, model_dir, data_dir)
        except Exception as exc:
            # Whatever breaks loading or scoring the old model (moved files, a model format
            # changed by a newer release), the safe outcome is the same: keep the champion and
            # say why, loudly; a person can still --force-promote.
            log.exception("champion version %s could not be evaluated", champion.version)
            reason = (
                f"champion version {champion.version} could not be evaluated on today's data "
                f"({type(exc).__name__}: {str(exc)[:200]}); keeping it (use --force-promote)"
            )
            return gate.not_compared_decision(reason, force=force)
    (run_dir / GATE_DIR).mkdir(exist_ok=True)
    _write_per_user(run_dir / GATE_DIR / "champion_per_user_eval.parquet", users, per_user)
    challenger = pq.read_table(run_dir / RunFile.PER_USER_EVAL).to_pydict()
    c_users = challenger.pop("user_id")
    _, a, b = gate.pair_users(users, per_user, c_users, challenger)
    decision = gate.decide(
        a,
        b,
        config.gate,
        champion_summary=summary,
        challenger_summary=read_metrics(run_dir).model,
        force=force,
    )
    decision.reasons.append(f"champion: version {champion.version} (run {champion.run_id})")
    return decision


def evaluate_champion(
    config: RecsysConfig, model_dir: Path, data_dir: Path
) -> tuple[list[str], dict[str, np.ndarray], dict[str, float]]:
    """A saved model on data_dir's test split, exactly as `recsys evaluate` scores a run."""
    eval_set, result = evaluate_model(config, model_dir, data_dir)
    return eval_set.users, result.per_user, result.metrics


def _champion_model(client: MlflowClient, run_id: str, tmp: Path, workdir: Workdir) -> Path | None:
    """The champion's evaluation model: its run folder's when present, else the logged copy.

    That is the served model, unless the champion refitted on its test split too
    (training.refit all): then its first fit, which never saw those items; today's test
    items are mostly the same users' same last items, so the served one would score them
    as remembered.
    """
    tags = client.get_run(run_id).data.tags
    separate = tags.get("evaluated_model") == RunFile.EVAL_MODEL
    path = tags.get("evaluated_model_path" if separate else "model_path")
    if path and (workdir.local(path) / ModelFile.CONFIG).is_file():
        return workdir.local(path)
    artifact = EVALUATION_MODEL_ARTIFACT if separate else "trained_model"
    try:
        downloaded = Path(client.download_artifacts(run_id, artifact, str(tmp)))
    except TRACKING_FAILURES as exc:
        log.warning("champion model of run %s unavailable: %s", run_id, exc)
        return None
    return downloaded if (downloaded / ModelFile.CONFIG).is_file() else None


def _log_decision(
    client: MlflowClient,
    run_id: str,
    run_dir: Path,
    decision: gate.GateDecision,
    champion: Any,
) -> None:
    record = {**decision.to_dict(), "champion_version": str(champion.version) if champion else None}
    _write_json(run_dir / GATE_JSON, record)
    # Reasons quote exception text (paths, URIs): recorded in MLflow only redacted.
    client.log_dict(
        run_id, redact_tree(json.loads(json.dumps(record, default=_jsonable))), GATE_JSON
    )
    if (run_dir / GATE_DIR).is_dir():
        client.log_artifacts(run_id, str(run_dir / GATE_DIR), artifact_path=GATE_DIR)
    metrics = {"gate_promoted": float(decision.promote), "gate_forced": float(decision.forced)}
    if decision.primary is not None:
        p = decision.primary
        metrics.update(
            {
                "gate_primary_delta": p.delta,
                "gate_primary_ci_low": p.ci_low if p.ci_low is not None else float("nan"),
                "gate_primary_ci_high": p.ci_high if p.ci_high is not None else float("nan"),
                f"gate_champion_{p.metric}": p.champion,
            }
        )
    for check in decision.guardrails:
        metrics[f"gate_{check.metric}_delta"] = check.delta
    if decision.baseline is not None:
        metrics["gate_als_passed"] = float(decision.baseline.passed)
    for key, value in metrics.items():
        client.log_metric(run_id, key, float(value))
    tags = {
        "gate.decision": decision.decision,
        "gate.forced": str(decision.forced).lower(),
        "gate.champion_version": str(champion.version) if champion else "none",
        # MLflow tag values are limited (8000 chars in SQL stores): keep the start.
        "gate.reasons": "; ".join(decision.reasons)[:4000],
    }
    for tag, text in tags.items():
        client.set_tag(run_id, tag, redact_text(text))


def _recorded_decision(client: MlflowClient, run_id: str) -> gate.GateDecision | None:
    if "gate.decision" not in client.get_run(run_id).data.tags:
        return None
    with tempfile.TemporaryDirectory(prefix="recsys-gate-") as tmp:
        path = client.download_artifacts(run_id, GATE_JSON, tmp)
        return gate.GateDecision.from_dict(json.loads(Path(path).read_text()))


def _write_per_user(path: Path, users: list[str], per_user: dict[str, np.ndarray]) -> None:
    import pyarrow as pa

    columns = {"user_id": pa.array(users, pa.string())}
    columns.update({k: pa.array(v) for k, v in per_user.items()})
    pq.write_table(pa.table(columns), path)


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


def _jsonable(value: Any) -> Any:
    return float(value) if isinstance(value, np.floating | np.integer) else str(value)


def _write_json(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=_jsonable) + "\n")
    tmp.replace(path)
