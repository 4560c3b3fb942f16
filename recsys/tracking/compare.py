"""`recsys compare`: offline A/B comparison of tracked runs for people.

Runs are named by run id, `champion` / `challenger` (registry aliases), a model version (`v3`)
or a date (that date's newest nightly run). Every run is compared with the first one on their
common evaluation users, from the per-user values each run logged (per_user_eval.parquet):
a terminal table (difference and paired bootstrap interval per metric), a PNG chart (metric@K
curves for K in 1..100 from the per-user ranks, and per-segment bars), and a Markdown and an HTML
report. The report and chart are logged as artifacts of a run in the `comparisons` experiment.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from mlflow import MlflowClient
from mlflow.entities import Run, RunStatus
from mlflow.exceptions import MlflowException

from recsys.core import schema
from recsys.core.config import RecsysConfig
from recsys.core.errors import ConfigError
from recsys.core.layout import DataFile, RunFile
from recsys.data_io import load_sequences, vocabulary_lookup
from recsys.tracking import registry
from recsys.tracking.gate import pair_users, paired_bootstrap
from recsys.tracking.runs import (
    LOGGED_TAG,
    TRACKING_FAILURES,
    bounded_http_retries,
    connect,
    ensure_experiment,
    experiment_name,
    owner_tags,
    resolve_tracking_uri,
    tracking_error,
)

COMPARISONS_EXPERIMENT = "comparisons"
MAX_K = 100
# Users with at most this many known (train + validation) interactions count as "new": every
# evaluated user has at least preprocess.min_user_interactions, so "new" means a short history.
NEW_USER_MAX_HISTORY = 5
# Items in the most popular HEAD_SHARE of the catalog (by train count) are "head", others "tail".
HEAD_SHARE = 0.2
_VERSION = re.compile(r"^v(\d+)$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass
class RunRef:
    """One compared run: how it was named and what it is."""

    ref: str
    run_id: str
    run_name: str
    run_date: str
    version: str | None
    data_dir: str | None
    summary: dict[str, float]


@dataclass
class Row:
    """One metric of one run against the baseline (the first run)."""

    metric: str
    run: str
    baseline: float
    value: float
    delta: float
    ci_low: float | None
    ci_high: float | None
    users: int | None


@dataclass
class Comparison:
    """Everything a comparison produced."""

    runs: list[RunRef]
    rows: list[Row]
    curves: dict[str, dict[str, list[float]]]  # metric -> run ref -> values at K = 1..MAX_K
    segments: dict[str, dict[str, dict[str, float]]]  # segment -> run ref -> {value, users}
    segment_metric: str
    files: dict[str, Path] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    notes: list[str] = field(default_factory=list)


def compare(
    config: RecsysConfig,
    workdir: Path,
    refs: list[str],
    output: Path,
    *,
    log_to_mlflow: bool = True,
) -> Comparison:
    """Compare runs (first = baseline), write table/chart/reports to `output`, log them."""
    if len(refs) < 2:
        raise ConfigError(
            "compare needs at least two runs (e.g. `recsys compare champion challenger`)"
        )
    uri = resolve_tracking_uri(config, workdir)
    output.mkdir(parents=True, exist_ok=True)
    try:
        client = connect(config, workdir, uri)
        with bounded_http_retries(), tempfile.TemporaryDirectory(prefix="recsys-compare-") as tmp:
            runs = [resolve_ref(client, config, ref) for ref in refs]
            tables = [_per_user(client, run, Path(tmp) / str(i)) for i, run in enumerate(runs)]
            result = build_comparison(config, runs, tables)
            result.files = write_reports(result, output)
            if log_to_mlflow:
                result.mlflow_run_id = _log_comparison(client, uri, workdir, result, output)
    except TRACKING_FAILURES as exc:
        raise tracking_error(uri, workdir, exc) from None
    return result


def resolve_ref(client: MlflowClient, config: RecsysConfig, ref: str) -> RunRef:
    """A run id, `champion`/`challenger`, `vN` or a date YYYY-MM-DD -> the tracked run."""
    name = config.model_name
    version = None
    if ref.lstrip("@") in (registry.CHAMPION, registry.CHALLENGER):
        found = registry.alias_version(client, name, ref.lstrip("@"))
        if found is None:
            raise ConfigError(f"registered model {name!r} has no alias {ref!r} yet")
        run_id, version = found.run_id, str(found.version)
    elif match := _VERSION.match(ref):
        try:
            found = registry.model_version(client, name, match.group(1))
        except MlflowException:
            raise ConfigError(f"registered model {name!r} has no version {ref}") from None
        run_id, version = found.run_id, str(found.version)
    elif _DATE.match(ref):
        run_id = _run_of_date(client, config, ref)
    else:
        run_id = ref
    if run_id is None:  # a version registered outside recsys may have no run
        raise ConfigError(f"{ref!r} is a registered version without a tracked run")
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ConfigError(
            f"{ref!r} is not a run id, 'champion', 'challenger', a version like 'v3' or a "
            "date YYYY-MM-DD with a tracked nightly run"
        ) from None
    tags = run.data.tags
    summary = {
        k.removeprefix("test_"): v for k, v in run.data.metrics.items() if k.startswith("test_")
    }
    return RunRef(
        ref=ref,
        run_id=run.info.run_id,
        run_name=run.info.run_name or "",
        run_date=tags.get("run_date", ""),
        version=version or tags.get(registry.VERSION_TAG),
        data_dir=tags.get("data_dir"),
        summary=summary,
    )


def _run_of_date(client: MlflowClient, config: RecsysConfig, date: str) -> str:
    experiment = client.get_experiment_by_name(experiment_name(config))
    runs: list[Run] = []
    if experiment is not None:
        runs = client.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.run_date = '{date}'",
            order_by=["attributes.start_time DESC"],
        )
    runs = [r for r in runs if r.data.tags.get(LOGGED_TAG) == "true"]
    if not runs:
        raise ConfigError(f"no completed nightly run of {config.model_name!r} for {date}")
    return runs[0].info.run_id


def _per_user(client: MlflowClient, run: RunRef, tmp: Path) -> dict[str, np.ndarray]:
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        path = client.download_artifacts(run.run_id, RunFile.PER_USER_EVAL, str(tmp))
    except MlflowException:
        raise ConfigError(
            f"run {run.run_id} ({run.ref}) has no per_user_eval.parquet artifact: it was not "
            "logged by `recsys nightly`"
        ) from None
    table = pq.read_table(path).to_pydict()
    return {k: np.asarray(v) for k, v in table.items()}


def build_comparison(
    config: RecsysConfig, runs: list[RunRef], tables: list[dict[str, np.ndarray]]
) -> Comparison:
    """All numbers of a comparison: pure computation on the runs' per-user tables."""
    gate = config.gate
    base, base_table = runs[0], tables[0]
    rows: list[Row] = []
    for run, table in zip(runs[1:], tables[1:], strict=True):
        base_values = {k: v for k, v in base_table.items() if k != "user_id"}
        values = {k: v for k, v in table.items() if k != "user_id"}
        _, a, b = pair_users(base_table["user_id"], base_values, table["user_id"], values)
        for metric in sorted(k for k in a if k != "rank"):
            ci = paired_bootstrap(
                b[metric].astype(np.float64) - a[metric].astype(np.float64),
                samples=gate.bootstrap_samples,
                confidence=gate.confidence,
                seed=gate.seed,
            )
            rows.append(
                Row(
                    metric,
                    run.ref,
                    float(a[metric].mean()),
                    float(b[metric].mean()),
                    ci.mean,
                    ci.low,
                    ci.high,
                    ci.n,
                )
            )
        # Catalog-level metrics (coverage) have no per-user values: difference, no interval.
        for metric in sorted((base.summary.keys() & run.summary.keys()) - a.keys()):
            if metric == "eval_users":
                continue
            x, y = base.summary[metric], run.summary[metric]
            rows.append(Row(metric, run.ref, x, y, y - x, None, None, None))
    common = sorted(set.intersection(*(set(map(str, t["user_id"])) for t in tables)))
    curves = _curves(runs, tables, common)
    segments, notes = _segments(config, runs, tables, common)
    return Comparison(runs, rows, curves, segments, gate.primary_metric, notes=notes)


