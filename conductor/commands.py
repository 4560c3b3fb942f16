"""The `recsys` subcommands: each calls one conductor entry point and prints what it did."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from conductor import stages
from conductor.lock import WorkdirLock
from conductor.nightly import NightlyResult, als_lines, backfill, candidate_lines, run_nightly
from conductor.progress import KerasProgress
from conductor.promotion import PublishResult
from conductor.repair import drift_error, repair
from conductor.repair import format_report as format_repair
from recsys import tuning
from recsys.ab import workflow as ab_workflow
from recsys.ab.planning import format_plan, plan
from recsys.core import mirror, storage
from recsys.core.config import MAX_COUNT, MAX_SECONDS, MAX_WORKERS, RecsysConfig, set_dotted
from recsys.core.errors import ConfigError
from recsys.core.layout import (
    SUCCESS,
    RunFile,
    Workdir,
    clean_temporaries,
    parse_date,
    temp_prefix,
)
from recsys.core.progress import shown
from recsys.core.records import (
    MetricsRecord,
    PublishMarker,
    read_export,
    read_metrics,
    read_stats,
    read_train,
)
from recsys.tracking.compare import compare, format_table
from recsys.tracking.runs import check_tracking_store, record_ab_metric
from recsys.training.trainer import is_chief
from serving_export.formats import export_embeddings

# Commands that write into the working directory (files, or its local MLflow store): they take
# its lock (conductor.lock), as nightly and backfill do themselves. `ab plan` writes nothing.
_WRITERS = {
    "preprocess", "train", "evaluate", "export", "sync", "tune", "compare", "ab", "embeddings",
    "repair",
}  # fmt: skip
# Commands that use MLflow besides those _uses_tracking names (they check the store
# themselves); a workdir in a bucket has no place for the local SQLite store.
_TRACKED = {"nightly", "backfill", "sync", "repair"}


def dispatch(args: argparse.Namespace, config: RecsysConfig, date: dt.date) -> int:
    """Run the parsed subcommand under the working directory's lock when it writes there."""
    # Progress bars (recsys.core.progress) are the CLI's: the library is silent otherwise.
    with shown():
        return _dispatch(args, config, date)


def _dispatch(args: argparse.Namespace, config: RecsysConfig, date: dt.date) -> int:
    writes = _writes(args)
    # A non-chief multi-worker `train` writes nothing here, and must not wait for the chief.
    locked = writes and not (args.command == "train" and _non_chief_worker())
    st = config.storage
    storage.configure(st.s3_endpoint_url, st.s3_region, st.gcs_endpoint)
    workdir = stages.check_workdir(
        args.workdir, writable=writes, cache_dir=st.cache_dir, reader=not locked
    )
    if writes:
        workdir.check_links()  # before anything is written through a link leading outside
    if workdir.remote is not None and (_uses_tracking(args) or args.command in _TRACKED):
        _check_remote_tracking(config, workdir)
    if args.command in ("nightly", "backfill") and _non_chief_worker():
        raise ConfigError(
            "TF_CONFIG names this process a non-chief worker: run `recsys nightly` on the "
            "chief only and `recsys train` with the same --config/--date on the other workers"
        )
    if args.command in _WRITERS and locked:
        command = f"recsys {args.command}"
        with WorkdirLock(workdir.root, command=command, remote=workdir.remote):
            if _uses_tracking(args):  # nightly, backfill, sync and repair check their own
                check_tracking_store(config, workdir.root)
            mirror.pull(workdir)  # a workdir in a bucket: its committed state
            clean_temporaries(workdir.root)  # what a killed command left (as nightly does)
            code = _run_stage(args, config, workdir, date)
            mirror.push(workdir)
            return code
    if args.command == "train":
        mirror.pull(workdir)  # a non-chief worker: the committed data, no lock needed
    return _run_stage(args, config, workdir, date)


def _writes(args: argparse.Namespace) -> bool:
    if args.command == "ab" and args.ab_command == "plan":
        return False
    return args.command in (*_WRITERS, "nightly", "backfill")


def _uses_tracking(args: argparse.Namespace) -> bool:
    """Commands that read or write MLflow before their own work (checked first: exit 6)."""
    if args.command in ("compare", "tune"):
        return True
    if args.command != "ab":
        return False
    if args.ab_command == "record":
        return True
    if args.ab_command == "assign":
        return not args.no_log
    return args.ab_command == "analyze" and (not args.no_log or args.promote)


def _check_remote_tracking(config: RecsysConfig, workdir: Workdir) -> None:
    """A workdir in a bucket has no place for the local SQLite store: name a server."""
    if config.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return
    raise ConfigError(
        f"--workdir {workdir.remote} is in a bucket, where MLflow's local SQLite store cannot "
        "live: set tracking.uri (or MLFLOW_TRACKING_URI) to your tracking server, or to "
        "sqlite:///<local path> to keep the store on this machine"
    )


