"""The nightly stages, each usable alone on the previous stage's outputs.

preprocess -> train -> evaluate -> export; conductor.nightly runs them in order, then tracks
the run.
Each stage reads and writes only through `recsys.core.layout.Workdir`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import tensorflow as tf
import yaml

from beam_jobs.pipeline import run_preprocess
from conductor.promotion import pending_runs, publish_run
from recsys import evaluation as ev
from recsys.als_baseline import als_baseline
from recsys.core import mirror, storage
from recsys.core.config import ItemsConfig, RecsysConfig, parse_config
from recsys.core.errors import ConfigError, DataError, StorageError
from recsys.core.faults import fault_point
from recsys.core.layout import (
    DataFile,
    EmbeddingsFile,
    ModelFile,
    RunDir,
    RunFile,
    Workdir,
    mark_complete,
    new_run_id,
    next_version,
    replace_dir,
    require_complete,
    temp_name,
)
from recsys.core.progress import bar
from recsys.core.records import (
    AlsRecord,
    AlsTrialRecord,
    CandidateRecord,
    ExportRecord,
    MetricsRecord,
    RecordError,
    SampleSize,
    TrainRecord,
    read_stats,
    read_train,
    write_record,
)
from recsys.core.redact import redact_tree
from recsys.core.resolve import write_settings
from recsys.model import TrainedModel, read_vocab
from recsys.model_evaluation import evaluate_model
from recsys.serving_state import champion_record
from recsys.synthetic import items_path, write_csv, write_items_csv
from recsys.tracking import gate
from recsys.training.result import TrainResult
from recsys.training.trainer import IncrementalStart, is_chief, write_dir
from recsys.training.trainer import train as fit
from serving_export.activity import read_activity
from serving_export.integrity import (
    check_serving,
    record_checksums,
    record_path,
    version_problems,
)
from serving_export.release import finish_release, release_dir, stage_embeddings
from serving_export.savedmodels import export_savedmodels
from serving_export.verify import verify_export

log = logging.getLogger(__name__)

REPORTED_METRICS = (
    "recall_at_10",
    "recall_at_50",
    "recall_at_100",
    "ndcg_at_10",
    "mrr_at_100",
    "coverage_at_10",
)
"""The metrics of the evaluation protocol (docs/PROTOCOL.md), in the order reports list them."""


def resolve_input(
    config: RecsysConfig, workdir: Workdir, input_path: str | None
) -> tuple[RecsysConfig, Path | str]:
    """The config and raw input to read (a path, or a URI in object storage); the embedded
    synthetic log is generated on first use."""
    config = config.with_input(input_path)
    if config.data.source != "synthetic":
        given = config.data.path or ""
        return config, given if storage.is_uri(given) else Path(given)
    synth = config.data.synthetic
    digest = hashlib.sha256(synth.model_dump_json().encode()).hexdigest()[:12]
    path = workdir.raw() / f"synthetic-{digest}.csv"
    if not path.exists():
        log.info("generating the embedded synthetic log at %s", path)
        write_csv(synth, path)
    config = config.with_input(str(path))
    if synth.item_features and config.data.items is None:
        items = items_path(path)
        if not items.exists():
            write_items_csv(synth, items)
        data = config.data.model_copy(update={"items": ItemsConfig(path=str(items))})
        config = config.model_copy(update={"data": data})
    return config, path


def preprocess(
    config: RecsysConfig,
    workdir: Workdir,
    date: dt.date,
    input_path: str | None = None,
    output: Path | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Run the Beam job for `date`; returns the data folder and its stats."""
    config, raw = resolve_input(config, workdir, input_path)
    out = output or workdir.data(date)
    log.info("preprocess: %s -> %s", raw, out)
    stats = run_preprocess(config, raw, out, date)
    return out, stats


