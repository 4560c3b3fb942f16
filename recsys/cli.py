"""The `recsys` command line: one subcommand per stage, plus `nightly` for all of them."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from recsys.config import load_config
from recsys.errors import RecsysError
from recsys.layout import parse_date
from recsys.nightly import STAGES
from recsys.redact import install_log_redaction, redact_text

# Commands that write into the working directory: they take its lock (recsys.lock).
_WRITERS = {"preprocess", "train", "evaluate", "export", "sync"}

log = logging.getLogger("recsys")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    common.add_argument("--workdir", default="recsys-work", help="working directory")
    common.add_argument(
        "--date", help="run date YYYY-MM-DD: data up to and including it (default: yesterday, UTC)"
    )
    common.add_argument("--input", help="raw input path (overrides the config's data source)")
    common.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    run_id = argparse.ArgumentParser(add_help=False)
    run_id.add_argument("--run-id", help="training run to use (default: the date's latest)")

    parser = argparse.ArgumentParser(prog="recsys", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preprocess", parents=[common], help="raw log -> TFRecords (Beam)")
    pre.add_argument("--output", help="output folder (default: <workdir>/data/<date>)")
    sub.add_parser("train", parents=[common], help="train the two-tower model")
    sub.add_parser("evaluate", parents=[common, run_id], help="exact evaluation of a run")
    exp = sub.add_parser("export", parents=[common, run_id], help="SavedModels + embeddings")
    exp.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reload the exports in a fresh process and compare (default: config)",
    )
    night = sub.add_parser(
        "nightly", parents=[common], help="all stages for one date, tracked in MLflow"
    )
    night.add_argument(
        "--force-promote",
        action="store_true",
        help="make this run champion even if the gate says keep (recorded as forced)",
    )
    night.add_argument(
        "--rerun-from",
        choices=STAGES,
        help="redo this stage and the ones after it even if they finished (default: resume)",
    )
    back = sub.add_parser(
        "backfill",
        parents=[common],
        help="nightly for each date from --start to --end, stopping at the first failure",
    )
    back.add_argument("--start", required=True, help="first date YYYY-MM-DD")
    back.add_argument("--end", required=True, help="last date YYYY-MM-DD (inclusive)")
    syn = sub.add_parser(
        "sync", parents=[common], help="log the date's runs left pending while MLflow was down"
    )
    syn.add_argument("--tracking-uri", help="tracking server to log to (default: the run's)")
    cmp = sub.add_parser(
        "compare", parents=[common], help="offline A/B: runs side by side with bootstrap CIs"
    )
    cmp.add_argument(
        "refs", nargs="+", metavar="RUN", help="run id, champion, challenger, vN or YYYY-MM-DD"
    )
    cmp.add_argument("--output", help="report folder (default: <workdir>/comparisons/<time>)")
    cmp.add_argument("--no-log", action="store_true", help="do not log the report to MLflow")
    ab = sub.add_parser("ab", help="online A/B tests: assign users, analyse the log, decide")
    ab_sub = ab.add_subparsers(dest="ab_command", required=True)
    _ab_parsers(ab_sub, common)
    rec = ab_sub.add_parser(
        "record", parents=[common], help="(deprecated: use `ab analyze`) log one online number"
    )
    rec.add_argument("--experiment", required=True, help="A/B experiment name")
    rec.add_argument("--variant", required=True, choices=["A", "B"])
    rec.add_argument("--metric", required=True, help="e.g. ctr, watch_time")
    rec.add_argument("--value", required=True, type=float)
    rec.add_argument("--run-id", help="MLflow run id of the model behind this variant")
    emb = sub.add_parser("embeddings", help="exported embeddings for other consumers")
    emb_sub = emb.add_subparsers(dest="embeddings_command", required=True)
    emb_exp = emb_sub.add_parser(
        "export", parents=[common], help="a version's embeddings as parquet, npy or tfrecord"
    )
    emb_exp.add_argument("--version", required=True, type=int, help="export version V")
    emb_exp.add_argument("--format", required=True, choices=["parquet", "npy", "tfrecord"])
    emb_exp.add_argument(
        "--output", help="output folder (default: <workdir>/embeddings-export/<V>-<format>)"
    )
    return parser


def _ab_parsers(ab_sub: Any, common: argparse.ArgumentParser) -> None:
    definition = argparse.ArgumentParser(add_help=False)
    definition.add_argument("--experiment", required=True, help="A/B experiment name")
    definition.add_argument("--definition", help="experiment definition YAML (docs/AB_TESTING.md)")
    asg = ab_sub.add_parser(
        "assign", parents=[common, definition], help="variant of every user in a file (+ MLflow)"
    )
    asg.add_argument("--users", required=True, help="user ids: text (one a line), CSV or Parquet")
    asg.add_argument("--output", help="CSV user_id,variant,bucket (default: <workdir>/ab/...)")
    asg.add_argument("--variants", help="variant=model pairs, control first (A=champion,B=v7)")
    asg.add_argument("--split", help="variant=share pairs of all traffic (A=0.45,B=0.45)")
    asg.add_argument("--holdout", type=float, help="share of users held out of the experiment")
    asg.add_argument("--salt", help="hash salt (change it to reshuffle users)")
    asg.add_argument("--start", help="first day of the experiment, YYYY-MM-DD")
    asg.add_argument("--primary-metric", help="default: ctr when clicks and impressions exist")
    asg.add_argument("--no-log", action="store_true", help="do not record it in MLflow")
    ana = ab_sub.add_parser(
        "analyze", parents=[common, definition], help="analyse an exposure/outcome log"
    )
    ana.add_argument("--events", required=True, help="Parquet or CSV: user_id, variant, ...")
    ana.add_argument("--pre-events", help="pre-period log of the same users (CUPED)")
    ana.add_argument(
        "--start", help="first day YYYY-MM-DD (default: the definition's): earlier rows are CUPED's"
    )
    ana.add_argument("--output", help="report folder (default: <workdir>/ab/<name>/<time>)")
    ana.add_argument(
        "--promote", action="store_true", help="move `champion` to the winner, if there is one"
    )
    ana.add_argument("--no-log", action="store_true", help="do not log the analysis to MLflow")
    pln = ab_sub.add_parser(
        "plan", parents=[common], help="users needed / MDE from a log of normal traffic"
    )
    pln.add_argument("--events", required=True, help="Parquet or CSV: user_id, timestamp, ...")
    pln.add_argument("--effect", type=float, default=0.02, help="relative lift to detect")
    pln.add_argument("--share", type=float, default=0.5, help="treatment's share of the test")
    pln.add_argument("--alpha", type=float, default=0.05)
    pln.add_argument("--power", type=float, default=0.8)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run one subcommand; a user error becomes one line and a non-zero exit."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("apache_beam", "absl", "tensorflow", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Every log line (ours, MLflow's, Beam's, and warnings routed through logging) loses URI
    # credentials and secret values before it is written (docs/OPERATIONS.md, Security).
    logging.captureWarnings(True)
    install_log_redaction()
    try:
        return _dispatch(args)
    except RecsysError as exc:
        print(f"recsys: error: {redact_text(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("recsys: interrupted", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    from recsys import stages

    config = load_config(args.config)
    workdir = stages.check_workdir(args.workdir)
    date = parse_date(getattr(args, "date", None), config.nightly.timezone)
    if args.command in ("nightly", "backfill") and _non_chief_worker():
        from recsys.errors import ConfigError

        raise ConfigError(
            "TF_CONFIG names this process a non-chief worker: run `recsys nightly` on the "
            "chief only and `recsys train` with the same --config/--date on the other workers"
        )
    # A non-chief multi-worker `train` writes nothing here, and must not wait for the chief.
    if args.command in _WRITERS and not (args.command == "train" and _non_chief_worker()):
        from recsys.lock import WorkdirLock

        with WorkdirLock(workdir.root, command=f"recsys {args.command}"):
            return _run_stage(args, config, workdir, date)
    return _run_stage(args, config, workdir, date)


def _non_chief_worker() -> bool:
    if not os.environ.get("TF_CONFIG"):
        return False
    from recsys.training.trainer import is_chief

    return not is_chief()


def _run_stage(args: argparse.Namespace, config: Any, workdir: Any, date: Any) -> int:
    from recsys import stages

    if args.command == "preprocess":
        out, stats = stages.preprocess(
            config, workdir, date, args.input, Path(args.output) if args.output else None
        )
        _print_stats(out, stats)
    elif args.command == "train":
        if args.input:
            config = config.with_input(args.input)
        run_dir, result = stages.train(config, workdir, date)
        print(f"trained run: {run_dir or '(non-chief worker: the chief writes the run)'}")
        print(
            f"final loss: {result.history['loss'][-1]:.4f} "
            f"({result.examples_per_second:,.0f} examples/s)"
        )
    elif args.command == "evaluate":
        run_dir, report = stages.evaluate(config, workdir, date, args.run_id)
        print(f"metrics: {run_dir / 'metrics.json'}")
        _print_metrics(report)
    elif args.command == "export":
        exported = stages.export(config, workdir, date, args.run_id, args.verify)
        _print_export(exported)
    elif args.command == "nightly":
        from recsys.nightly import run_nightly

        result = run_nightly(
            config,
            workdir,
            date,
            input_path=args.input,
            force_promote=args.force_promote,
            rerun_from=args.rerun_from,
        )
        _print_nightly(result)
    elif args.command == "backfill":
        from recsys.nightly import backfill

        start, end = parse_date(args.start), parse_date(args.end)
        backfill(config, workdir, start, end, input_path=args.input, on_date=_print_nightly)
    elif args.command == "sync":
        published = stages.sync(config, workdir, date, args.tracking_uri)
        if not published:
            print(f"nothing to sync for {date}: no run folder has a pending marker")
        for item in published:
            print(f"mlflow run:  {item.mlflow_run_id}")
            _print_published(item)
    elif args.command == "compare":
        _compare(args, config, workdir)
    elif args.command == "embeddings":
        _embeddings(args, workdir)
    elif args.command == "ab" and args.ab_command != "record":
        _ab(args, config, workdir)
    elif args.command == "ab":
        from recsys.tracking import record_ab_metric

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


def _ab(args: argparse.Namespace, config: Any, workdir: Any) -> None:
    import datetime as dt

    from recsys.ab import workflow

    if args.ab_command == "plan":
        from recsys.ab.planning import format_plan, plan

        plans = plan(Path(args.events), rel_effect=args.effect, share_t=args.share,
                     alpha=args.alpha, power=args.power)  # fmt: skip
        print(format_plan(plans, args.effect))
        return
    stamp = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
    folder = workdir.root / "ab" / args.experiment
    if args.ab_command == "assign":
        definition = workflow.definition_from_options(
            args.experiment,
            Path(args.definition) if args.definition else None,
            variants=args.variants, split=args.split, holdout=args.holdout, salt=args.salt,
            start=args.start, primary_metric=args.primary_metric,
        )  # fmt: skip
        output = Path(args.output) if args.output else folder / f"assignment-{stamp}.csv"
        path, counts, pinned = workflow.assign_file(
            config, workdir.root, definition, Path(args.users), output,
            log_to_mlflow=not args.no_log,
        )  # fmt: skip
        print(f"assignment: {path}")
        print("users:      " + ", ".join(f"{v} {n}" for v, n in counts.items()))
        models = ", ".join(f"{v}={m} (version {pinned.versions.get(v, '?')})"
                           for v, m in pinned.variants.items())  # fmt: skip
        print(f"models:     {models}")
        return
    result = workflow.analyze_experiment(
        config, workdir.root, args.experiment, Path(args.events),
        Path(args.output) if args.output else folder / stamp,
        definition_path=Path(args.definition) if args.definition else None,
        pre_events=Path(args.pre_events) if args.pre_events else None, start=args.start,
        promote=args.promote, log_to_mlflow=not args.no_log,
    )  # fmt: skip
    print(workflow.format_report(result))


def _embeddings(args: argparse.Namespace, workdir: Any) -> None:
    from serving_export.formats import export_embeddings

    default = workdir.root / "embeddings-export" / f"{args.version}-{args.format}"
    output = Path(args.output) if args.output else default
    for path in export_embeddings(workdir.embeddings(args.version), args.format, output):
        print(f"wrote:       {path}")


def _compare(args: argparse.Namespace, config: Any, workdir: Any) -> None:
    import datetime as dt

    from recsys.compare import compare, format_table

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


def _print_nightly(result: Any) -> None:
    if result.already_done:
        print(f"nightly {result.date}: already done, nothing to do (run {result.run_dir})")
    _print_stats(result.data_dir, _read_stats(result.data_dir))
    print(f"run:         {result.run_dir}")
    print(
        "stages:      "
        + ", ".join(f"{s.name} {s.status} ({s.seconds:.1f} s)" for s in result.stages)
    )
    exported = json.loads((result.run_dir / "export.json").read_text())
    for name, path in exported.get("models", {}).items():
        print(f"savedmodel:  {name} -> {path}")
    for name, path in exported.get("embeddings", {}).items():
        print(f"embeddings:  {name} -> {path}")
    publish = result.info("publish")
    print(f"mlflow run:  {publish.get('mlflow_run_id')}")
    metrics = json.loads((result.run_dir / "metrics.json").read_text())
    _print_metrics(metrics)
    print(
        f"registered:  version {publish.get('registered_version')} "
        f"(champion now: {publish.get('champion_version')})"
    )
    print(publish.get("summary", ""))
    _print_checks(publish.get("checks", []))
    if result.summary_path is not None:
        print(f"summary:     {result.summary_path}")


def _print_published(published: Any) -> None:
    if published is None:
        return
    decision = published.decision
    print(f"registered:  version {published.version} (champion now: {published.champion_version})")
    print(decision.summary())
    checks = ([decision.primary] if decision.primary else []) + decision.guardrails
    _print_checks([vars(c) for c in checks])


def _print_checks(checks: list[dict[str, Any]]) -> None:
    for check in checks:
        low, high = check.get("ci_low"), check.get("ci_high")
        ci = f" CI [{low:+.4f}, {high:+.4f}]" if low is not None and high is not None else ""
        status = "pass" if check["passed"] else "FAIL"
        print(f"  {status} {check['metric']}: delta {check['delta']:+.4f}{ci}")


def _read_stats(data_dir: Path) -> dict[str, Any]:
    return json.loads((data_dir / "stats.json").read_text())


def _print_stats(out: Path, stats: dict[str, Any]) -> None:
    splits = stats.get("splits", {})
    print(f"data:        {out}")
    print(
        f"  rows {stats.get('input_rows')}: train {splits.get('train')}, "
        f"validation {splits.get('validation')}, test {splits.get('test')}, "
        f"rejected {stats.get('rejected')}; users {stats.get('users')}, "
        f"items {stats.get('items')}"
    )


def _print_export(exported: Any) -> None:
    for name, path in exported.models.items():
        print(f"savedmodel:  {name} -> {path}")
    for name, path in exported.embeddings.items():
        print(f"embeddings:  {name} -> {path}")
    if exported.verification:
        print("verified:    fresh-process reload matches the in-memory model")


def _print_metrics(report: dict[str, Any]) -> None:
    model, baselines = report["model"], report.get("baselines", {})
    names = [k for k in model if k != "eval_users"]
    header = f"{'metric':<16}{'model':>10}" + "".join(f"{b:>12}" for b in baselines)
    print(f"test metrics ({int(model.get('eval_users', 0))} users; {report.get('protocol', '')})")
    print(header)
    for name in names:
        row = f"{name:<16}{model[name]:>10.4f}"
        row += "".join(f"{baselines[b].get(name, float('nan')):>12.4f}" for b in baselines)
        print(row)


if __name__ == "__main__":
    sys.exit(main())