def _non_chief_worker() -> bool:
    if not os.environ.get("TF_CONFIG"):
        return False
    return not is_chief()


def _run_stage(
    args: argparse.Namespace, config: RecsysConfig, workdir: Workdir, date: dt.date
) -> int:
    if args.command == "preprocess":
        out, stats = _preprocess(args, config, workdir, date)
        _print_stats(out, stats)
    elif args.command == "train":
        if args.input:
            config = config.with_input(args.input)
        run_dir, result = stages.train(config, workdir, date, callbacks=[KerasProgress()])
        where = workdir.public(run_dir) if run_dir else None
        print(f"trained run: {where or '(non-chief worker: the chief writes the run)'}")
        print(
            f"final loss: {result.history['loss'][-1]:.4f} "
            f"({result.examples_per_second:,.0f} examples/s)"
        )
    elif args.command == "evaluate":
        run_dir, report = stages.evaluate(config, workdir, date, args.run_id)
        print(f"metrics: {workdir.public(run_dir / RunFile.METRICS)}")
        _print_metrics(report)
    elif args.command == "export":
        exported = stages.export(config, workdir, date, args.run_id, args.verify)
        _print_export(exported, workdir)
    elif args.command == "nightly":
        night = run_nightly(
            config,
            workdir,
            date,
            input_path=args.input,
            force_promote=args.force_promote,
            rerun_from=args.rerun_from,
            until=args.until,
        )
        _print_nightly(night, workdir)
    elif args.command == "tune":
        _tune(args, config, workdir, date)
    elif args.command == "backfill":
        start, end = parse_date(args.start), parse_date(args.end)
        backfill(
            config, workdir, start, end, input_path=args.input,
            on_date=lambda result: _print_nightly(result, workdir),
        )  # fmt: skip
    elif args.command == "sync":
        published = stages.sync(config, workdir, date, args.tracking_uri)
        if not published:
            print(f"nothing to sync for {date}: no run folder has a pending marker")
        for item in published:
            print(f"mlflow run:  {item.mlflow_run_id}")
            _print_published(item)
    elif args.command == "compare":
        _compare(args, config, workdir)
    elif args.command == "repair":
        repaired = repair(config, workdir, check=args.check)
        print(format_repair(repaired, args.check))
        error = drift_error(repaired, args.check)
        if error is not None:
            raise error
    elif args.command == "embeddings":
        _embeddings(args, workdir)
    elif args.command == "ab" and args.ab_command != "record":
        _ab(args, config, workdir)
    elif args.command == "ab":
        run_id = record_ab_metric(
            config,
            workdir.root,
            experiment=args.experiment,
            variant=args.variant,
            metric=args.metric,
            value=args.value,
            date=date if args.date else None,
            model_run_id=args.run_id,
        )
        print(f"recorded {args.metric}={args.value} for variant {args.variant} (run {run_id})")
        print(
            "note: `recsys ab record` is deprecated: log exposures and outcomes and run "
            "`recsys ab analyze` (docs/AB_TESTING.md)",
            file=sys.stderr,
        )
    # Both gate outcomes (promote, keep) are successful runs: exit code 0.
    return 0


def _check_tune_args(args: argparse.Namespace) -> None:
    """The budgets and worker count given on the command line, within the config's bounds."""
    for flag, value, top in (("--trials", args.trials, MAX_COUNT),
                             ("--workers", args.workers, MAX_WORKERS)):  # fmt: skip
        if value is not None and not 1 <= value <= top:
            raise ConfigError(f"{flag} must be at least 1, got {value}" if value < 1 else
                              f"{flag} must be at most {top:,}, got {value:,}")  # fmt: skip
    if args.timeout is not None and not 0 < args.timeout <= MAX_SECONDS:
        raise ConfigError(
            f"--timeout must be a positive number of seconds up to {MAX_SECONDS:,} (30 days), "
            f"got {args.timeout}"
        )


