"""The nightly stages, each usable alone on the previous stage's outputs.

preprocess -> train -> evaluate -> export; `nightly` runs them in order and tracks the run.
Each stage reads and writes only through `recsys.layout.Workdir`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from recsys.config import RecsysConfig
from recsys.errors import ConfigError
from recsys.layout import Workdir, mark_complete, new_run_id, require_complete

log = logging.getLogger(__name__)

REPORTED_METRICS = (
    "recall_at_10",
    "recall_at_50",
    "recall_at_100",
    "ndcg_at_10",
    "mrr_at_100",
    "coverage_at_10",
)
"""The metrics of the DESIGN.md protocol, in the order reports list them."""


def resolve_input(
    config: RecsysConfig, workdir: Workdir, input_path: str | None
) -> tuple[RecsysConfig, Path]:
    """The config and raw input to read; the embedded synthetic log is generated on first use."""
    config = config.with_input(input_path)
    if config.data.source != "synthetic":
        return config, Path(config.data.path or "")
    from recsys.config import ItemsConfig
    from recsys.synthetic import items_path, write_csv, write_items_csv

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
    from beam_jobs.pipeline import run_preprocess

    config, raw = resolve_input(config, workdir, input_path)
    out = output or workdir.data(date)
    log.info("preprocess: %s -> %s", raw, out)
    stats = run_preprocess(config, raw, out, date)
    return out, stats


def train(
    config: RecsysConfig, workdir: Workdir, date: dt.date, data_dir: Path | None = None
) -> tuple[Path, Any]:
    """Train on the date's data; the run folder gets the model, history and config."""
    from recsys.training.trainer import train as fit

    data_dir = require_complete(data_dir or workdir.data(date), "recsys preprocess")
    run_dir = workdir.run(date, new_run_id(config.digest()))
    run_dir.mkdir(parents=True)
    log.info("train: %s -> %s", data_dir, run_dir)
    # Keyed by date and config, not run id: rerunning a killed `train` resumes from here.
    backup = workdir.runs(date) / f".backup-{config.digest()}"
    result = fit(config, data_dir, backup_dir=backup)
    shutil.rmtree(backup, ignore_errors=True)  # Keras empties it after a finished run
    result.model.save(run_dir / "model")
    _write_json(run_dir / "history.json", result.history)
    _write_json(
        run_dir / "train.json",
        {
            "data_dir": str(data_dir.resolve()),
            "examples_per_second": result.examples_per_second,
            "steady_examples_per_second": result.steady_examples_per_second,
            "epoch_seconds": result.epoch_seconds,
            "seconds": result.seconds,
            "strategy": result.strategy,
            "replicas": result.replicas,
            "precision": result.precision,
            "best_epoch": result.best_epoch,
        },
    )
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    mark_complete(run_dir)
    return run_dir, result


def _run_dir(workdir: Workdir, date: dt.date, run_id: str | None) -> Path:
    if run_id:
        return require_complete(workdir.run(date, run_id), "recsys train")
    return workdir.latest_run(date)


def run_data_dir(run_dir: Path) -> Path:
    """The data folder a training run was trained on (recorded in its train.json)."""
    return Path(json.loads((run_dir / "train.json").read_text())["data_dir"])


def evaluate_model(config: RecsysConfig, model_dir: Path, data_dir: Path) -> tuple[Any, Any]:
    """A saved model on data_dir's test split: (EvalSet, EvalResult), the one scoring path.

    `recsys evaluate` and the champion/challenger gate both call this, so a champion
    re-evaluated on today's data is scored exactly as the challenger.
    """
    from recsys import evaluation as ev
    from recsys.model import TrainedModel
    from recsys.training.dataset import load_split

    model = TrainedModel.load(model_dir)
    test = load_split(data_dir, "test")
    eval_set = ev.build_eval_set(
        model.items, test, [load_split(data_dir, "train"), load_split(data_dir, "validation")]
    )
    # Each test example carries the user's history before the test item (empty if the data
    # has none): the query the model would have seen at that moment.
    histories = list(test["history"]) if "history" in test else None
    scores = ev.dot_product_scores(
        model.user_embeddings(eval_set.users, histories), model.item_embeddings()
    )
    return eval_set, ev.evaluate(scores, eval_set, config.evaluation)