def train(
    config: RecsysConfig,
    workdir: Workdir,
    date: dt.date,
    data_dir: Path | None = None,
    run_dir: Path | None = None,
    callbacks: Sequence[Any] = (),
) -> tuple[Path | None, TrainResult]:
    """Train on the date's data; the run folder gets the model, history and config.

    `run_dir` reuses a folder (the nightly's run for this date and config); by default a new
    run folder is created. `callbacks` are extra Keras callbacks (progress reporting). On a
    non-chief multi-worker process the returned folder is None: the chief writes the run.
    """
    data_dir = require_complete(data_dir or workdir.data(date), "recsys preprocess")
    # Under MultiWorkerMirroredStrategy every worker runs this; only the chief owns the run
    # folder (workers' run ids would differ), the others train in step and keep nothing.
    chief = is_chief()
    created = run_dir is None  # a folder given by the caller (the nightly's) is reused
    run_dir = run_dir or workdir.run(date, new_run_id(config.digest()))
    if chief:
        run_dir.mkdir(parents=True, exist_ok=True)
    log.info("train: %s -> %s%s", data_dir, run_dir, "" if chief else " (non-chief worker)")
    # Keyed by date and config, not run id: rerunning a killed `train` resumes from here.
    backup = workdir.runs(date) / f".backup-{config.digest()}"
    start = incremental_start(config, workdir)
    try:
        result = fit(config, data_dir, backup_dir=backup, callbacks=list(callbacks), start=start)
    except BaseException as exc:
        if created:
            # Nothing was written into it yet (the checkpoints live in `backup`): a failed
            # run leaves no empty run folder behind, and the rerun resumes from `backup`.
            shutil.rmtree(run_dir, ignore_errors=True)
        if not isinstance(exc, Exception):
            raise
        corrupt = _corrupt_shard_error(data_dir, exc)
        if corrupt is not None:
            raise corrupt from None
        raise
    if not result.chief:
        _save_discarded(result.model, run_dir)
        return None, result
    shutil.rmtree(backup, ignore_errors=True)  # Keras empties it after a finished run
    result.model.save(run_dir / RunFile.MODEL)
    if result.evaluation_model is not None:
        result.evaluation_model.save(run_dir / RunFile.EVAL_MODEL)
    _write_json(run_dir / RunFile.HISTORY, result.history)
    evaluated = RunFile.EVAL_MODEL if result.evaluation_model is not None else RunFile.MODEL
    record = TrainRecord(
        # Where everyone else finds it: a path, or its URI for a workdir in a bucket.
        data_dir=workdir.public(data_dir),
        config_digest=config.digest(),
        data_fingerprint=read_stats(data_dir).fingerprint,
        examples_per_second=result.examples_per_second,
        steady_examples_per_second=result.steady_examples_per_second,
        epoch_seconds=result.epoch_seconds,
        seconds=result.seconds,
        strategy=result.strategy,
        replicas=result.replicas,
        precision=result.precision,
        best_epoch=result.best_epoch,
        refit_epochs=result.refit_epochs,
        refit_seconds=result.refit_seconds,
        refit_splits=list(result.refit_splits),
        dense_log_settings=result.dense_log_settings,
        input=result.input,
        incremental_from=None if start is None else str(start.model_dir),
        evaluated_model=evaluated.value,
        candidates=[CandidateRecord(**trial) for trial in result.candidates],
        chosen_candidate=result.chosen_candidate,
    )
    write_record(run_dir / RunFile.TRAIN, record)
    # Without credentials (tracking.uri may carry some): the digest ignores them, so `recsys
    # sync` still finds this run's MLflow twin from this file.
    clean = redact_tree(config.model_dump(mode="json"), environ={})
    (run_dir / RunFile.CONFIG).write_text(yaml.safe_dump(clean))
    write_settings(run_dir / RunFile.RESOLVED_CONFIG, result.resolved)
    mark_complete(run_dir)
    return run_dir, result


def incremental_start(config: RecsysConfig, workdir: Workdir) -> IncrementalStart | None:
    """`training.mode: incremental`: the champion's served model and the newest second of the
    data it was trained on (None: full training, logged by the trainer)."""
    champion = champion_record(workdir) if config.training.mode == "incremental" else None
    if champion is None:
        return None
    # The record names public paths (URIs in a bucket workdir): read their local copies.
    model_dir = workdir.local(champion.run_dir or "") / RunFile.MODEL
    if not champion.run_dir or not model_dir.is_dir():
        log.warning("incremental training: the champion's run folder is gone")
        return None
    try:
        since = read_stats(workdir.local(champion.data_dir or "")).max_timestamp
    except RecordError as exc:
        log.warning("incremental training: the champion's data cannot be used: %s", exc)
        return None
    return None if since is None else IncrementalStart(model_dir, int(since))


