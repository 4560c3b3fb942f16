"""`recsys repair`: bring every record of a working directory back in line with the registry.

What must agree (docs/OPERATIONS.md, "What must always agree") and what repair does about it,
in this order:

1. run folders still waiting for MLflow (`mlflow_pending.json`): published, as `recsys sync`;
2. MLflow runs of this host and workdir left RUNNING by a killed process: marked KILLED;
3. `export/models.config` and `champion.json`: rewritten from the `champion` / `challenger`
   aliases (recsys.serving_state);
4. a version models.config routes to whose files are missing or changed: re-exported from
   its run folder (verified, then put back in place).

`--check` changes nothing and lists the same things. Whatever still disagrees afterwards (an
aliased version whose run folder is gone, say) ends the command with StateDriftError (exit 12).
The caller holds the workdir lock.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass, field

import yaml

from conductor import stages
from conductor.promotion import PENDING
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.errors import RecsysError, StateDriftError
from recsys.core.layout import RunFile, Workdir
from recsys.serving_state import derive_serving_state, serving_drift, write_serving_state
from recsys.tracking.runs import (
    TRACKING_FAILURES,
    bounded_http_retries,
    check_tracking_store,
    connect,
    end_abandoned_runs,
    tracking_error,
)
from serving_export.integrity import check_routed, runs_by_version

log = logging.getLogger(__name__)


@dataclass
class RepairReport:
    """What was put right, and what still disagrees (each with the command that fixes it)."""

    fixed: list[str] = field(default_factory=list)
    remaining: list[str] = field(default_factory=list)


def repair(config: RecsysConfig, workdir: Workdir, *, check: bool = False) -> RepairReport:
    """Every record made to agree again (or, with `check`, only listed)."""
    report = RepairReport()
    publish_pending(config, workdir, check, report)
    uri = check_tracking_store(config, workdir.root)
    try:
        with bounded_http_retries():
            client = connect(config, workdir.root, uri)
            ended = end_abandoned_runs(client, workdir.root, dry_run=check)
            state = derive_serving_state(client, config.model_name)
    except TRACKING_FAILURES as exc:
        raise tracking_error(uri, workdir.root, exc) from None
    (report.remaining if check else report.fixed).extend(ended)
    if check:
        report.remaining += serving_drift(state, workdir)
    else:
        report.fixed += write_serving_state(state, workdir, config.export.serving_base_path)
    report.remaining += state.problems
    reexport_broken(workdir, check, report)
    return report


def publish_pending(
    config: RecsysConfig, workdir: Workdir, check: bool, report: RepairReport
) -> None:
    """Run folders that never reached MLflow: published (as `recsys sync` does) or listed."""
    runs_root = workdir.path("runs")
    markers = sorted(runs_root.glob(f"*/*/{PENDING}")) if runs_root.is_dir() else []
    for date in sorted({marker.parent.parent.name for marker in markers}):
        if check:
            report.remaining.append(
                f"runs/{date} has run folders not yet published to MLflow: "
                f"`recsys sync --date {date}` (or `recsys repair`)"
            )
            continue
        for published in stages.sync(config, workdir, dt.date.fromisoformat(date)):
            report.fixed.append(
                f"published a pending run of {date} to MLflow as version {published.version}"
            )


def reexport_broken(workdir: Workdir, check: bool, report: RepairReport) -> None:
    """Routed versions with missing or changed files: re-exported from their run, or listed."""
    runs = runs_by_version(workdir.root)
    for version in sorted({b.version for b in check_routed(workdir.export_root())}):
        run = runs.get(version)
        if run is None:
            report.remaining.append(
                f"export version {version} is routed by models.config but broken, and its run "
                "folder is gone: promote another version"
            )
        elif check:
            report.remaining.append(
                f"export version {version} is routed by models.config but broken: "
                f"`recsys export --date {run.parent.name} --run-id {run.name}` (or `recsys repair`)"
            )
        else:
            run_config = parse_config(yaml.safe_load((run / RunFile.CONFIG).read_text()))
            date = dt.date.fromisoformat(run.parent.name)
            stages.export(run_config, workdir, date, run.name, verify=True)
            report.fixed.append(f"re-exported version {version} from {run}")


def format_report(report: RepairReport, check: bool) -> str:
    """The lines `recsys repair` prints."""
    lines = [f"{'to fix' if check else 'fixed'}:  {line}" for line in report.fixed]
    lines += [f"{'to fix' if check else 'remains'}: {line}" for line in report.remaining]
    if not lines:
        lines.append("all records agree: registry aliases, models.config, champion.json, "
                     "run states, served versions")  # fmt: skip
    return "\n".join(lines)


def drift_error(report: RepairReport, check: bool) -> RecsysError | None:
    """StateDriftError when anything still disagrees, else None."""
    if not report.remaining:
        return None
    count = len(report.remaining)
    what = f"{count} record{'s' if count > 1 else ''} disagree{'' if count > 1 else 's'}"
    return StateDriftError(
        f"{what}{'' if check else ' after repair'} (listed above); "
        + ("run `recsys repair`" if check else "follow the command each line names")
        + f": {json.dumps(report.remaining[0])[:300]}"
    )
