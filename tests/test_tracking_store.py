"""The local MLflow store survives a kill while it is being created.

MLflow creates the SQLite store's tables and runs its migrations on first use. A process
killed in between used to leave a half-migrated `mlflow.db` ("table _alembic_tmp_metrics
already exists") that every later night failed on. Each case here kills the creating process
(at a fault point inside creation, or from outside at timed moments once the database file
appears), then reruns: the rerun must complete with exactly one run and one model version.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from recsys.tracking.runs import default_tracking_uri

pytestmark = pytest.mark.slow

# One process = one night's use of the store: connect, then one run and one registered version
# (a rerun reuses them, as the nightly does).
NIGHT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from recsys.core.config import parse_config
    from recsys.tracking.runs import connect

    work = Path(sys.argv[1])
    client = connect(parse_config({}), work)
    # Idempotent like the nightly (a kill may land after the store was made): reuse what exists.
    found = client.get_experiment_by_name("night")
    experiment = found.experiment_id if found else client.create_experiment("night")
    runs = client.search_runs([experiment])
    run = runs[0] if runs else client.create_run(experiment)
    if not client.search_registered_models("name = 'model'"):
        client.create_registered_model("model")
    if not client.search_model_versions("name = 'model'"):
        client.create_model_version("model", source=str(work), run_id=run.info.run_id)
    print("done")
    """
)


def _night(work: Path, fault: str | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "RECSYS_FAULT"}
    if fault:
        env["RECSYS_FAULT"] = fault
    return subprocess.Popen(
        [sys.executable, "-c", NIGHT, str(work)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _rerun_completes_once(work: Path) -> None:
    proc = _night(work)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "done" in out, err[-3000:]
    client = MlflowClient(tracking_uri=default_tracking_uri(work))
    experiment = client.get_experiment_by_name("night")
    assert len(client.search_runs([experiment.experiment_id])) == 1
    assert len(client.search_model_versions("name = 'model'")) == 1
    assert not list((work / "mlflow").glob(".tmp-mlflow-*"))  # the killed attempt's file


def test_a_kill_at_the_fault_point_inside_store_creation(tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = _night(work, fault="tracking:store-migrated:kill")
    proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL
    assert not (work / "mlflow" / "mlflow.db").exists()  # never visible half-made
    _rerun_completes_once(work)


@pytest.mark.parametrize("delay", [0.3, 1.5])
def test_timed_kills_while_the_store_is_created(tmp_path: Path, delay: float) -> None:
    work = tmp_path / "work"
    proc = _night(work)
    deadline = time.monotonic() + 300
    # The moment the database file appears, whatever its name: tables are being created.
    while not list((work / "mlflow").glob("*.db")):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    _rerun_completes_once(work)