def _save_discarded(model: Any, run_dir: Path) -> None:
    """A non-chief worker saves too (the Keras multi-worker pattern), into a temp dir it drops."""
    tmp = write_dir(run_dir / RunFile.MODEL, chief=False)
    try:
        model.save(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _corrupt_shard_error(data_dir: Path, exc: Exception) -> DataError | None:
    """A DataError naming the unreadable TFRecord file behind `exc`, if that is the cause."""
    if not isinstance(exc, tf.errors.DataLossError | tf.errors.InvalidArgumentError):
        return None
    for path in sorted(data_dir.glob("*.tfrecord*")):
        compression = "GZIP" if path.name.endswith(".gz") else ""
        try:
            for _ in tf.data.TFRecordDataset(str(path), compression_type=compression):
                pass
        except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as err:
            reason = str(err.message).splitlines()[0][:200]
            return DataError(
                f"corrupt TFRecord shard {path} ({reason}): delete {data_dir} and rerun "
                "`recsys preprocess` (or `recsys nightly --rerun-from preprocess`)"
            )
    return None


def _run_dir(workdir: Workdir, date: dt.date, run_id: str | None) -> Path:
    if run_id:
        return require_complete(workdir.run(date, run_id), "recsys train")
    return workdir.latest_run(date)


def run_data_dir(run_dir: Path, workdir: Workdir | None = None) -> Path:
    """The data folder a training run was trained on (recorded in its train.json), found in
    `workdir`'s local copy when it was recorded by its URI."""
    recorded = read_train(run_dir).data_dir
    return workdir.local(recorded) if workdir is not None else Path(recorded)


def evaluate(
    config: RecsysConfig, workdir: Workdir, date: dt.date, run_id: str | None = None
) -> tuple[Path, MetricsRecord]:
    """Exact test-set evaluation of a run next to the popularity and ALS baselines (same
    protocol, same users)."""
    run_dir = _run_dir(workdir, date, run_id)
    data_dir = run_data_dir(run_dir, workdir)
    model_dir = RunDir(run_dir).evaluated_model
    log.info("evaluate: %s (%s) on %s (test split)", run_dir.name, model_dir.name, data_dir)
    eval_set, result = evaluate_model(config, model_dir, data_dir)
    result.write_per_user(run_dir / RunFile.PER_USER_EVAL, eval_set.users)
    counts = pq.read_table(data_dir / DataFile.ITEM_FEATURES)["train_count"].to_numpy()
    popularity = ev.popularity_scores(np.asarray(counts))
    baseline = ev.evaluate(popularity, eval_set, config.evaluation, "evaluate popularity")
    baselines = {"popularity": baseline.metrics}
    # 95% intervals over users; of the whole test population's metric when sampled.
    intervals = {"model": result.intervals, "popularity": baseline.intervals}
    als = None
    if config.evaluation.classic_baseline.enabled:
        als, als_result = _classic_baseline(config, model_dir, data_dir, eval_set, result)
        baselines[ALS] = als_result.metrics
        intervals[ALS] = als_result.intervals
    report = MetricsRecord(
        protocol="leave-last-out test item; train+validation items removed; full catalog",
        # eval_model: the run serves a refit that also trained on the test split.
        evaluated_model=model_dir.name,
        model=result.metrics,
        baselines=baselines,
        intervals=intervals,
        sample=SampleSize(users=len(eval_set.users), of=eval_set.population or len(eval_set.users)),
        als=als,
    )
    write_record(run_dir / RunFile.METRICS, report)
    return run_dir, report


ALS = "als"
"""The classic baseline's key in metrics.json's baselines and intervals (MLflow: `als_*`)."""


def _classic_baseline(
    config: RecsysConfig,
    model_dir: Path,
    data_dir: Path,
    eval_set: ev.EvalSet,
    result: ev.EvalResult,
) -> tuple[AlsRecord, ev.EvalResult]:
    """ALS chosen on validation and scored on the model's test users; the model's paired
    comparison with it on the gate's metric (a warning when the model loses)."""
    metric = config.gate.primary_metric
    if metric not in result.per_user:
        available = sorted(k for k in result.per_user if k != "rank")
        raise ConfigError(
            f"gate.primary_metric {metric!r} has no per-user values (available: {available}); "
            "the classic baseline is chosen and compared on it: set gate.primary_metric to one "
            "of them, or evaluation.classic_baseline.enabled to false"
        )
    catalog = read_vocab(model_dir / ModelFile.ITEM_VOCAB)
    als = als_baseline(config.evaluation, data_dir, catalog, eval_set, metric)
    comparison = gate.compare_with_baseline(
        metric, result.per_user[metric], als.test.per_user[metric], config.gate
    )
    best = als.choice.best
    record = AlsRecord(
        metric=metric,
        factors=best.setting.factors,
        regularization=best.setting.regularization,
        alpha=best.setting.alpha,
        iterations=als.iterations,
        validation=best.validation,
        trials=[
            AlsTrialRecord(
                factors=t.setting.factors,
                regularization=t.setting.regularization,
                alpha=t.setting.alpha,
                validation=t.validation,
                seconds=round(t.seconds, 3),
            )
            for t in als.choice.trials
        ],
        grid_size=als.choice.grid_size,
        budget_exhausted=als.choice.budget_exhausted,
        max_seconds=config.evaluation.classic_baseline.max_seconds,
        seconds=round(als.seconds, 3),
        comparison=comparison,
        notes=als.notes,
    )
    line = comparison.line("ALS")
    if comparison.model_loses:
        log.warning("evaluate: %s (evaluation.classic_baseline)", line)
    else:
        log.info("evaluate: %s", line)
    log.info("evaluate: ALS %s", record.settings())
    return record, als.test


@dataclass
class ExportResult:
    """Where a run's serving artifacts went."""

    version: int
    models: dict[str, Path]
    embeddings: dict[str, Path]
    verification: dict[str, Any] = field(default_factory=dict)


def export(
    config: RecsysConfig,
    workdir: Workdir,
    date: dt.date,
    run_id: str | None = None,
    verify: bool | None = None,
) -> ExportResult:
    """SavedModels (TF Serving layout) and embedding files for a run, verified when asked.

    Steps: reserve the version -> stage everything under one staging root -> verify the
    staged SavedModels in a fresh process -> release by rename -> finish (models.config,
    pruning) -> record export.json. TF Serving never sees an unverified version: nothing is
    released before every model is verified. A crash leaves the reserved version, which the
    rerun reuses (`keep_released` keeps what an earlier attempt released intact); the
    staging root is removed, and one left by a killed process goes at the next run.
    """
    run_dir = _run_dir(workdir, date, run_id)
    model = TrainedModel.load(run_dir / RunFile.MODEL)
    version = _reserve_version(run_dir, workdir)
    log.info("export: %s as version %d", run_dir.name, version)
    verify = config.export.verify if verify is None else verify
    if not verify:
        log.warning(
            "export: version %d is released WITHOUT the fresh-process check (export.verify "
            "is false or --no-verify): nothing reloads and compares the SavedModels",
            version,
        )
    timer = StepTimer(bar("export", 4 if verify else 3, "steps"))
    staging = workdir.export_root() / temp_name("staging", str(version))
    try:
        staged = export_savedmodels(
            model, staging, version, config.export.top_k, warmup=config.export.warmup
        )
        fault_point("export:staged", staging)
        timer.lap("savedmodels")
        report = _verify_staged(config, model, staged) if verify else {}
        if verify:
            timer.lap("verify")
        ann = _release_embeddings(config, workdir, run_dir, model, staging, staged, version, timer)
        models = _release_models(workdir, staged, version)
    finally:
        timer.close()
        shutil.rmtree(staging, ignore_errors=True)
    record = ExportRecord(
        version=version,
        models={k: workdir.public(v) for k, v in models.items()},
        embeddings={k: workdir.public(v) for k, v in _embedding_files(workdir, version).items()},
        embeddings_manifest=workdir.public(workdir.embeddings(version) / EmbeddingsFile.MANIFEST),
        ann=ann,
        serving=_finish_export(config, workdir, models, version),
        verification=report,
        seconds=timer.seconds,
    )
    write_record(run_dir / RunFile.EXPORT, record)
    log.info("export: seconds per step %s", timer.seconds)
    if verify:
        check_serving(workdir.root)  # what TF Serving loads, not only what was just staged
    return ExportResult(version, models, _embedding_files(workdir, version), report)


class StepTimer:
    """Seconds per named step of a stage, shown on its progress bar and recorded.

    Where export's time goes (export.json, the log): the SavedModels and their verification
    cost the same at any size, the embeddings grow with users and rows.
    """

    def __init__(self, steps: Any) -> None:
        self.steps = steps
        self.seconds: dict[str, float] = {}
        self._clock = time.perf_counter()

    def lap(self, step: str) -> None:
        """Close `step`: the time since the previous lap is its own."""
        now = time.perf_counter()
        self.seconds[step] = round(now - self._clock, 1)
        self._clock = now
        self.steps.set_postfix_str(f"{step} done", refresh=False)
        self.steps.update()

    def close(self) -> None:
        """Close the progress bar."""
        self.steps.close()


def _verify_staged(
    config: RecsysConfig, model: TrainedModel, staged: dict[str, Path]
) -> dict[str, Any]:
    """Reload the staged SavedModels in a fresh process and compare them with the model.

    Raises ExportVerificationError on any difference beyond export.tolerance; nothing has been
    released then.
    """
    report = verify_export(model, staged, config.export.tolerance, max_k=config.export.top_k)
    log.info("export verified in a fresh process: %s", _brief(report))
    return report


def _release_embeddings(
    config: RecsysConfig,
    workdir: Workdir,
    run_dir: Path,
    model: TrainedModel,
    staging: Path,
    staged: dict[str, Path],
    version: int,
    timer: StepTimer,
) -> dict[str, Any] | None:
    """Stage the embeddings, their manifest and the optional ANN index, then release them to
    embeddings/<version>/ by one rename (all of it or none); returns the ANN index's entry."""
    activity = read_activity(
        run_data_dir(run_dir, workdir), model.users, model.items, model.config.history_length
    )
    timer.lap("activity")
    emb_dir = staging / "embeddings" / str(version)
    written = stage_embeddings(model, emb_dir, version, staged, config.export, activity)
    release_dir(emb_dir, workdir.embeddings(version))
    timer.lap("embeddings")
    return written["ann"]


def _release_models(workdir: Workdir, staged: dict[str, Path], version: int) -> dict[str, Path]:
    """Rename each verified SavedModel into export/<name>/<version> and record its checksums.

    A version an earlier attempt of this run already released intact is kept as served
    (`keep_released`); a crash between two models leaves the others to the rerun.
    """
    models = {}
    for name, path in staged.items():
        models[name] = workdir.export(name) / str(version)
        models[name].parent.mkdir(parents=True, exist_ok=True)
        if keep_released(workdir.export_root(), name, version):
            continue
        replace_dir(path, models[name])
        record_checksums(workdir.export_root(), name, version)
        fault_point("export:released-one")
    return models


def _finish_export(
    config: RecsysConfig, workdir: Workdir, models: dict[str, Path], version: int
) -> dict[str, Any]:
    """Rewrite models.config (its champion/challenger labels kept: recsys.serving_state moves
    them) and prune versions beyond export.keep_versions, never the served ones or this one."""
    record = champion_record(workdir)
    champion = record.export_version if record else None
    export_config = config.export.model_copy(
        update={"serving_base_path": workdir.serving_base(config.export.serving_base_path)}
    )
    keep = [int(champion)] if champion and str(champion).isdigit() else []
    return finish_release(
        workdir.export_root(), workdir.embeddings_root(), models, version, export_config, keep
    )


def _embedding_files(workdir: Workdir, version: int) -> dict[str, Path]:
    """The released embedding tables of a version, by kind (items, users)."""
    return {
        kind: workdir.embeddings(version) / EmbeddingsFile[kind.upper()].value
        for kind in ("items", "users")
    }


def keep_released(export_root: Path, name: str, version: int) -> bool:
    """True when export/<name>/<version> is already released intact (kept as served).

    The version is reserved for this run, so a folder there was released (verified) by this
    very run before a crash, or is being repaired: a broken one is replaced by the fresh,
    verified copy; one without a record (a crash between rename and record) is recorded.
    """
    folder = export_root / name / str(version)
    if not folder.exists():
        return False
    problems = version_problems(export_root, name, version)
    if problems:
        log.warning("export: %s is broken (%s): replaced", folder, "; ".join(problems))
        return False
    if not record_path(export_root, name, version).is_file():
        record_checksums(export_root, name, version)
    log.info("export: %s already released, kept", folder)
    return True


def _reserve_version(run_dir: Path, workdir: Workdir) -> int:
    """The run's export version: reserved on first use, so a rerun after a crash reuses it.

    Without the reservation a crash after releasing some models (query/7) but not others
    would leave version 7 half-served and the rerun would release everything as version 8.
    """
    path = run_dir / RunFile.EXPORT_VERSION
    if path.is_file():
        return int(json.loads(path.read_text())["version"])
    names = ("query", "candidate", "retrieval")
    version = max(next_version(workdir.export(name)) for name in names)
    _write_json(path, {"version": version})
    return version


def _brief(report: dict[str, Any]) -> str:
    return json.dumps(report, default=str)[:300]


def sync(
    config: RecsysConfig, workdir: Workdir, date: dt.date, tracking_uri: str | None = None
) -> list[Any]:
    """Publish the date's runs left pending by an unreachable tracking server (oldest first)."""
    results = []
    for run_dir in pending_runs(workdir, date):
        # The run's own config: its digest identifies the run, whatever --config says now.
        run_config = parse_config(yaml.safe_load((run_dir / RunFile.CONFIG).read_text()))
        uri = tracking_uri or config.tracking.uri
        log.info("sync: publishing %s", run_dir)
        results.append(publish_run(run_config, workdir, date, run_dir, tracking_uri=uri))
    return results


def _write_json(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


def check_workdir(
    path: str, writable: bool = False, cache_dir: str | None = None, reader: bool = False
) -> Workdir:
    """The working directory, created if missing; refuses a file, and (writable) a folder
    this process cannot write (StorageError, before any stage starts).

    A bucket URI (`s3://...`, `gs://...`) gives a Workdir whose root is its local copy under
    `cache_dir` (recsys.core.mirror): the stages work there, and the copy is synced with the
    bucket by the commands that use it. A `reader` (a process that reads without the lock)
    gets a copy of its own, which a writer on the same machine never works in.
    """
    if storage.is_uri(path):
        uri = str(storage.ObjectPath.parse(path))
        copy = mirror.local_copy(uri, mirror.cache_dir(cache_dir), writable=not reader)
        local = check_workdir(str(copy), writable=True)
        return Workdir(local.root, remote=uri)
    root = Path(path).expanduser().resolve()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--workdir {path} exists and is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        if writable:
            tempfile.TemporaryFile(dir=root, prefix=".write-probe-").close()
    except OSError as exc:
        raise workdir_storage_error(root, exc) from None
    return Workdir(root)


def workdir_storage_error(root: Path, exc: OSError) -> StorageError:
    """The one-line StorageError for a working directory that cannot be written."""
    return StorageError(
        f"--workdir {root} cannot be written ({exc.strerror or exc}"
        f"{f': {exc.filename}' if exc.filename else ''}); nothing was changed. Make it "
        f"writable for uid {os.getuid()} (e.g. `chown -R {os.getuid()} {root}`, or remount "
        "it read-write) or pass another --workdir, then rerun the same command"
    )