def _ranks_on(table: dict[str, np.ndarray], users: list[str]) -> np.ndarray:
    index = {str(u): i for i, u in enumerate(table["user_id"])}
    ranks = np.asarray(table["rank"], dtype=np.float64)[[index[u] for u in users]]
    return np.where(ranks < 0, np.inf, ranks)  # -1 marks a target outside the catalog: a miss


def recall_ndcg_curves(ranks: np.ndarray, max_k: int = MAX_K) -> dict[str, list[float]]:
    """Recall@K and NDCG@K for K = 1..max_k from 0-based target ranks (inf = miss)."""
    if len(ranks) == 0:
        return {"recall": [math.nan] * max_k, "ndcg": [math.nan] * max_k}
    ks = np.arange(1, max_k + 1)
    hit = ranks[None, :] < ks[:, None]
    gain = np.where(np.isfinite(ranks), 1 / np.log2(np.where(np.isfinite(ranks), ranks, 0) + 2), 0)
    return {
        "recall": hit.mean(axis=1).tolist(),
        "ndcg": (hit * gain[None, :]).mean(axis=1).tolist(),
    }


def _curves(
    runs: list[RunRef], tables: list[dict[str, np.ndarray]], users: list[str]
) -> dict[str, dict[str, list[float]]]:
    curves: dict[str, dict[str, list[float]]] = {"recall": {}, "ndcg": {}}
    for run, table in zip(runs, tables, strict=True):
        if "rank" not in table:
            continue
        for metric, values in recall_ndcg_curves(_ranks_on(table, users)).items():
            curves[metric][run.ref] = values
    return curves


