"""`recsys nightly` and `recsys backfill`: every stage for a date, each skipped once done.

preprocess -> train -> evaluate -> export -> publish (MLflow log, register, gate, promote),
then retention and a Markdown summary. Each stage writes a `_SUCCESS.<stage>` marker into its
output folder when it finished (recsys.core.records.write_marker), keyed to the date and the config:

- preprocess: `data/<date>/_SUCCESS.preprocess`, holding the digest of the data settings;
- train, evaluate, export, publish: `runs/<date>/<run>/_SUCCESS.<stage>`, where <run> is the
  date's run folder for this config digest and data fingerprint (`nightly.json` names them).

A rerun after a crash continues at the first unfinished stage (training resumes from its
BackupAndRestore checkpoint); a rerun after success does nothing and says so. The whole run
holds the working directory's lock (conductor.lock).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from conductor import stages
from conductor.lock import WorkdirLock
from conductor.progress import KerasProgress
from conductor.promotion import device_layout, publish_run, sync_serving_state
from recsys.core import mirror
from recsys.core.config import RecsysConfig
from recsys.core.errors import (
    ACCESS_ERRNOS,
    STORAGE_ERRNOS,
    ConfigError,
    RecsysError,
    StageFailedError,
    StageNotReadyError,
    StorageError,
    access_errno,
    storage_errno,
)
from recsys.core.faults import fault_point
from recsys.core.layout import (
    STAGES,
    RunFile,
    Workdir,
    WorkdirFile,
    clean_temporaries,
    is_complete,
    missing_outputs,
    new_run_id,
)
from recsys.core.memory import release_memory, resident_bytes
from recsys.core.progress import shown
from recsys.core.records import (
    EvaluateMarker,
    ExportMarker,
    MetricsRecord,
    PreprocessMarker,
    PublishMarker,
    RecordError,
    RunKeyRecord,
    StageMarker,
    TrainRecord,
    read_marker,
    read_metrics,
    read_record,
    read_stats,
    read_train,
    write_marker,
    write_record,
)
from recsys.serving_state import champion_record
from recsys.tracking.live import EpochMetricsLogger
from recsys.tracking.runs import check_tracking_store, connect, log_file_redacted
from serving_export.integrity import check_serving

log = logging.getLogger(__name__)
M = TypeVar("M", bound=StageMarker)

RUN_KEY = RunFile.NIGHTLY
SUMMARY = RunFile.SUMMARY
CHAMPION_FILE = WorkdirFile.CHAMPION


@dataclass
class StageOutcome:
    """One stage of one nightly: ran or skipped (already done), and its recorded duration."""

    name: str
    status: str
    seconds: float
    note: str = ""


@dataclass
class NightlyResult:
    """What one nightly did (or found already done) for a date."""

    date: dt.date
    data_dir: Path
    run_dir: Path | None  # None: stopped after preprocess (`--until preprocess`)
    stages: list[StageOutcome] = field(default_factory=list)
    summary_path: Path | None = None
    # What serving could not follow (recsys.serving_state: an aliased version not exported).
    serving_problems: list[str] = field(default_factory=list)
    finished: bool = True  # False: stopped after an earlier stage (`--until`)

    @property
    def run(self) -> Path:
        """The run folder; every stage after preprocess has one."""
        if self.run_dir is None:
            raise StageNotReadyError(f"nightly {self.date} stopped after preprocess: no run yet")
        return self.run_dir

    @property
    def already_done(self) -> bool:
        """True when every stage had finished before this invocation."""
        return all(s.status == "skipped" for s in self.stages)

    def marker(self, stage: str) -> StageMarker | None:
        """The marker of a finished stage (None if it did not finish)."""
        folder = self.data_dir if stage == "preprocess" else self.run_dir
        return read_marker(folder, stage) if folder else None

    def outcome(self, kind: type[M]) -> M:
        """A finished stage's marker, by its type (StageNotReadyError if it did not finish)."""
        stage = kind.model_fields["stage"].default
        marker = self.marker(stage)
        if not isinstance(marker, kind):
            raise StageNotReadyError(f"nightly {self.date}: stage {stage} has not finished")
        return marker


