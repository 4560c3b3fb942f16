"""The typed files one stage writes and another reads (TFX-style artifacts, as pydantic models).

Each record names its kind and the version of its format, so a reader refuses, with the file,
the field and the command that rewrites it, a file from another release or another stage
instead of failing later on a missing key:

==========================  ===============================  =============================
record                      file                             written by
==========================  ===============================  =============================
`StatsRecord`               data/<date>/stats.json           recsys preprocess (Beam job)
`RunKeyRecord`              runs/<date>/<run>/nightly.json   recsys nightly (run lookup)
`TrainRecord`               runs/<date>/<run>/train.json     recsys train
`MetricsRecord`             runs/<date>/<run>/metrics.json   recsys evaluate
`ExportRecord`              runs/<date>/<run>/export.json    recsys export
`PreprocessMarker` ...      <folder>/_SUCCESS.<stage>        recsys nightly (per stage)
==========================  ===============================  =============================

The stage markers are the nightly's own record of each finished stage (when, how long, what
it did); the run's summary.md and the CLI's report are written from them.

`read_record(TrainRecord, path)` validates; `write_record(path, record)` writes atomically
(a temporary sibling renamed over the file, so a reader never sees half a record).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
)

from recsys.core.errors import StageNotReadyError
from recsys.core.layout import DataFile, RunFile, stage_marker, temp_name

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""The format every record of this release is written in (raised on an incompatible change)."""


class RecordError(StageNotReadyError):
    """A stage's record is missing, unreadable, from another release or of another kind; the
    message names the file, the field and the command that writes it again (exit 4)."""


class StageRecord(BaseModel):
    """Base of every record: its kind and format version, checked before any field."""

    # NaN stays NaN (as json.dumps writes it), not null: a metric can be undefined.
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    KIND: ClassVar[str]
    PRODUCER: ClassVar[str]  # the command that writes it again, for error messages

    record: str
    format_version: int = FORMAT_VERSION


class StatsRecord(StageRecord):
    """stats.json: the Beam job's counts (they reconcile every input line), vocab sizes, time
    range and the data fingerprint. The typed fields are those other stages read; the rest of
    the document (rejections by reason, drift, popularity, sequence lengths) is kept as is."""

    # The Beam job's report grows with its checks: other keys are kept, not refused.
    model_config = ConfigDict(extra="allow", frozen=True, ser_json_inf_nan="constants")
    KIND: ClassVar[str] = "stats"
    PRODUCER: ClassVar[str] = "recsys preprocess"

    record: Literal["stats"] = "stats"
    run_date: str
    fingerprint: str
    input_lines: int = Field(ge=0)
    input_rows: int = Field(ge=0)
    accepted: int = Field(ge=0)
    rejected: int = Field(ge=0)
    duplicates: int = Field(ge=0)
    splits: dict[str, int]
    users: int = Field(ge=0)
    items: int = Field(ge=0)
    min_timestamp: int | None = None
    max_timestamp: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The whole document (typed fields and the rest), as JSON-ready values."""
        return self.model_dump(mode="json")


class RunKeyRecord(StageRecord):
    """nightly.json: what makes a run folder the night's run for a config and a data set."""

    KIND: ClassVar[str] = "run_key"
    PRODUCER: ClassVar[str] = "recsys nightly"

    record: Literal["run_key"] = "run_key"
    config_digest: str
    data_fingerprint: str | None


class ChampionRecord(StageRecord):
    """champion.json: the served model's registered version and where its run, data and export
    are, cached from the registry's `champion` alias (retention and incremental training read
    it while the tracking server is down)."""

    KIND: ClassVar[str] = "champion"
    PRODUCER: ClassVar[str] = "recsys repair"

    record: Literal["champion"] = "champion"
    model_name: str
    registered_version: str
    run_dir: str | None = None  # the run folder's public path (a bucket URI for a bucket workdir)
    data_dir: str | None = None
    export_version: str | None = None  # export/<model>/<N>; None: the run was never exported
    run_date: str | None = None