def _tune(args: argparse.Namespace, config: RecsysConfig, workdir: Workdir, date: dt.date) -> None:
    _check_tune_args(args)
    # The file as written (the tuned one keeps its layout); no file: the built-in defaults.
    base = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    for key, value in getattr(args, "overrides", {}).items():
        set_dotted(base, key, value)
    if args.input:
        config = config.with_input(args.input)
        base["data"] = config.data.model_dump(mode="json", exclude_defaults=True)
    folder = workdir.tune(date)
    prepared = tuning.preprocess_config(config)
    data_dir = folder / f"data-{prepared.digest()}"
    if not (data_dir / SUCCESS).is_file():
        stages.preprocess(prepared, workdir, date, None, data_dir)
    output = Path(args.output) if args.output else folder / "best.yaml"
    result = tuning.tune(
        config, data_dir, output, workdir=workdir.root, trials=args.trials,
        timeout_seconds=args.timeout, workers=args.workers, base_yaml=base, run_date=date,
        callbacks=[KerasProgress()],
    )  # fmt: skip
    print(f"study:       {result.study} in {result.storage}")
    print(f"trials:      {result.states}: {result.trials_run} ended in this run "
          f"({result.seconds:.0f} s), {result.trials_before} before it")  # fmt: skip
    print(f"best:        trial {result.best_trial}, validation {result.best_value:.4f}")
    if result.baseline_value is not None:
        verdict = "no sampled trial beat it" if result.best_is_baseline else "beaten"
        print(f"baseline:    trial 0 (the base config's settings), validation "
              f"{result.baseline_value:.4f}: {verdict}")  # fmt: skip
    else:
        print(f"baseline:    none ({result.baseline_skipped or 'it did not complete'})")
    for key, value in result.best_params.items():
        print(f"  {key} = {value}")
    print(f"mlflow:      experiment {result.experiment}, parent run {result.parent_run_id}")
    print(f"config:      {result.output}")


def _ab(args: argparse.Namespace, config: RecsysConfig, workdir: Workdir) -> None:
    if args.ab_command == "plan":
        plans = plan(Path(args.events), rel_effect=args.effect, share_t=args.share,
                     alpha=args.alpha, power=args.power)  # fmt: skip
        print(format_plan(plans, args.effect))
        return
    stamp = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
    folder = workdir.root / "ab" / args.experiment
    if args.ab_command == "assign":
        definition = ab_workflow.definition_from_options(
            args.experiment,
            Path(args.definition) if args.definition else None,
            variants=args.variants, split=args.split, holdout=args.holdout, salt=args.salt,
            start=args.start, primary_metric=args.primary_metric,
        )  # fmt: skip
        output = Path(args.output) if args.output else folder / f"assignment-{stamp}.csv"
        done = ab_workflow.assign_file(
            config, workdir.root, definition, Path(args.users), output,
            log_to_mlflow=not args.no_log, allow_same_version=args.allow_same_version,
        )  # fmt: skip
        print(f"assignment: {done.path}")
        print(f"input:      {done.users.describe()}")
        print("users:      " + ", ".join(f"{v} {n}" for v, n in done.counts.items()))
        models = ", ".join(f"{v}={m} (version {done.definition.versions.get(v, '?')})"
                           for v, m in done.definition.variants.items())  # fmt: skip
        print(f"models:     {models}")
        return
    result = ab_workflow.analyze_experiment(
        config, workdir.root, args.experiment, Path(args.events),
        Path(args.output) if args.output else folder / stamp,
        definition_path=Path(args.definition) if args.definition else None,
        pre_events=Path(args.pre_events) if args.pre_events else None, start=args.start,
        timestamp_unit=args.timestamp_unit, promote=args.promote, log_to_mlflow=not args.no_log,
        serving_base=workdir.serving_base(config.export.serving_base_path),
    )  # fmt: skip
    print(ab_workflow.format_report(result))


def _embeddings(args: argparse.Namespace, workdir: Workdir) -> None:
    default = workdir.root / "embeddings-export" / f"{args.version}-{args.format}"
    source = workdir.embeddings(args.version)
    if not storage.is_uri(args.output):
        output = Path(args.output) if args.output else default
        for path in export_embeddings(source, args.format, output):
            print(f"wrote:       {workdir.public(path)}")
        return
    with _staged_output(workdir.embeddings_root(), args.output) as local:
        written = export_embeddings(source, args.format, local)
    for path in written:
        print(f"wrote:       {args.output.rstrip('/')}/{Path(path).relative_to(local)}")


def _preprocess(
    args: argparse.Namespace, config: RecsysConfig, workdir: Workdir, date: dt.date
) -> tuple[Path | str, dict[str, Any]]:
    """`recsys preprocess`, into the workdir, a folder, or a bucket (published as a version)."""
    if not storage.is_uri(args.output):
        output = Path(args.output) if args.output else None
        out, stats = stages.preprocess(config, workdir, date, args.input, output)
        return workdir.public(out), stats
    with _staged_output(workdir.path("data"), args.output) as local:
        _, stats = stages.preprocess(config, workdir, date, args.input, local)
    return args.output, stats


@contextlib.contextmanager
def _staged_output(parent: Path, uri: str) -> Iterator[Path]:
    """A local folder whose content is published to `uri` as one version when the block ends.

    It is a temporary of this process under the workdir's `parent` (data/, embeddings/), where
    the next command removes what a killed one left (clean_temporaries).
    """
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=temp_prefix("tmp", "output"), dir=parent) as tmp:
        local = Path(tmp) / "output"
        yield local
        with storage.storage_errors(uri):
            storage.publish_version(local, uri, previous=storage.committed(uri))


