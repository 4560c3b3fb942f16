"""The `recsys` command line: one subcommand per stage, plus `nightly` for all of them."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from recsys.core.config import RecsysConfig, load_config, set_values
from recsys.core.errors import (
    ACCESS_ERRNOS,
    ConfigError,
    RecsysError,
    StorageError,
    storage_errno,
)
from recsys.core.layout import STAGES, parse_date, require_complete
from recsys.core.logs import configure_logging
from recsys.core.records import read_stats
from recsys.core.redact import redact_text
from recsys.core.resolve import format_settings, resolve_config

log = logging.getLogger("recsys")


def _parser() -> argparse.ArgumentParser:
    settings = argparse.ArgumentParser(add_help=False)
    settings.add_argument(
        "--config",
        help="YAML config; the settings it leaves out take the built-in defaults, which are "
        "also what runs without --config (docs/CONFIG.md)",
    )
    settings.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting, e.g. --set training.epochs=3 (VALUE is YAML; repeatable)",
    )
    settings.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    common = argparse.ArgumentParser(add_help=False, parents=[settings])
    common.add_argument("--workdir", default="recsys-work", help="working directory")
    common.add_argument(
        "--date", help="run date YYYY-MM-DD: data up to and including it (default: yesterday, UTC)"
    )
    common.add_argument("--input", help="raw input path (overrides the config's data source)")
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
    night.add_argument(
        "--until",
        choices=STAGES,
        help="stop after this stage (one orchestrator task per stage; default: publish)",
    )
    tun = sub.add_parser(
        "tune",
        parents=[common],
        help="search model/training settings on the validation split (Optuna, MLflow)",
    )
    tun.add_argument(
        "--trials", type=int, help="the study's trial budget, over all its runs (tune.trials)"
    )
    tun.add_argument(
        "--timeout",
        type=float,
        help="the study's time budget in seconds, over all its runs (tune.timeout_seconds)",
    )
    tun.add_argument(
        "--workers", type=int, help="trials at once, one process each (default: tune.workers)"
    )
    tun.add_argument(
        "--output", help="winning config YAML (default: <workdir>/tune/<date>/best.yaml)"
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
    rep = sub.add_parser(
        "repair",
        parents=[common],
        help="make models.config, champion.json, run states and served versions agree with "
        "the registry again (docs/OPERATIONS.md)",
    )
    rep.add_argument(
        "--check", action="store_true", help="change nothing; exit 12 if anything disagrees"
    )
    cfg = sub.add_parser("config", help="the configuration a run trains with")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser(
        "show",
        parents=[settings],
        help="every setting, its value and where it came from (default, file, override, "
        "dense_log, auto)",
    )
    show.add_argument(
        "--data",
        help="a preprocessed data folder (<workdir>/data/<date>): decide the `auto` settings "
        "from its stats.json (default: show them undecided, with their rule)",
    )
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
    asg.add_argument(
        "--allow-same-version",
        action="store_true",
        help="let both variants serve one registered version (an A/A test)",
    )
    ana = ab_sub.add_parser(
        "analyze", parents=[common, definition], help="analyse an exposure/outcome log"
    )
    ana.add_argument("--events", required=True, help="Parquet or CSV: user_id, variant, ...")
    ana.add_argument("--pre-events", help="pre-period log of the same users (CUPED)")
    ana.add_argument(
        "--start", help="first day YYYY-MM-DD (default: the definition's): earlier rows are CUPED's"
    )
    ana.add_argument(
        "--timestamp-unit",
        help="unit of numeric timestamps: s, ms, us, ns or auto (by magnitude; the default)",
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
    configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        # Checked before the commands' import, which is about 5 s (TensorFlow, Beam, MLflow;
        # `python -X importtime`) that `--help` and a bad config or date never need.
        args.overrides = _overrides(args.set)
        config = load_config(args.config)
        if args.overrides:
            config = set_values(config, args.overrides)
        if args.command == "config":
            print(_show_config(config, args.data))
            return 0
        date = parse_date(getattr(args, "date", None), config.nightly.timezone)
        from conductor.commands import dispatch

        return dispatch(args, config, date)
    except RecsysError as exc:
        print(f"recsys: error: {redact_text(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("recsys: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        # A disk or permission failure outside a stage (the lock file, the default paths).
        if storage_errno(exc) is None and exc.errno not in ACCESS_ERRNOS:
            raise
        error = StorageError(
            f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}; free space "
            "or fix the volume's permissions, then rerun the same command"
        )
        print(f"recsys: error: {redact_text(str(error))}", file=sys.stderr)
        return error.exit_code


def _overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` options as {dotted key: YAML value}."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set training.epochs=3")
        try:
            values[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError:
            # The value is not repeated: it may be a credential.
            raise ConfigError(f"--set {key.strip()}: the value is not valid YAML") from None
    return values


def _show_config(config: RecsysConfig, data: str | None) -> str:
    """`recsys config show`: the resolved settings, decided from `data`'s stats.json if given."""
    stats = None
    if data:
        stats = read_stats(require_complete(Path(data), "recsys preprocess")).as_dict()
    return format_settings(resolve_config(config, stats))


if __name__ == "__main__":
    sys.exit(main())