def preprocess_digest(config: RecsysConfig) -> str:
    """What the Beam job's output depends on: the data and preprocess settings (and input)."""
    payload = {
        "data": config.data.model_dump(mode="json"),
        "preprocess": config.preprocess.model_dump(mode="json"),
    }
    canonical = json.dumps(payload, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def run_nightly(
    config: RecsysConfig,
    workdir: Workdir,
    date: dt.date,
    *,
    input_path: str | None = None,
    force_promote: bool = False,
    rerun_from: str | None = None,
    progress: bool = True,
    until: str | None = None,
) -> NightlyResult:
    """All stages for `date` under the workdir lock; finished stages are skipped.

    `until` stops after that stage (an orchestrator's task per stage: the same run folder,
    markers and resume as a whole nightly); the night's checks, retention and summary run
    with its last stage, publish.
    A workdir in a bucket is pulled first and pushed after every stage, so a rerun anywhere
    continues from the last stage that finished (recsys.core.mirror).
    """
    command = f"recsys nightly --date {date}"
    with WorkdirLock(workdir.root, command=command, remote=workdir.remote), shown(progress):
        mirror.pull(workdir)
        clean_temporaries(workdir.root)
        # Before the first stage: a store that cannot be used would only fail the publish.
        check_tracking_store(config, workdir.root)
        nightly = _Nightly(config, workdir, date, input_path, force_promote, progress)
        result = nightly.run(rerun_from, until)
        # What the night changed after its last stage: serving state, retention, the summary.
        mirror.push(workdir)
        return result


def backfill(
    config: RecsysConfig,
    workdir: Workdir,
    start: dt.date,
    end: dt.date,
    *,
    input_path: str | None = None,
    on_date: Callable[[NightlyResult], None] | None = None,
) -> list[NightlyResult]:
    """Nightly for each date from start to end, in order; the first failure stops it."""
    if end < start:
        raise ConfigError(f"--end {end} is before --start {start}")
    results = []
    command = f"recsys backfill --start {start} --end {end}"
    with WorkdirLock(workdir.root, command=command, remote=workdir.remote):
        day = start
        while day <= end:
            log.info("backfill: %s (%d of %d)", day, (day - start).days + 1, (end - start).days + 1)
            try:
                result = run_nightly(config, workdir, day, input_path=input_path)
            except RecsysError as exc:
                raise type(exc)(f"backfill stopped at {day}: {exc}") from exc
            results.append(result)
            if on_date is not None:
                on_date(result)
            day += dt.timedelta(days=1)
    return results


class _Nightly:
    """One date's run: finds what is done, runs the rest, records each stage."""

    def __init__(
        self,
        config: RecsysConfig,
        workdir: Workdir,
        date: dt.date,
        input_path: str | None,
        force_promote: bool,
        progress: bool,
    ) -> None:
        self.config, self.workdir, self.date = config, workdir, date
        self.input_path, self.force_promote, self.progress = input_path, force_promote, progress
        self.outcomes: list[StageOutcome] = []
        self._created_run_dir = False
        # Set when training runs in this invocation; else publish reads train.json.
        self._device: dict[str, str] | None = None

    def run(self, rerun_from: str | None, until: str | None = None) -> NightlyResult:
        redo = set(STAGES[STAGES.index(rerun_from) :]) if rerun_from else set()
        last = STAGES.index(until or STAGES[-1])
        # Of the config as given, not as resolved: the embedded data's generated path depends on
        # where the workdir is, its content only on data.synthetic.
        self._pre_digest = preprocess_digest(self.config.with_input(self.input_path))
        data_dir = self._stage("preprocess", redo, self._preprocess)
        if last == 0:
            return NightlyResult(self.date, data_dir, None, self.outcomes, finished=False)
        run_dir = self._run_dir(data_dir, fresh="train" in redo)
        self.run_dir = run_dir
        actions = {
            "train": self._train,
            "evaluate": self._evaluate,
            "export": self._export,
            "publish": self._publish,
        }
        for name in STAGES[1 : last + 1]:  # the declared order (recsys.core.layout.STAGE_SPECS)
            self._stage(name, redo, actions[name])
        result = NightlyResult(self.date, data_dir, run_dir, self.outcomes)
        if last < len(STAGES) - 1:
            result.finished = False
            return result
        # Every night, done or not: serving follows the registry's aliases (whoever moved
        # them), and what TF Serving loads must be what was published.
        result.serving_problems = sync_serving_state(self.config, self.workdir).problems
        check_serving(self.workdir.root)
        if result.already_done:
            log.info("nightly %s: every stage was already done; nothing to do", self.date)
            result.summary_path = run_dir / SUMMARY
            return result
        self._retention()
        result.summary_path = write_summary(result)
        _log_summary(self.config, self.workdir, result)
        return result

    # -- stage bookkeeping -------------------------------------------------------------------

    def _folder(self, name: str) -> Path:
        return self.workdir.data(self.date) if name == "preprocess" else self.run_dir

    def _done(self, name: str) -> StageMarker | None:
        marker = read_marker(self._folder(name), name)
        if marker is None or missing_outputs(name, self._folder(name)):
            return None
        if isinstance(marker, PreprocessMarker):
            valid = is_complete(self._folder(name)) and marker.digest == self._pre_digest
            return marker if valid else None
        return marker

    def _stage(self, name: str, redo: set[str], action: Callable[[], dict[str, Any]]) -> Any:
        number = STAGES.index(name) + 1
        done = None if name in redo else self._done(name)
        if done is not None:
            log.info(
                "stage %d/%d %s: already done (%s), skipped",
                number,
                len(STAGES),
                name,
                done.finished,
            )
            self.outcomes.append(StageOutcome(name, "skipped", done.seconds))
            return self._folder(name)
        log.info("stage %d/%d %s: running", number, len(STAGES), name)
        start = time.perf_counter()
        try:
            info = action()
        except RecsysError:
            raise
        except OSError as exc:
            if exc.errno in STORAGE_ERRNOS or exc.errno in ACCESS_ERRNOS:
                raise _storage_error(name, exc) from None
            raise _failed(name, exc) from exc
        except Exception as exc:
            storage = _storage_in_message(name, exc)
            if storage is not None:
                raise storage from None
            raise _failed(name, exc) from exc
        seconds = time.perf_counter() - start
        # The next stage's peak must not land on this one's freed-but-kept heap.
        released = release_memory()
        log.info(
            "stage %s: released %d MiB (resident now %d MiB)",
            name,
            released >> 20,
            resident_bytes() >> 20,
        )
        folder = self._folder(name)
        write_marker(folder, name, seconds, info)
        mirror.push(self.workdir)  # a bucket workdir keeps every finished stage
        log.info("stage %d/%d %s: done in %.1f s", number, len(STAGES), name, seconds)
        self.outcomes.append(StageOutcome(name, "ran", seconds))
        return folder

    # -- the stages ----------------------------------------------------------------------------

    def _preprocess(self) -> dict[str, Any]:
        _, stats = stages.preprocess(self.config, self.workdir, self.date, self.input_path)
        # Beam's own time: the synthetic log's generation (first run) is not preprocessing.
        seconds = float(stats["pipeline_seconds"])
        rows = int(stats.get("input_rows") or 0)
        log.info(
            "preprocess: %s rows in %.1f s (%s rows/s): splits %s, rejected %s",
            f"{rows:,}",
            seconds,
            f"{rows / max(seconds, 1e-9):,.0f}",
            stats.get("splits"),
            stats.get("rejected"),
        )
        return {
            "digest": self._pre_digest,
            "fingerprint": stats.get("fingerprint"),
            "input_rows": stats.get("input_rows"),
            "rejected": stats.get("rejected"),
            "splits": stats.get("splits"),
            "pipeline_seconds": round(seconds, 3),
        }

    def _run_dir(self, data_dir: Path, fresh: bool) -> Path:
        """This date's run folder for the config and data: the existing one, else a new one."""
        key = RunKeyRecord(
            config_digest=self.config.digest(), data_fingerprint=read_stats(data_dir).fingerprint
        )
        runs = self.workdir.runs(self.date)
        for candidate in sorted(runs.iterdir(), reverse=True) if runs.is_dir() else []:
            if not candidate.is_dir():  # an operator's note or a download beside the runs
                continue
            # A fresh run (train redone) may still take a folder whose training never finished.
            trained = read_marker(candidate, "train") is not None
            if _run_key(candidate) == key and not (fresh and trained):
                return candidate
        run_dir = self.workdir.run(self.date, new_run_id(self.config.digest()))
        run_dir.mkdir(parents=True)
        write_record(run_dir / RUN_KEY, key)
        self._created_run_dir = True
        return run_dir

    def _train(self) -> dict[str, Any]:
        stats = read_stats(self.workdir.data(self.date)).as_dict()
        # The night's MLflow run is opened now, so each epoch can be watched as it ends.
        callbacks: list[Any] = [
            EpochMetricsLogger(
                self.config, self.workdir.root, self.date, stats, run_folder=self.run_dir.name
            )
        ]
        if self.progress:
            callbacks.append(KerasProgress())
        try:
            _, result = stages.train(
                self.config,
                self.workdir,
                self.date,
                self.workdir.data(self.date),
                run_dir=self.run_dir,
                callbacks=callbacks,
            )
        except BaseException:
            self._drop_empty_run_dir()
            raise
        self._device = device_layout(result)
        return {"best_epoch": result.best_epoch, "examples_per_second": result.examples_per_second}

    def _drop_empty_run_dir(self) -> None:
        """Remove the run folder this invocation created if training left nothing in it.

        Its checkpoints live in `runs/<date>/.backup-*`, so the rerun resumes without it;
        only this run's own, still empty folder is removed (never one it did not create).
        """
        leftover = [p.name for p in self.run_dir.iterdir()] if self.run_dir.is_dir() else None
        if self._created_run_dir and leftover == [RUN_KEY]:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _evaluate(self) -> dict[str, Any]:
        _, report = stages.evaluate(self.config, self.workdir, self.date, self.run_dir.name)
        return {"metrics": report.model}

    def _export(self) -> dict[str, Any]:
        # export.verify decides, as for `recsys export` (stages.export warns when it is off).
        exported = stages.export(self.config, self.workdir, self.date, self.run_dir.name)
        return {"version": exported.version, "verified": bool(exported.verification)}

    def _publish(self) -> dict[str, Any]:
        fault_point("publish:before")
        timings = {f"{o.name}_seconds": o.seconds for o in self.outcomes if o.name != "publish"}
        published = publish_run(
            self.config,
            self.workdir,
            self.date,
            self.run_dir,
            timings=timings,
            device=self._device,
            force_promote=self.force_promote,
        )
        decision = published.decision
        return {
            "mlflow_run_id": published.mlflow_run_id,
            "registered_version": published.version,
            "champion_version": published.champion_version,
            "decision": decision.decision,
            "promoted": decision.promote,
            "summary": decision.summary(),
            "notes": published.notes,
            "checks": [
                {
                    "metric": c.metric,
                    "delta": c.delta,
                    "ci_low": c.ci_low,
                    "ci_high": c.ci_high,
                    "passed": c.passed,
                }
                for c in decision.checks
            ],
        }

    def _retention(self) -> None:
        keep = self.config.nightly.keep_days
        if keep:
            removed = apply_retention(self.workdir, keep)
            if removed:
                log.info("retention: removed %s", ", ".join(str(p) for p in removed))


def _run_key(run_dir: Path) -> RunKeyRecord | None:
    """The run folder's nightly.json; None for none, or one of an earlier release (the night
    then trains in a new folder rather than guess what the old one was for)."""
    if not (run_dir / RUN_KEY).is_file():
        return None
    try:
        return read_record(RunKeyRecord, run_dir / RUN_KEY)
    except RecordError as exc:
        log.warning("run folder %s not reused: %s", run_dir, exc)
        return None


def _failed(stage: str, exc: BaseException) -> StageFailedError:
    log.error("stage %s failed", stage, exc_info=exc)
    first = str(exc).splitlines()[0][:300] if str(exc) else ""
    return StageFailedError(
        f"stage {stage} failed: {type(exc).__name__}: {first} (traceback in the log above); "
        "rerun the same command to continue from this stage"
    )


def _storage_error(stage: str, exc: OSError) -> StorageError:
    where = f" writing {exc.filename}" if exc.filename else ""
    fix = (
        f"make it writable for uid {os.getuid()}"
        if exc.errno in ACCESS_ERRNOS
        else "free space (or fix the volume)"
    )
    return StorageError(
        f"stage {stage}: {exc.strerror or exc}{where}; {fix} and rerun the same command: "
        "finished stages are skipped and the serving exports are unchanged"
    )


def _storage_in_message(stage: str, exc: Exception) -> StorageError | None:
    """TensorFlow reports a full disk as its own error types; recognise them by message."""
    code = storage_errno(exc) or access_errno(exc)
    return None if code is None else _storage_error(stage, OSError(code, os.strerror(code)))


# -- retention ----------------------------------------------------------------------------------


def apply_retention(workdir: Workdir, keep_days: int) -> list[Path]:
    """Delete data/ and runs/ of all but the newest `keep_days` dates, never the champion's."""
    champion = champion_record(workdir)
    folders = (champion.run_dir, champion.data_dir) if champion else ()
    protected = {workdir.local(p).resolve() for p in folders if p}
    removed: list[Path] = []
    for parent in (workdir.root / "data", workdir.root / "runs"):
        if not parent.is_dir():
            continue
        dates = sorted(p for p in parent.iterdir() if p.is_dir() and _is_date(p.name))
        for folder in dates[: max(len(dates) - keep_days, 0)]:
            removed += _remove_unprotected(folder, protected)
    return removed


def _remove_unprotected(folder: Path, protected: set[Path]) -> list[Path]:
    resolved = folder.resolve()
    if resolved in protected:
        return []
    inside = [p for p in protected if resolved in p.parents]
    if not inside:
        shutil.rmtree(folder)
        return [folder]
    # A date folder holding the champion's run: remove its other runs only.
    removed = []
    for child in folder.iterdir():
        if child.resolve() not in protected and not any(
            child.resolve() in p.parents for p in inside
        ):
            shutil.rmtree(child) if child.is_dir() else child.unlink()
            removed.append(child)
    return removed


def _is_date(name: str) -> bool:
    try:
        dt.date.fromisoformat(name)
    except ValueError:
        return False
    return True


# -- summary -------------------------------------------------------------------------------------


def write_summary(result: NightlyResult) -> Path:
    """The run's Markdown summary: stages and timings, counts, metrics, gate decision."""
    pre, ev = result.outcome(PreprocessMarker), result.outcome(EvaluateMarker)
    exp, pub = result.outcome(ExportMarker), result.outcome(PublishMarker)
    lines = [f"# recsys nightly {result.date}", "", f"Run folder: `{result.run_dir}`", ""]
    lines += ["| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.1f} |" for s in result.stages]
    lines += [
        "",
        "## Data",
        f"Input rows {pre.input_rows}, rejected {pre.rejected}; "
        + ", ".join(f"{k} {v}" for k, v in pre.splits.items()),
        "",
    ]
    lines += _metrics_table(result.run, ev.metrics)
    lines += als_lines(read_metrics(result.run), "- ")
    if (result.run / RunFile.TRAIN).is_file():  # a summary of a run without one says less
        lines += candidate_lines(read_train(result.run), "- ")
    lines += [
        "",
        "## Gate and export",
        f"- Decision: {pub.summary}",
        f"- Registered version {pub.registered_version}; champion now "
        f"{pub.champion_version}; MLflow run `{pub.mlflow_run_id}`",
        f"- Export version {exp.version}"
        + ("" if exp.verified else " (NOT verified: export.verify is false)"),
        *(f"- Note: {note}" for note in pub.notes),
        *(f"- Serving: {problem}" for problem in result.serving_problems),
        "",
    ]
    path = result.run / SUMMARY
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(path)
    return path


def _metrics_table(run_dir: Path, metrics: dict[str, float]) -> list[str]:
    """Test metrics next to the baselines measured under the same protocol (metrics.json)."""
    report = read_metrics(run_dir)
    baselines = report.baselines
    users = int(metrics.get("eval_users", 0))
    lines = [
        f"## Test metrics ({users} users; {report.protocol})",
        "",
        "| metric | model | " + " | ".join(baselines) + " |",
        "|---|---|" + "---|" * len(baselines),
    ]
    for name, value in metrics.items():
        if name == "eval_users":
            continue
        others = " | ".join(f"{b.get(name, float('nan')):.4f}" for b in baselines.values())
        lines.append(f"| {name} | {value:.4f} | {others} |")
    return lines


def als_lines(report: MetricsRecord, prefix: str = "") -> list[str]:
    """The classic baseline in plain words: who won on the gate's metric, then how ALS was
    chosen (none when it was not fitted)."""
    als = report.als
    if als is None:
        return []
    return [
        "",
        f"{prefix}{als.comparison.line('ALS')}",
        f"{prefix}ALS setting (chosen on validation): {als.settings()}",
    ]


def candidate_lines(train: TrainRecord, prefix: str = "") -> list[str]:
    """training.candidates in plain words: each first fit's validation score, the kept one
    marked (none without candidates)."""
    if not train.candidates:
        return []
    lines = ["", f"{prefix}Candidates (first fits, chosen on validation):"]
    return lines + [f"{prefix}  {line}" for line in train.candidate_lines()]


def _log_summary(config: RecsysConfig, workdir: Workdir, result: NightlyResult) -> None:
    published = result.marker("publish")
    if not isinstance(published, PublishMarker) or result.summary_path is None:
        return
    run_id = published.mlflow_run_id
    try:
        log_file_redacted(connect(config, workdir.root), run_id, result.summary_path)
    except Exception as exc:  # the summary is in the run folder either way
        log.warning("could not log %s to MLflow: %s", result.summary_path.name, exc)
