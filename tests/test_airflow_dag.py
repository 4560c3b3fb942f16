"""The Airflow DAG's contract with recsys, checked here without Airflow.

Airflow has its own venv (its pins clash with ours) and checks the DAG itself in CI: `make
airflow-check` (deploy/airflow/check_dag.py: DagBag, the exit-code mapping with Airflow's
exceptions, `airflow dags test` on the synthetic log). Here: every exit code recsys can
return is mapped to retry or fail, the tasks are the nightly's stages, the CI config is the
tests' SMALL one, the Airflow environment is pinned and built only by the Makefile target CI
calls, and `recsys nightly --until`, which each task runs, stops after its stage.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from conductor.cli import main
from recsys.core import errors
from recsys.core.config import load_config, parse_config
from recsys.core.layout import STAGES, SUCCESS
from tests.conftest import REPO, SMALL, SMALL_DATE

AIRFLOW = REPO / "deploy" / "airflow"


def _constants(path: Path) -> dict[str, object]:
    """The module-level literal constants of a file (the DAG imports Airflow: not run here)."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    found[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    return found


def _exit_codes() -> set[int]:
    """Every exit code recsys returns: its error types', 1 (a bug), 130 (interrupted)."""
    classes, todo = set(), [errors.RecsysError]
    while todo:
        cls = todo.pop()
        classes.add(cls)
        todo += cls.__subclasses__()
    return {cls.exit_code for cls in classes} | {130}


def test_every_recsys_exit_code_is_retried_or_failed() -> None:
    dag = _constants(AIRFLOW / "recsys_nightly.py")
    retry, fail = set(dag["RETRY"]), set(dag["FAIL"])  # type: ignore[call-overload]
    assert not retry & fail
    assert _exit_codes() <= retry | fail
    documented = re.findall(r"^\| (\d+) \|", (REPO / "docs" / "OPERATIONS.md").read_text(), re.M)
    assert {int(code) for code in documented} - {0} <= retry | fail
    # Infrastructure and a failed stage are retried (the rerun resumes); bad input is not.
    assert {6, 8, 9, 10} <= retry and {2, 3, 4, 5, 7, 11, 12} <= fail


def test_the_tasks_are_the_nightlys_stages() -> None:
    assert list(_constants(AIRFLOW / "recsys_nightly.py")["STAGES"]) == list(STAGES)  # type: ignore[call-overload]


def test_the_ci_config_is_the_tests_small_config() -> None:
    written = load_config(AIRFLOW / "ci-config.yaml")
    assert written == parse_config({**SMALL, "model_name": "airflow-ci"})


def test_the_airflow_environment_is_pinned_and_checked_in_ci() -> None:
    pins = [
        line
        for line in (AIRFLOW / "requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[\w.]+", line) for line in pins), pins
    assert any(re.fullmatch(r"apache-airflow==3\.\d+\.\d+", line) for line in pins)
    makefile = (REPO / "Makefile").read_text()
    target = makefile.split("$(AIRFLOW_BIN)/airflow: deploy/airflow/requirements.txt")[1]
    installs = re.findall(r"pip install ([^\n]+)", target.split("\n\n")[0])
    assert installs == ['-q --upgrade "pip>=24"', "-q -r deploy/airflow/requirements.txt"]
    assert "make airflow-check" in (REPO / ".ci" / "run").read_text()


@pytest.mark.slow
def test_nightly_until_stops_after_a_stage_and_the_next_task_continues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    work = tmp_path / "work"
    base = ["nightly", "--config", str(config), "--workdir", str(work), "--date", SMALL_DATE]
    assert main([*base, "--until", "preprocess"]) == 0
    out = capsys.readouterr().out
    assert "stopped:     after preprocess" in out and not (work / "runs").exists()
    assert (work / "data" / SMALL_DATE / f"{SUCCESS}.preprocess").is_file()

    assert main([*base, "--until", "train"]) == 0
    out = capsys.readouterr().out
    assert "preprocess skipped" in out and "train ran" in out
    (run,) = (work / "runs" / SMALL_DATE).iterdir()
    assert (run / f"{SUCCESS}.train").is_file()
    assert not (run / f"{SUCCESS}.evaluate").exists() and not (work / "export").exists()
    # A retried task: its stage is done, nothing runs again, the same run folder.
    assert main([*base, "--until", "train"]) == 0
    out = capsys.readouterr().out
    assert f"already done up to train, nothing to do (run {run})" in out
    assert list((work / "runs" / SMALL_DATE).iterdir()) == [run]


def test_kubernetes_jobs_fail_at_once_on_the_codes_airflow_does_not_retry() -> None:
    fail = sorted(_constants(AIRFLOW / "recsys_nightly.py")["FAIL"])  # type: ignore[call-overload]
    for manifest in ("cronjob.yaml", "gpu/cronjob.yaml"):
        docs = yaml.safe_load_all((REPO / "deploy" / "kubernetes" / manifest).read_text())
        for job in (d for d in docs if d["kind"] == "CronJob"):
            spec = job["spec"]["jobTemplate"]["spec"]
            assert spec["template"]["spec"]["restartPolicy"] == "Never"  # the policy needs it
            (rule,) = spec["podFailurePolicy"]["rules"]
            assert rule["action"] == "FailJob" and rule["onExitCodes"]["operator"] == "In"
            assert rule["onExitCodes"]["values"] == fail, (manifest, job["metadata"]["name"])
            assert spec["backoffLimit"] >= 1  # a killed pod is retried and resumes