def _segments(
    config: RecsysConfig, runs: list[RunRef], tables: list[dict[str, np.ndarray]], users: list[str]
) -> tuple[dict[str, dict[str, dict[str, float]]], list[str]]:
    """Primary metric per segment (new/returning users, head/tail target items), per run."""
    data_dir = Path(runs[0].data_dir) if runs[0].data_dir else None
    if data_dir is None or not (data_dir / DataFile.ITEM_FEATURES).is_file():
        return {}, [f"segments skipped: the baseline's data folder ({data_dir}) is not available"]
    metric = config.gate.primary_metric
    if not all(metric in table for table in tables):
        return {}, [f"segments skipped: not every run has per-user {metric} (gate.primary_metric)"]
    labels = user_segments(data_dir)
    segments: dict[str, dict[str, dict[str, float]]] = {}
    for segment in ("new users", "returning users", "head items", "tail items"):
        members = [u for u in users if segment in labels.get(u, ())]
        segments[segment] = {}
        for run, table in zip(runs, tables, strict=True):
            index = {str(u): i for i, u in enumerate(table["user_id"])}
            values = np.asarray(table[metric], dtype=np.float64)[[index[u] for u in members]]
            mean = float(values.mean()) if len(values) else math.nan
            segments[segment][run.ref] = {"value": mean, "users": float(len(members))}
    return segments, []


def user_segments(data_dir: Path) -> dict[str, tuple[str, str]]:
    """Per test user: ('new users' | 'returning users', 'head items' | 'tail items').

    From the sequence records: known interactions are the train and validation positions,
    the target the user's (last) test position.
    """
    features = pq.read_table(data_dir / DataFile.ITEM_FEATURES, columns=["item_id", "train_count"])
    catalog = [str(i) for i in features["item_id"].to_pylist()]
    order = np.argsort(-np.asarray(features["train_count"].to_pylist()), kind="stable")
    head = np.zeros(len(catalog) + 1, bool)  # the last entry: ids outside the catalog
    head[order[: max(1, math.ceil(HEAD_SHARE * len(order)))]] = True
    sequences = load_sequences(data_dir, vocabulary_lookup(catalog))
    test_code = schema.SPLITS.index("test")
    if not sequences.users:
        return {}
    known = np.add.reduceat((sequences.splits < test_code).astype(np.int64), sequences.offsets[:-1])
    last = _last_test_position(sequences.splits, sequences.offsets, test_code)
    labels = {}
    for user, count, position in zip(sequences.users, known.tolist(), last.tolist(), strict=True):
        if position < 0:
            continue
        who = "new users" if count <= NEW_USER_MAX_HISTORY else "returning users"
        labels[user] = (who, "head items" if head[sequences.items[position]] else "tail items")
    return labels