class CandidateRecord(BaseModel):
    """One first fit of `training.candidates`: its settings, validation score and cost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, description="0: the config's own settings.")
    settings: dict[str, bool | int | float | str]
    metric: str
    validation: float | None = Field(description="The kept epoch's value (null: none).")
    best_epoch: int | None
    epochs: int = Field(ge=0)
    seconds: float = Field(ge=0)
    curve: list[float | None] = Field(
        default_factory=list,
        description="`metric` on the validation split after each epoch run (null: not scored).",
    )
    pruned_after: int | None = Field(
        None,
        ge=1,
        description="training.candidates_prune_after stopped the fit after this epoch, as it "
        "trailed an earlier candidate (null: it ran its whole first fit).",
    )

    @field_validator("validation", mode="before")
    @classmethod
    def _nan_is_none(cls, value: object) -> object:
        return None if isinstance(value, float) and math.isnan(value) else value

    @field_validator("curve", mode="before")
    @classmethod
    def _nan_in_curve_is_none(cls, value: object) -> object:
        if not isinstance(value, list):
            return value
        return [None if isinstance(v, float) and math.isnan(v) else v for v in value]

    def line(self) -> str:
        """`key=value, ...: validation metric 0.1234` in plain words."""
        score = "no score" if self.validation is None else f"{self.validation:.4f}"
        pruned = "" if self.pruned_after is None else f" (pruned after epoch {self.pruned_after})"
        return f"{settings_text(self.settings)}: validation {self.metric} {score}{pruned}"


def settings_text(settings: Mapping[str, Any]) -> str:
    """`key=value, ...` of a candidate's settings, or "the config itself" for none."""
    if not settings:
        return "the config itself"
    return ", ".join(f"{key}={value}" for key, value in sorted(settings.items()))


class TrainRecord(StageRecord):
    """train.json: where the run's data is, how it trained (device, speed, refit) and on what."""

    KIND: ClassVar[str] = "train"
    PRODUCER: ClassVar[str] = "recsys train"

    record: Literal["train"] = "train"
    data_dir: str = Field(description="The data folder: a path, or its URI in a bucket.")
    config_digest: str
    data_fingerprint: str | None
    examples_per_second: float = Field(ge=0)
    steady_examples_per_second: float = Field(ge=0)
    epoch_seconds: list[float]
    seconds: float = Field(ge=0)
    strategy: str
    replicas: int = Field(ge=1)
    precision: str
    best_epoch: int | None
    refit_epochs: int | None
    refit_seconds: float = Field(ge=0)
    refit_splits: list[str]
    dense_log_settings: dict[str, bool | int | float | str]
    input: str = Field(pattern="^(rows|sequences)$")
    incremental_from: str | None
    evaluated_model: str = Field(
        pattern="^(model|eval_model)$",
        description="What metrics.json scores: the served model, or the first fit (refit all).",
    )
    candidates: list[CandidateRecord] = Field(
        default_factory=list,
        description="training.candidates: every first fit tried, the config's own first "
        "(empty: none configured).",
    )
    chosen_candidate: int | None = Field(
        None, ge=0, description="The index in `candidates` of the fit kept."
    )

    def candidate_lines(self) -> list[str]:
        """Each candidate tried and which was kept, one line each (none without candidates)."""
        return [
            f"{c.line()}{' (kept)' if c.index == self.chosen_candidate else ''}"
            for c in self.candidates
        ]

    def device(self) -> dict[str, str]:
        """The device layout it trained on (the MLflow tags' `device.*`)."""
        return {
            "strategy": self.strategy,
            "replicas": str(self.replicas),
            "precision": self.precision,
        }


class SampleSize(BaseModel):
    """How many test users were scored, of how many."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    users: int = Field(ge=0)
    of: int = Field(ge=0)


class PairedComparison(BaseModel):
    """The model against a baseline on one metric, paired on the same test users: the mean
    per-user difference (model - baseline) and its bootstrap interval."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    metric: str
    model: float
    baseline: float
    delta: float
    ci_low: float
    ci_high: float
    confidence: float = Field(gt=0, lt=1)
    users: int = Field(ge=0)

    @property
    def model_loses(self) -> bool:
        """The model's point estimate is below the baseline's (NaN counts as losing)."""
        return not self.delta >= 0

    def line(self, baseline: str) -> str:
        """One plain sentence: who won on the metric, by how much, and the interval."""
        relative = ""
        if self.baseline and math.isfinite(self.delta):  # relative to the baseline's score
            relative = f"{self.delta / self.baseline:+.1%}; "
        numbers = (
            f"({relative}model - {baseline} {self.delta:+.4f}, {self.confidence:.0%} CI "
            f"[{self.ci_low:+.4f}, {self.ci_high:+.4f}] over {self.users} users)"
        )
        if self.model_loses:
            head = f"{baseline} beat the model on {self.metric}: {self.baseline:.4f} vs "
            return head + f"{self.model:.4f} {numbers}"
        verb = "matched" if self.delta == 0 else "beat"
        head = f"The model {verb} {baseline} on {self.metric}: {self.model:.4f} vs "
        return head + f"{self.baseline:.4f} {numbers}"


