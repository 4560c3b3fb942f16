"""The Airflow DAG checked by Airflow itself (`make airflow-check`, which .ci/run calls).

Run with the Airflow environment's Python (.venv-airflow, deploy/airflow/requirements.txt);
the DAG's tasks run the project's own `recsys` (--recsys, the main .venv's):

1. the DAG folder imports with no errors (Airflow's DagBag) and holds `recsys_nightly`: the
   five stages in order, one run at a time;
2. `run_recsys` raises Airflow's retried exception for a retried exit code and its
   not-retried one for the others (stand-in commands that only exit with the code);
3. `airflow dags test recsys_nightly 2026-01-05` runs the whole night on the small synthetic
   log of ci-config.yaml, and the working directory then holds the published run.

Prints `N passed, 0 failed` and exits 0, or names what failed and exits 1.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATE = "2026-01-05"  # the last day of the synthetic log in ci-config.yaml
STAGES = ["preprocess", "train", "evaluate", "export", "publish"]


def check_dagbag() -> None:
    """The DAG folder imports cleanly and the DAG has the promised shape."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(HERE))
    assert bag.import_errors == {}, bag.import_errors
    dag = bag.dags["recsys_nightly"]
    assert [t.task_id for t in dag.tasks] == STAGES
    for before, after in itertools.pairwise(STAGES):
        assert dag.get_task(before).downstream_task_ids == {after}
    assert dag.max_active_runs == 1 and dag.max_active_tasks == 1
    assert all(t.retries >= 1 for t in dag.tasks)


def check_exit_codes(work: Path) -> None:
    """Retried codes raise AirflowException, the others AirflowFailException (no retry)."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    sys.path.insert(0, str(HERE))
    import recsys_nightly as dag_file

    logging.getLogger(dag_file.__name__).setLevel(logging.WARNING)  # the stand-ins' output

    for code in (0, 2, 3, 6, 8, 10, 11, 137):
        script = work / f"exit-{code}"
        script.write_text(f"#!/bin/sh\necho stand-in for recsys\nexit {code}\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        os.environ["RECSYS_BIN"] = str(script)
        try:
            dag_file.run_recsys(["nightly"])
            raised: type | None = None
        except AirflowFailException:
            raised = AirflowFailException
        except AirflowException:
            raised = AirflowException
        retried = code in dag_file.RETRY or code > dag_file.SIGNAL_EXIT
        expected = None if code == 0 else AirflowException if retried else AirflowFailException
        assert raised is expected, (code, raised)


def check_dags_test(recsys: str, work: Path) -> None:
    """The whole night through Airflow, on the synthetic log, with the project's recsys."""
    env = _airflow_env(recsys, work)
    airflow = str(Path(sys.executable).parent / "airflow")
    _run([airflow, "db", "migrate"], env)
    _run([airflow, "dags", "test", "recsys_nightly", DATE], env)
    published = sorted((work / "recsys-work" / "runs" / DATE).glob("*/_SUCCESS.publish"))
    assert len(published) == 1, published
    assert (work / "recsys-work" / "champion.json").is_file()


def _airflow_env(recsys: str, work: Path) -> dict[str, str]:
    return {
        **os.environ,
        "AIRFLOW_HOME": str(work / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(HERE),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "RECSYS_BIN": recsys,
        "RECSYS_CONFIG": str(HERE / "ci-config.yaml"),
        "RECSYS_WORKDIR": str(work / "recsys-work"),
    }


def _run(command: list[str], env: dict[str, str]) -> None:
    log = Path(env["AIRFLOW_HOME"]) / "check.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        result = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=1800, check=False)  # fmt: skip
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-6000:]
        raise AssertionError(f"{' '.join(command[1:])} exited {result.returncode}:\n{tail}")


def main() -> int:
    """Run the checks; one line each, then the count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recsys", required=True, help="the project's recsys executable")
    args = parser.parse_args()
    recsys = str(Path(args.recsys).resolve())
    with tempfile.TemporaryDirectory(prefix="recsys-airflow-") as tmp:
        work = Path(tmp)
        checks: list[tuple[str, Callable[[], None]]] = [
            ("dagbag", check_dagbag),
            ("exit codes", lambda: check_exit_codes(work)),
            ("dags test", lambda: check_dags_test(recsys, work)),
        ]
        failed = 0
        for name, check in checks:
            start = time.monotonic()
            try:
                check()
            except Exception as exc:  # report every check, then fail
                failed += 1
                print(f"airflow check {name}: FAILED: {type(exc).__name__}: {exc}")
            else:
                print(f"airflow check {name}: ok ({time.monotonic() - start:.0f} s)")
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
