"""Apache Airflow DAG `recsys_nightly`: the nightly's stages as tasks, one date per run.

preprocess -> train -> evaluate -> export -> publish. Each task runs the `recsys` command line
of the project's own environment (RECSYS_BIN, default /opt/recsys/.venv/bin/recsys): Airflow
never imports recsys, so its pins and ours never meet. Task k is
`recsys nightly --date {{ ds }} --until <stage k>`; the last one is the plain nightly. Every
task therefore works on the nightly's own run folder and markers: a retried task resumes
where its stage stopped, and a finished stage is skipped (deploy/README.md, "Airflow").

- Dates: a daily data interval from 02:30 UTC; a run's logical date (`ds`) is the day whose
  data it trains on, the run starts when that day is over, as `recsys nightly` with its
  default date at 02:30. Backfill: `airflow backfill create --dag-id recsys_nightly
  --from-date 2026-01-01 --to-date 2026-01-07` (runs one date at a time, oldest first).
- One at a time: `max_active_runs=1` here, and each command takes the working directory's
  lock (exit 8 while another recsys process holds it, e.g. a nightly started by hand).
- Exit codes (docs/OPERATIONS.md): infrastructure and transient failures are retried with
  backoff; bad config, bad data, a missing input and broken models fail at once.

Settings (environment of the Airflow workers): RECSYS_BIN, RECSYS_CONFIG (default
/opt/recsys/configs/default.yaml), RECSYS_WORKDIR (default /var/lib/recsys); a manual run
may override config and workdir with its params.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shlex
import subprocess

from airflow.sdk import DAG, CronDataIntervalTimetable, Param, task
from airflow.sdk.exceptions import AirflowException, AirflowFailException

log = logging.getLogger(__name__)

STAGES = ("preprocess", "train", "evaluate", "export", "publish")
# The exit codes of `recsys` (docs/OPERATIONS.md, "Exit codes"); tests/test_airflow_dag.py
# checks that every code the project defines is in exactly one of these.
RETRY = {
    6: "tracking store unreachable",
    8: "working directory locked by another recsys process",
    9: "storage full or read-only",
    10: "stage failed (a rerun continues from it)",
    130: "interrupted",
}
FAIL = {
    1: "unexpected error (a bug: see the traceback)",
    2: "invalid config or argument",
    3: "unusable input data",
    4: "a stage's input is missing",
    5: "exported SavedModel does not match the model",
    7: "out of device memory (lower the batch size)",
    11: "a served model is broken (re-export it)",
    12: "records that must agree do not (run recsys repair)",
}
# Killed by the kernel or the scheduler (OOM killer, eviction): retried, the stage resumes.
SIGNAL_EXIT = 128
CONFIG = os.environ.get("RECSYS_CONFIG", "/opt/recsys/configs/default.yaml")
WORKDIR = os.environ.get("RECSYS_WORKDIR", "/var/lib/recsys")


def run_recsys(args: list[str]) -> None:
    """Run one `recsys` command, its output in the task log; map its exit code for Airflow."""
    command = [os.environ.get("RECSYS_BIN", "/opt/recsys/.venv/bin/recsys"), *args]
    log.info("running: %s", shlex.join(command))
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            log.info("%s", line.rstrip())
    code = process.returncode
    if code == 0:
        return
    if code < 0 or code > SIGNAL_EXIT or code in RETRY:
        why = RETRY.get(code, f"killed by signal {-code if code < 0 else code - SIGNAL_EXIT}")
        raise AirflowException(f"recsys exited with code {code} ({why}): retried")
    why = FAIL.get(code, "not a documented recsys exit code")
    raise AirflowFailException(f"recsys exited with code {code} ({why}): not retried")


with DAG(
    dag_id="recsys_nightly",
    description="recsys nightly retraining: preprocess, train, evaluate, export, publish",
    schedule=CronDataIntervalTimetable("30 2 * * *", timezone="UTC"),
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    max_active_tasks=1,
    params={
        "config": Param(CONFIG, type="string", description="recsys --config"),
        "workdir": Param(WORKDIR, type="string", description="recsys --workdir"),
    },
    default_args={
        "retries": 3,
        "retry_delay": dt.timedelta(minutes=5),
        "retry_exponential_backoff": True,
        "max_retry_delay": dt.timedelta(hours=1),
    },
    tags=["recsys"],
) as dag:
    previous = None
    for stage in STAGES:
        until = [] if stage == STAGES[-1] else ["--until", stage]

        @task(task_id=stage, execution_timeout=dt.timedelta(hours=6))
        def run_stage(until: list[str] = until, **context: object) -> None:
            """One stage of the date's nightly (the logical date's `ds`)."""
            params = context["params"]
            run_recsys(["nightly", "--config", params["config"], "--workdir",
                        params["workdir"], "--date", str(context["ds"]), *until])  # fmt: skip

        current = run_stage()
        if previous is not None:
            previous >> current
        previous = current
