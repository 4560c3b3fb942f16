"""The two A/B commands as library calls: assign a file of users, analyse an exposure log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import requests
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from recsys.ab import mlflow_store
from recsys.ab.analysis import Analysis, analyze
from recsys.ab.assignment import HOLDOUT, assign_many, bucket
from recsys.ab.chart import lift_chart
from recsys.ab.definition import ExperimentDefinition, load_definition, make_definition
from recsys.ab.events import read_log, user_table
from recsys.core.config import RecsysConfig
from recsys.core.errors import ConfigError, DataError, TrackingError
from recsys.core.layout import Workdir
from recsys.core.redact import redact_text
from recsys.serving_state import sync_serving
from recsys.tracking.runs import (
    bounded_http_retries,
    connect,
    ensure_experiment,
    owner_tags,
    resolve_tracking_uri,
)

_FAILURES = (MlflowException, requests.RequestException, OSError)


@dataclass
class AnalyzeResult:
    """An analysis, the files it wrote, its MLflow run and the version promoted (if any)."""

    analysis: Analysis
    definition: ExperimentDefinition
    files: dict[str, Path]
    mlflow_run_id: str | None = None
    promoted_version: str | None = None
    notes: list[str] = field(default_factory=list)


@contextmanager
def _mlflow(config: RecsysConfig, workdir: Path) -> Iterator[tuple[MlflowClient, str]]:
    uri = resolve_tracking_uri(config, workdir)
    try:
        with bounded_http_retries():
            yield connect(config, workdir, uri), uri
    except _FAILURES as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise TrackingError(
            f"could not use MLflow at {redact_text(uri)} ({type(exc).__name__}: "
            f"{redact_text(first)}); check the server (mlflow/README.md)"
        ) from None


def _pairs(text: str | None, option: str) -> dict[str, str] | None:
    if not text:
        return None
    out = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ConfigError(f"{option} {text!r}: expected name=value pairs, e.g. A=0.5,B=0.5")
        out[name.strip()] = value.strip()
    return out


def definition_from_options(
    name: str,
    path: Path | None,
    *,
    variants: str | None = None,
    split: str | None = None,
    holdout: float | None = None,
    salt: str | None = None,
    start: str | None = None,
    primary_metric: str | None = None,
) -> ExperimentDefinition:
    """A definition from a YAML file and/or command-line options (options win)."""
    shares = _pairs(split, "--split")
    try:
        numbers = {k: float(v) for k, v in shares.items()} if shares else None
    except ValueError:
        raise ConfigError(f"--split {split!r}: shares must be numbers") from None
    options = {
        "name": name, "variants": _pairs(variants, "--variants"), "split": numbers,
        "holdout": holdout, "salt": salt, "start": start, "primary_metric": primary_metric,
    }  # fmt: skip
    if path is not None:
        return load_definition(path, **options)
    return make_definition({k: v for k, v in options.items() if v is not None}, "options")


def format_report(result: AnalyzeResult) -> str:
    """The terminal report: users and SRM, a table of metrics, notes, the decision line."""
    a = result.analysis
    users = ", ".join(f"{v} {n}" for v, n in a.users.items())
    lines = [
        f"experiment {a.experiment}: {a.treatment} vs {a.control} (control), "
        f"{a.first_day}..{a.last_day} ({a.days} days)",
        f"users: {users}; SRM chi-square p={a.srm_p_value:.3g}",
        f"{'metric':<14}{'control':>11}{'treatment':>11}{'lift':>9}  {'95% CI (lift)':<20}"
        f"{'p':>8}  {'always-valid CI (diff)':<26}{'p':>7}",
    ]
    for name, m in sorted(a.metrics.items(), key=lambda kv: kv[0] != a.primary):
        mark = "*" if name == a.primary else " "
        lines.append(
            f"{mark}{name:<13}{m.control:>11.4g}{m.treatment:>11.4g}{m.rel:>+9.2%}  "
            f"{f'[{m.rel_low:+.2%}, {m.rel_high:+.2%}]':<20}{m.p_value:>8.3g}  "
            f"{f'[{m.seq_low:+.4g}, {m.seq_high:+.4g}]':<26}{m.seq_p_value:>7.3g}"
        )
    lines += [f"note: {n}" for n in result.notes + a.notes]
    lines += [f"{k + ':':<8}{p}" for k, p in result.files.items()]
    if result.mlflow_run_id:
        lines.append(f"mlflow run: {result.mlflow_run_id} (experiment ab-{a.experiment})")
    if result.promoted_version:
        lines.append(f"promoted: champion -> version {result.promoted_version}")
    lines.append(a.decision.line(a.experiment))
    return "\n".join(lines)


@dataclass
class UserIds:
    """The users of a file, one each, and what was done to get there."""

    ids: list[str]
    rows: int
    duplicates: int
    stripped: int
    empty: int

    def describe(self) -> str:
        """`200 unique of 252 rows (50 duplicates dropped, ...)`."""
        done = [f"{n} {what}" for n, what in (
            (self.duplicates, "duplicates dropped"),
            (self.stripped, "ids stripped of surrounding whitespace"),
            (self.empty, "empty ids dropped"),
        ) if n]  # fmt: skip
        return f"{len(self.ids)} unique of {self.rows} rows" + (
            f" ({', '.join(done)})" if done else ""
        )


def read_users(path: Path) -> UserIds:
    """User ids from a text file (one per line) or a CSV/Parquet with a `user_id` column.

    The rule (docs/AB_TESTING.md): an id is text with surrounding whitespace removed (as the
    analysis reads the log's ids); empty ids are dropped; each user is kept once.
    """
    if not path.is_file():
        raise DataError(f"users file {path} does not exist")
    if path.suffix.lower() in (".csv", ".parquet", ".pq"):
        frame = read_log(path)
        if "user_id" not in frame.columns:
            raise DataError(f"{path}: no 'user_id' column (found {list(frame.columns)})")
        raw = frame["user_id"].dropna().astype(str).tolist()
    else:
        raw = path.read_text(encoding="utf-8").splitlines()
    stripped = [r.strip() for r in raw]
    present = [s for s in stripped if s]
    ids = list(dict.fromkeys(present))
    changed = sum(1 for r, s in zip(raw, stripped, strict=True) if s and r != s)
    return UserIds(ids, len(raw), len(present) - len(ids), changed, len(raw) - len(present))


@dataclass
class Assignment:
    """What `assign_file` wrote: the file, users per variant, the recorded definition."""

    path: Path
    counts: dict[str, int]
    definition: ExperimentDefinition
    users: UserIds


def assign_file(
    config: RecsysConfig,
    workdir: Path,
    definition: ExperimentDefinition,
    users_path: Path,
    output: Path,
    *,
    log_to_mlflow: bool = True,
    allow_same_version: bool = False,
) -> Assignment:
    """Write user_id,variant,bucket for every user; record the definition in MLflow.

    Two variants serving the same registered version are refused (ConfigError) unless
    `allow_same_version` (an A/A test); nothing is written then.
    """
    users = read_users(users_path)
    if log_to_mlflow:
        with _mlflow(config, workdir) as (client, _):
            definition = mlflow_store.pin_versions(
                client, definition, definition.model_name or config.model_name
            )
    check_distinct_arms(definition, allow_same_version)
    split = definition.assignment_split()
    variants = assign_many(users.ids, definition.name, split, holdout=definition.holdout,
                           salt=definition.salt)  # fmt: skip
    buckets = [bucket(u, definition.name, definition.salt) for u in users.ids]
    output.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"user_id": users.ids, "variant": variants, "bucket": buckets}).to_csv(
        output, index=False
    )
    counts = {v: variants.count(v) for v in [*definition.variants, HOLDOUT]}
    if log_to_mlflow:
        definition = record(config, workdir, definition)
    return Assignment(output, counts, definition, users)


def check_distinct_arms(definition: ExperimentDefinition, allow_same_version: bool) -> None:
    """ConfigError when both variants serve one model (same pinned version, or same reference)."""
    a, b = definition.control, definition.treatment
    refs = {
        v: definition.versions.get(v)
        or mlflow_store.version_number(definition.variants[v])
        or definition.variants[v]
        for v in (a, b)
    }
    if allow_same_version or refs[a] != refs[b]:
        return
    what = f"registered version {refs[a]}" if definition.versions.get(a) else repr(refs[a])
    raise ConfigError(
        f"variants {a} and {b} both serve {what} ({a}={definition.variants[a]}, "
        f"{b}={definition.variants[b]}): the experiment would compare a model with itself. "
        f"Point {b} at another version (e.g. --variants {a}=champion,{b}=v7), or pass "
        "--allow-same-version for an A/A test"
    )


def record(
    config: RecsysConfig, workdir: Path, definition: ExperimentDefinition
) -> ExperimentDefinition:
    """Pin the variants' model versions and store the definition in `ab-<name>`."""
    with _mlflow(config, workdir) as (client, uri):
        pinned = mlflow_store.pin_versions(
            client, definition, definition.model_name or config.model_name
        )
        name = mlflow_store.experiment_name(definition.name)
        experiment_id = ensure_experiment(client, name, uri, workdir)
        mlflow_store.record_definition(client, experiment_id, pinned)
        return pinned


def resolve_definition(
    config: RecsysConfig,
    workdir: Path,
    name: str,
    events: Path,
    definition_path: Path | None,
    *,
    use_mlflow: bool = True,
) -> tuple[ExperimentDefinition, str]:
    """The definition: --definition file, else the one in MLflow, else inferred from the log."""
    if definition_path is not None:
        return load_definition(definition_path, name=name), f"file {definition_path}"
    if use_mlflow:
        with _mlflow(config, workdir) as (client, _):
            stored = mlflow_store.stored_definition(client, name)
        if stored is not None:
            return stored, f"MLflow experiment {mlflow_store.experiment_name(name)}"
    return _inferred(name, events), "inferred from the log (no definition recorded)"


def _inferred(name: str, events: Path) -> ExperimentDefinition:
    frame = read_log(events)
    if "variant" not in frame.columns:
        raise DataError(f"{events}: missing column 'variant'")
    found = sorted({str(v) for v in frame["variant"].dropna().unique()} - {HOLDOUT})
    if len(found) != 2:
        raise DataError(
            f"{events}: field 'variant' has {found}; without a definition exactly two "
            "variants are expected (give --definition for anything else)"
        )
    first = next((v for v in ("control", "A", "a") if v in found), found[0])
    second = next(v for v in found if v != first)
    return make_definition({"name": name, "variants": {first: "champion", second: "challenger"}})


def analyze_experiment(
    config: RecsysConfig,
    workdir: Path,
    name: str,
    events: Path,
    output: Path,
    *,
    definition_path: Path | None = None,
    pre_events: Path | None = None,
    start: str | None = None,
    timestamp_unit: str | None = None,
    promote: bool = False,
    log_to_mlflow: bool = True,
    serving_base: str | None = None,
) -> AnalyzeResult:
    """Analyse the log, write analysis.json + lift.png, log a run, promote if asked and won.

    `serving_base` is models.config's base path (default: export.serving_base_path).
    """
    definition, source = resolve_definition(
        config, workdir, name, events, definition_path, use_mlflow=log_to_mlflow or promote
    )
    if start is not None:
        definition = make_definition({**definition.model_dump(), "start": start}, "--start")
    if timestamp_unit is not None:
        definition = make_definition(
            {**definition.model_dump(), "timestamp_unit": timestamp_unit}, "--timestamp-unit"
        )
    table = user_table(
        events, start=definition.start, pre_events=pre_events, variants=list(definition.variants),
        timestamp_unit=definition.timestamp_unit,
        max_rejected_fraction=definition.max_rejected_fraction,
        allow_negative=definition.allow_negative,
    )  # fmt: skip
    analysis = analyze(table, definition)
    output.mkdir(parents=True, exist_ok=True)
    files = {
        "json": output / "analysis.json",
        "chart": lift_chart(analysis, output / "lift.png"),
    }
    if len(table.rejected):
        files["rejected"] = output / "rejected.csv"
        table.rejected.to_csv(files["rejected"], index=False)
    result = AnalyzeResult(analysis, definition, files, notes=[f"definition: {source}"])
    if log_to_mlflow or promote:
        with _mlflow(config, workdir) as (client, uri):
            definition = mlflow_store.pin_versions(
                client, definition, definition.model_name or config.model_name
            )
            exp_id = ensure_experiment(client, mlflow_store.experiment_name(name), uri, workdir)
            if mlflow_store.stored_definition(client, name) is None:
                mlflow_store.record_definition(client, exp_id, definition)
            _write_json(files["json"], analysis, definition)
            run_id = mlflow_store.log_analysis(
                client, exp_id, analysis, definition, list(files.values()), owner_tags(workdir)
            )
            result.mlflow_run_id, result.definition = run_id, definition
            if promote:
                result.promoted_version = mlflow_store.promote_winner(
                    client, analysis, definition, run_id
                )
                base = serving_base or config.export.serving_base_path
                result.notes += _follow_serving(client, config, workdir, definition, base)
    else:
        _write_json(files["json"], analysis, definition)
    return result


def _follow_serving(
    client: MlflowClient,
    config: RecsysConfig,
    workdir: Path,
    definition: ExperimentDefinition,
    base_path: str | None,
) -> list[str]:
    """models.config and champion.json rewritten from the aliases --promote may have moved."""
    name = definition.model_name or config.model_name
    state = sync_serving(client, name, Workdir(workdir), base_path)
    return [f"serving: {problem}" for problem in state.problems]


def _write_json(path: Path, analysis: Analysis, definition: ExperimentDefinition) -> None:
    record = {"definition": json.loads(definition.model_dump_json()), **analysis.to_dict()}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