class AlsTrialRecord(BaseModel):
    """One ALS setting tried: fitted on the train positions, scored on validation."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    factors: int = Field(ge=1)
    regularization: float
    alpha: float
    validation: float = Field(description="The metric on the validation positions (NaN: none).")
    seconds: float = Field(ge=0)


class AlsRecord(BaseModel):
    """The classic baseline of the night (implicit ALS): the setting chosen on validation,
    what the search tried and cost, and the model's paired comparison with it on the test."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    metric: str = Field(description="What the setting was chosen on and compared on.")
    factors: int = Field(ge=1)
    regularization: float
    alpha: float
    iterations: int = Field(ge=1)
    validation: float = Field(description="The chosen setting's validation score (NaN: none).")
    trials: list[AlsTrialRecord]
    grid_size: int = Field(ge=1)
    budget_exhausted: bool = Field(description="max_seconds stopped the search mid-grid.")
    max_seconds: float = Field(gt=0)
    seconds: float = Field(ge=0, description="All of it: search, refit and test scoring.")
    comparison: PairedComparison
    notes: list[str] = Field(default_factory=list)

    def settings(self) -> str:
        """The chosen setting and how it was found, in a few words."""
        cut = ", stopped by max_seconds" if self.budget_exhausted else ""
        return (
            f"factors {self.factors}, regularization {self.regularization:g}, alpha "
            f"{self.alpha:g}; validation {self.metric} {self.validation:.4f}; "
            f"{len(self.trials)} of {self.grid_size} settings tried{cut}; {self.seconds:.1f} s"
        )