def evaluate(
    config: RecsysConfig, workdir: Workdir, date: dt.date, run_id: str | None = None
) -> tuple[Path, dict[str, Any]]:
    """Exact test-set evaluation of a run next to the popularity baseline (same protocol)."""
    import numpy as np
    import pyarrow.parquet as pq

    from recsys import evaluation as ev

    run_dir = _run_dir(workdir, date, run_id)
    data_dir = run_data_dir(run_dir)
    log.info("evaluate: %s on %s (test split)", run_dir.name, data_dir)
    eval_set, result = evaluate_model(config, run_dir / "model", data_dir)
    result.write_per_user(run_dir / "per_user_eval.parquet", eval_set.users)
    counts = pq.read_table(data_dir / "item_features.parquet")["train_count"].to_numpy()
    baseline = ev.evaluate(ev.popularity_scores(np.asarray(counts)), eval_set, config.evaluation)
    report = {
        "protocol": "leave-last-out test item; train+validation items removed; full catalog",
        "model": result.metrics,
        "baselines": {"popularity": baseline.metrics},
    }
    _write_json(run_dir / "metrics.json", report)
    return run_dir, report


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
    """SavedModels (TF Serving layout) and embedding files for a run, verified when asked."""
    run_dir = _run_dir(workdir, date, run_id)
    from recsys.layout import next_version
    from recsys.model import TrainedModel
    from serving_export.embeddings import write_item_embeddings, write_user_embeddings
    from serving_export.savedmodels import export_savedmodels
    from serving_export.verify import verify_export

    model = TrainedModel.load(run_dir / "model")
    version = max(next_version(workdir.export(name)) for name in ("query", "retrieval"))
    log.info("export: %s as version %d", run_dir.name, version)
    report: dict[str, Any] = {}
    # Verify in a staging root, then publish by rename: TF Serving never sees an unverified
    # version. Both models are verified before either is published.
    staging = workdir.root / "export" / f".staging-{version}-{uuid.uuid4().hex[:8]}"
    try:
        staged = export_savedmodels(model, staging, version, config.export.top_k)
        if config.export.verify if verify is None else verify:
            report = verify_export(model, staged, config.export.tolerance)
            log.info("export verified in a fresh process: %s", _brief(report))
        models = {}
        for name, path in staged.items():
            models[name] = workdir.export(name) / str(version)
            models[name].parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, models[name])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    emb_dir = workdir.embeddings(version)
    emb_dir.mkdir(parents=True, exist_ok=True)
    embeddings = {
        "items": write_item_embeddings(model, emb_dir / "items.parquet", version),
        "users": write_user_embeddings(
            model,
            model.users,
            emb_dir / "users.parquet",
            version,
            histories=_latest_histories(run_dir, model),
        ),
    }
    _write_json(
        run_dir / "export.json",
        {
            "version": version,
            "models": {k: str(v) for k, v in models.items()},
            "embeddings": {k: str(v) for k, v in embeddings.items()},
            "verification": report,
        },
    )
    return ExportResult(version, models, embeddings, report)


def _latest_histories(run_dir: Path, model: Any) -> list[list[str]] | None:
    """Each vocabulary user's latest items (all splits, by time) for their users.parquet vector."""
    if not model.config.history_length:
        return None
    from recsys.training.dataset import latest_histories

    data_dir = run_data_dir(run_dir)
    return latest_histories(data_dir, model.users, model.config.history_length)


def _brief(report: dict[str, Any]) -> str:
    return json.dumps(report, default=str)[:300]


@dataclass
class NightlyResult:
    """Everything a nightly run produced."""

    data_dir: Path
    run_dir: Path
    metrics: dict[str, Any]
    export: ExportResult
    mlflow_run_id: str
    timings: dict[str, float]
    published: Any = None  # recsys.promotion.PublishResult: version, gate decision


def nightly(
    config: RecsysConfig,
    workdir: Workdir,
    date: dt.date,
    input_path: str | None = None,
    force_promote: bool = False,
) -> NightlyResult:
    """All stages for one date, then MLflow: log, register, gate against champion, promote."""
    from recsys.promotion import device_layout, publish_run

    timings: dict[str, float] = {}
    t = time.perf_counter()
    data_dir, _ = preprocess(config, workdir, date, input_path)
    timings["preprocess_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    run_dir, trained = train(config, workdir, date, data_dir)
    timings["train_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    _, report = evaluate(config, workdir, date, run_dir.name)
    timings["evaluate_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    exported = export(config, workdir, date, run_dir.name, verify=True)
    timings["export_seconds"] = time.perf_counter() - t
    # Everything else is read back from the run folder, so `recsys sync` can redo this later.
    published = publish_run(
        config,
        workdir,
        date,
        run_dir,
        timings=timings,
        device=device_layout(trained),
        force_promote=force_promote,
    )
    mlflow_run_id = published.mlflow_run_id
    return NightlyResult(data_dir, run_dir, report, exported, mlflow_run_id, timings, published)


def sync(
    config: RecsysConfig, workdir: Workdir, date: dt.date, tracking_uri: str | None = None
) -> list[Any]:
    """Publish the date's runs left pending by an unreachable tracking server (oldest first)."""
    from recsys.config import parse_config
    from recsys.promotion import pending_runs, publish_run

    results = []
    for run_dir in pending_runs(workdir, date):
        # The run's own config: its digest identifies the run, whatever --config says now.
        run_config = parse_config(yaml.safe_load((run_dir / "config.yaml").read_text()))
        uri = tracking_uri or config.tracking.uri
        log.info("sync: publishing %s", run_dir)
        results.append(publish_run(run_config, workdir, date, run_dir, tracking_uri=uri))
    return results


def _write_json(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


def check_workdir(path: str) -> Workdir:
    """The working directory, created if missing; refuses a path that is a file."""
    root = Path(path).expanduser().resolve()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--workdir {path} exists and is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    return Workdir(root)