def _last_test_position(splits: np.ndarray, offsets: np.ndarray, code: int) -> np.ndarray:
    """Per user: the flat position of their last position of split `code` (-1: none)."""
    positions = np.flatnonzero(splits == code)
    users = np.searchsorted(offsets, positions, side="right") - 1
    final = np.append(users[1:] != users[:-1], True) if len(users) else np.zeros(0, bool)
    last = np.full(len(offsets) - 1, -1, np.int64)
    last[users[final]] = positions[final]
    return last


def format_table(result: Comparison) -> str:
    """The terminal table: every metric, each run against the baseline, with its interval."""
    base = result.runs[0].ref
    pct = "CI"
    lines = [
        f"{'metric':<18}{'run':<14}{base[:12]:>12}{'value':>10}{'delta':>10}   {pct:<22}users",
    ]
    for row in result.rows:
        ci = (
            f"[{row.ci_low:+.4f}, {row.ci_high:+.4f}]"
            if row.ci_low is not None and row.ci_high is not None
            else "n/a (catalog-level)"
        )
        lines.append(
            f"{row.metric:<18}{row.run[:13]:<14}{row.baseline:>12.4f}{row.value:>10.4f}"
            f"{row.delta:>+10.4f}   {ci:<22}{row.users if row.users is not None else ''}"
        )
    return "\n".join(lines)


def write_reports(result: Comparison, output: Path) -> dict[str, Path]:
    """comparison.{png,md,html,json} in `output`."""
    files = {
        "chart": output / "comparison.png",
        "markdown": output / "comparison.md",
        "html": output / "comparison.html",
        "json": output / "comparison.json",
    }
    _chart(result, files["chart"])
    files["markdown"].write_text(_markdown(result))
    files["html"].write_text(_html(result))
    files["json"].write_text(json.dumps(_as_json(result), indent=2, default=_nan_safe) + "\n")
    return files