def _compare(args: argparse.Namespace, config: RecsysConfig, workdir: Workdir) -> None:
    stamp = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
    output = Path(args.output) if args.output else workdir.root / "comparisons" / stamp
    result = compare(config, workdir.root, args.refs, output, log_to_mlflow=not args.no_log)
    print(format_table(result))
    for kind, path in result.files.items():
        print(f"{kind + ':':<10}{path}")
    for note in result.notes:
        print(f"note:     {note}")
    if result.mlflow_run_id:
        print(f"mlflow run (comparisons experiment): {result.mlflow_run_id}")


def _print_nightly(result: NightlyResult, workdir: Workdir) -> None:
    last = result.stages[-1].name
    run_dir = workdir.public(result.run_dir) if result.run_dir is not None else None
    if result.already_done:
        upto = "" if result.finished else f" up to {last}"
        print(f"nightly {result.date}: already done{upto}, nothing to do (run {run_dir})")
    _print_stats(workdir.public(result.data_dir), _read_stats(result.data_dir))
    if run_dir is not None:
        print(f"run:         {run_dir}")
    print(
        "stages:      "
        + ", ".join(f"{s.name} {s.status} ({s.seconds:.1f} s)" for s in result.stages)
    )
    if not result.finished:
        print(f"stopped:     after {last} (--until); the same command without it continues")
        return
    exported = read_export(result.run)
    for name, path in exported.models.items():
        print(f"savedmodel:  {name} -> {path}")
    for name, path in exported.embeddings.items():
        print(f"embeddings:  {name} -> {path}")
    publish = result.outcome(PublishMarker)
    print(f"mlflow run:  {publish.mlflow_run_id}")
    _print_metrics(read_metrics(result.run))
    for line in candidate_lines(read_train(result.run))[1:]:
        print(line)
    print(
        f"registered:  version {publish.registered_version} "
        f"(champion now: {publish.champion_version})"
    )
    print(publish.summary)
    _print_checks([check.model_dump() for check in publish.checks])
    for note in publish.notes:
        print(f"note:        {note}")
    for problem in result.serving_problems:
        print(f"serving:     {problem}")
    if result.summary_path is not None:
        print(f"summary:     {workdir.public(result.summary_path)}")


def _print_published(published: PublishResult | None) -> None:
    if published is None:
        return
    decision = published.decision
    print(f"registered:  version {published.version} (champion now: {published.champion_version})")
    print(decision.summary())
    _print_checks([vars(c) for c in decision.checks])
    for note in published.notes:
        print(f"note:        {note}")


def _print_checks(checks: list[dict[str, Any]]) -> None:
    for check in checks:
        low, high = check.get("ci_low"), check.get("ci_high")
        ci = f" CI [{low:+.4f}, {high:+.4f}]" if low is not None and high is not None else ""
        status = "pass" if check["passed"] else "FAIL"
        print(f"  {status} {check['metric']}: delta {check['delta']:+.4f}{ci}")


def _read_stats(data_dir: Path) -> dict[str, Any]:
    return read_stats(data_dir).as_dict()


def _print_stats(out: Path | str, stats: dict[str, Any]) -> None:
    splits = stats.get("splits", {})
    print(f"data:        {out}")
    print(
        f"  rows {stats.get('input_rows')}: train {splits.get('train')}, "
        f"validation {splits.get('validation')}, test {splits.get('test')}, "
        f"rejected {stats.get('rejected')}; users {stats.get('users')}, "
        f"items {stats.get('items')}"
    )


def _print_export(exported: stages.ExportResult, workdir: Workdir) -> None:
    for name, path in exported.models.items():
        print(f"savedmodel:  {name} -> {workdir.public(path)}")
    for name, path in exported.embeddings.items():
        print(f"embeddings:  {name} -> {workdir.public(path)}")
    if exported.verification:
        print("verified:    fresh-process reload matches the in-memory model")


def _print_metrics(report: MetricsRecord) -> None:
    model, baselines = report.model, report.baselines
    names = [k for k in model if k != "eval_users"]
    header = f"{'metric':<16}{'model':>10}" + "".join(f"{b:>12}" for b in baselines)
    print(f"test metrics ({int(model.get('eval_users', 0))} users; {report.protocol})")
    if report.evaluated_model == "eval_model":
        print(
            "             model = the evaluation fit (train split); the served refit also "
            "trained on the test split (training.refit: all)"
        )
    print(header)
    for name in names:
        row = f"{name:<16}{model[name]:>10.4f}"
        row += "".join(f"{baselines[b].get(name, float('nan')):>12.4f}" for b in baselines)
        print(row)
    for line in als_lines(report)[1:]:
        print(line)