class MetricsRecord(StageRecord):
    """metrics.json: the evaluate stage's test metrics beside the popularity baseline (and
    ALS, when evaluation.classic_baseline is enabled)."""

    KIND: ClassVar[str] = "metrics"
    PRODUCER: ClassVar[str] = "recsys evaluate"

    record: Literal["metrics"] = "metrics"
    protocol: str
    evaluated_model: str
    model: dict[str, float]
    baselines: dict[str, dict[str, float]]
    # 95% intervals over users: {"model": {metric: (low, high)}, "popularity": {...}}.
    intervals: dict[str, dict[str, tuple[float, float]]]
    sample: SampleSize
    # Optional with a default: metrics.json files written before it still read (no ALS).
    als: AlsRecord | None = None

    @model_serializer(mode="wrap")
    def _no_als_key_without_als(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Without ALS (evaluation.classic_baseline disabled) the file is what it was before
        # the field existed: no `als` key at all, not `null`.
        data = handler(self)
        if isinstance(data, dict) and data.get("als", False) is None:
            del data["als"]
        return data


class ExportRecord(StageRecord):
    """export.json: the version published, where its SavedModels and embeddings went."""

    KIND: ClassVar[str] = "export"
    PRODUCER: ClassVar[str] = "recsys export"

    record: Literal["export"] = "export"
    version: int = Field(ge=1)
    # name (query, candidate, retrieval) -> its folder: a path, or a URI in a bucket.
    models: dict[str, str]
    embeddings: dict[str, str]
    embeddings_manifest: str
    ann: dict[str, Any] | None
    serving: dict[str, Any]
    verification: dict[str, Any] = Field(
        description="The fresh-process check's report; empty when export.verify was off."
    )
    seconds: dict[str, float]


class StageMarker(StageRecord):
    """`_SUCCESS.<stage>`: a nightly stage finished, when and in how many seconds."""

    KIND: ClassVar[str] = "stage"
    PRODUCER: ClassVar[str] = "recsys nightly"

    record: Literal["stage"] = "stage"
    stage: str
    finished: str = Field(description="UTC time, ISO 8601, to the second.")
    seconds: float = Field(ge=0)


class PreprocessMarker(StageMarker):
    """Preprocess: the Beam job's counts, and the digest of the settings it ran with."""

    stage: Literal["preprocess"] = "preprocess"
    digest: str
    fingerprint: str
    input_rows: int = Field(ge=0)
    rejected: int = Field(ge=0)
    splits: dict[str, int]
    pipeline_seconds: float = Field(ge=0)


class TrainMarker(StageMarker):
    """Train: the epoch kept and the training speed."""

    stage: Literal["train"] = "train"
    best_epoch: int | None
    examples_per_second: float = Field(ge=0)


class EvaluateMarker(StageMarker):
    """Evaluate: the model's test metrics."""

    stage: Literal["evaluate"] = "evaluate"
    metrics: dict[str, float]


class ExportMarker(StageMarker):
    """Export: the version released, and whether it was verified in a fresh process."""

    stage: Literal["export"] = "export"
    version: int = Field(ge=1)
    verified: bool


class GateCheck(BaseModel):
    """One metric the gate compared: the challenger's delta and its interval."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    metric: str
    delta: float
    ci_low: float | None
    ci_high: float | None
    passed: bool


class PublishMarker(StageMarker):
    """Publish: the MLflow run, the registered version and the gate's decision."""

    stage: Literal["publish"] = "publish"
    mlflow_run_id: str
    registered_version: str
    champion_version: str
    decision: str
    promoted: bool
    summary: str
    notes: list[str]
    checks: list[GateCheck]


MARKERS: dict[str, type[StageMarker]] = {
    "preprocess": PreprocessMarker,
    "train": TrainMarker,
    "evaluate": EvaluateMarker,
    "export": ExportMarker,
    "publish": PublishMarker,
}
"""Each nightly stage's marker type (the stages of recsys.core.layout.STAGES)."""


R = TypeVar("R", bound=StageRecord)


def read_record(cls: type[R], path: Path) -> R:
    """The record at `path`, validated; RecordError naming the file, field and fix if not."""
    return _validate(cls, path, _load_json(cls, path))


def _load_json(cls: type[StageRecord], path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecordError(f"{path} is missing: run `{cls.PRODUCER}` first") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(
            f"{path}: unreadable {cls.KIND} record ({exc}); rerun `{cls.PRODUCER}` to write it "
            "again"
        ) from None


def _validate(cls: type[R], path: Path, data: Any) -> R:
    rerun = f"rerun `{cls.PRODUCER}` to write it again"
    if not isinstance(data, dict) or "record" not in data:
        raise RecordError(
            f"{path}: field 'record': missing; not a {cls.KIND} record of this release "
            f"(written before records carried their kind and format version); {rerun}"
        )
    if data["record"] != cls.KIND:
        raise RecordError(
            f"{path}: field 'record': {data['record']!r}, expected {cls.KIND!r} (the wrong "
            f"file in this place); {rerun}"
        )
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        fix = "upgrade recsys to read it" if newer else rerun
        raise RecordError(
            f"{path}: field 'format_version': {version!r}; this release reads format "
            f"{FORMAT_VERSION}; {fix}"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise RecordError(
            f"{path}: field {field!r}: {first['msg']} ({exc.error_count()} problem(s)); {rerun}"
        ) from None


def write_record(path: Path, record: StageRecord) -> None:
    """Write `record` as JSON, atomically (a reader sees the old file or the new one)."""
    tmp = path.with_name(temp_name("tmp", path.name))
    tmp.write_text(record.model_dump_json(indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def read_stats(data_dir: Path) -> StatsRecord:
    """A data folder's stats.json."""
    return read_record(StatsRecord, data_dir / DataFile.STATS)


def read_train(run_dir: Path) -> TrainRecord:
    """A run folder's train.json."""
    return read_record(TrainRecord, run_dir / RunFile.TRAIN)


def read_metrics(run_dir: Path) -> MetricsRecord:
    """A run folder's metrics.json."""
    return read_record(MetricsRecord, run_dir / RunFile.METRICS)


def read_export(run_dir: Path) -> ExportRecord:
    """A run folder's export.json."""
    return read_record(ExportRecord, run_dir / RunFile.EXPORT)


def read_champion(path: Path) -> ChampionRecord | None:
    """champion.json (None when no champion was recorded here).

    A file written before champion.json carried its kind and format version reads as the
    same record (the next serving sync rewrites it in today's shape).
    """
    if not path.is_file():
        return None
    data = _load_json(ChampionRecord, path)
    if isinstance(data, dict) and "record" not in data and "registered_version" in data:
        data = {"record": ChampionRecord.KIND, "format_version": FORMAT_VERSION, **data}
    return _validate(ChampionRecord, path, data)


def write_marker(folder: Path, stage: str, seconds: float, outcome: dict[str, Any]) -> StageMarker:
    """Mark `stage` finished in its output folder (atomically: the marker is all or nothing)."""
    finished = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    marker = MARKERS[stage].model_validate(
        {"finished": finished, "seconds": round(seconds, 3), **outcome}
    )
    write_record(stage_marker(folder, stage), marker)
    return marker


def read_marker(folder: Path, stage: str) -> StageMarker | None:
    """The finished stage's marker; None if it has not finished, or if its marker is not this
    release's (the stage then runs again rather than trust what it cannot read)."""
    path = stage_marker(folder, stage)
    if not path.is_file():
        return None
    try:
        return read_record(MARKERS[stage], path)
    except RecordError as exc:
        log.warning("stage %s is run again: %s", stage, exc)
        return None