def _chart(result: Comparison, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    panels = 3 if result.segments else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8), constrained_layout=True)
    ks = np.arange(1, MAX_K + 1)
    for ax, (metric, label) in zip(
        axes, (("recall", "Recall@K"), ("ndcg", "NDCG@K")), strict=False
    ):
        for ref, values in result.curves.get(metric, {}).items():
            ax.plot(ks, values, label=_label(result, ref), linewidth=2)
        ax.set_title(f"{label} (common users)")
        ax.set_xlabel("K")
        ax.set_ylabel(label)
        ax.set_xlim(1, MAX_K)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    if result.segments:
        ax = axes[2]
        names = list(result.segments)
        width = 0.8 / len(result.runs)
        x = np.arange(len(names))
        for j, run in enumerate(result.runs):
            heights = [result.segments[s][run.ref]["value"] for s in names]
            ax.bar(
                x + (j - (len(result.runs) - 1) / 2) * width,
                heights,
                width,
                label=_label(result, run.ref),
            )
        counts = [int(result.segments[s][result.runs[0].ref]["users"]) for s in names]
        ax.set_xticks(x, [f"{s}\n(n={c})" for s, c in zip(names, counts, strict=True)], fontsize=9)
        ax.set_title(f"{result.segment_metric} by segment")
        ax.set_ylabel(result.segment_metric)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle(
        "recsys offline comparison: " + " vs ".join(_label(result, r.ref) for r in result.runs)
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(result: Comparison, ref: str) -> str:
    run = next(r for r in result.runs if r.ref == ref)
    version = f" v{run.version}" if run.version else ""
    return f"{ref}{version if ref != f'v{run.version}' else ''} ({run.run_date or run.run_id[:8]})"


def _fmt_ci(row: Row) -> str:
    if row.ci_low is None or row.ci_high is None:
        return "n/a (catalog-level)"
    return f"[{row.ci_low:+.4f}, {row.ci_high:+.4f}]"


def _markdown(result: Comparison) -> str:
    base = result.runs[0]
    lines = [
        "# recsys offline comparison",
        "",
        f"Generated {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC}. Baseline: **{base.ref}**. "
        "Deltas are run minus baseline on their common evaluation users; intervals are paired "
        "bootstrap percentile intervals over users.",
        "",
        "| ref | run id | run | date | version |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.ref} | `{r.run_id}` | {r.run_name} | {r.run_date} | {r.version or ''} |"
        for r in result.runs
    ]
    lines += [
        "",
        "## Metrics",
        "",
        "| metric | run | baseline | value | delta | interval | users |",
    ]
    lines.append("|---|---|---:|---:|---:|---|---:|")
    lines += [
        f"| {r.metric} | {r.run} | {r.baseline:.4f} | {r.value:.4f} | {r.delta:+.4f} | "
        f"{_fmt_ci(r)} | {r.users if r.users is not None else ''} |"
        for r in result.rows
    ]
    if result.segments:
        refs = [r.ref for r in result.runs]
        lines += ["", f"## {result.segment_metric} by segment", ""]
        lines.append("| segment | users | " + " | ".join(refs) + " |")
        lines.append("|---|---:|" + "---:|" * len(refs))
        for name, values in result.segments.items():
            users = int(values[refs[0]]["users"])
            cells = " | ".join(f"{values[r]['value']:.4f}" for r in refs)
            lines.append(f"| {name} | {users} | {cells} |")
    lines += ["", "![comparison chart](comparison.png)", ""]
    lines += [f"> {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


def _html(result: Comparison) -> str:
    def table(head: list[str], body: list[list[str]]) -> str:
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
            for row in body
        )
        return f"<table><thead><tr>{th}</tr></thead><tbody>{rows}</tbody></table>"

    runs = table(
        ["ref", "run id", "run", "date", "version"],
        [[r.ref, r.run_id, r.run_name, r.run_date, r.version or ""] for r in result.runs],
    )
    metrics = table(
        ["metric", "run", "baseline", "value", "delta", "interval", "users"],
        [
            [
                r.metric,
                r.run,
                f"{r.baseline:.4f}",
                f"{r.value:.4f}",
                f"{r.delta:+.4f}",
                _fmt_ci(r),
                str(r.users if r.users is not None else ""),
            ]
            for r in result.rows
        ],
    )
    segments = ""
    if result.segments:
        refs = [r.ref for r in result.runs]
        segments = f"<h2>{html.escape(result.segment_metric)} by segment</h2>" + table(
            ["segment", "users", *refs],
            [
                [name, str(int(v[refs[0]]["users"])), *(f"{v[r]['value']:.4f}" for r in refs)]
                for name, v in result.segments.items()
            ],
        )
    notes = "".join(f"<p><em>{html.escape(n)}</em></p>" for n in result.notes)
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "td:first-child,th:first-child{text-align:left}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>recsys comparison</title>"
        f"<style>{style}</style></head><body><h1>recsys offline comparison</h1>"
        f"<p>Baseline: <b>{html.escape(result.runs[0].ref)}</b>. Deltas: run minus baseline on "
        f"common users; intervals: paired bootstrap.</p>{runs}<h2>Metrics</h2>{metrics}"
        f"{segments}<img src='comparison.png' alt='comparison chart' style='max-width:100%'>"
        f"{notes}</body></html>\n"
    )


def _as_json(result: Comparison) -> dict[str, Any]:
    return {
        "runs": [r.__dict__ for r in result.runs],
        "rows": [r.__dict__ for r in result.rows],
        "curves": result.curves,
        "segments": result.segments,
        "segment_metric": result.segment_metric,
        "notes": result.notes,
    }


def _nan_safe(value: Any) -> Any:
    return str(value)


def _log_comparison(
    client: MlflowClient, uri: str, workdir: Path, result: Comparison, output: Path
) -> str:
    experiment_id = ensure_experiment(client, COMPARISONS_EXPERIMENT, uri, workdir)
    refs = [r.ref for r in result.runs]
    tags = {
        "compared_refs": " vs ".join(refs),
        "compared_run_ids": ",".join(r.run_id for r in result.runs),
        "baseline_run_id": result.runs[0].run_id,
        **owner_tags(workdir),
    }
    run = client.create_run(experiment_id, tags=tags, run_name="compare " + " vs ".join(refs))
    run_id = run.info.run_id
    try:
        for row in result.rows:
            if math.isfinite(row.delta):
                client.log_metric(run_id, f"delta_{row.metric}_{_safe(row.run)}", row.delta)
        client.log_artifacts(run_id, str(output))
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    except TRACKING_FAILURES:
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
        raise
    return run_id


def _safe(ref: str) -> str:
    return re.sub(r"[^\w.\-/ ]", "_", ref)
