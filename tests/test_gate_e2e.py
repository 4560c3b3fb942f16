"""End to end against a real server: two nightly runs, the second gated against the first.

The first run (1 epoch, `training.refit: all`) becomes champion; the second (3 epochs: another
config, so another MLflow run) is gated against it on the same test split, the champion
re-evaluated from its run folder: its first fit, not the served refit that trained on those
test items. Then `recsys compare v1 v2` reports on both.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from mlflow import MlflowClient

from conductor import cli
from recsys.tracking.compare import user_segments
from tests.conftest import SMALL, SMALL_DATE, plain
from tests.mlflow_server import MlflowServer

pytestmark = pytest.mark.slow

DAY1 = DAY2 = SMALL_DATE  # SMALL rejects rows after its date: both nights use its last day
MODEL = "e2e-model"


def _config(
    root: Path, uri: str, epochs: int, refit: str = "off", dense: bool = False, mode: str = "full"
) -> Path:
    # The plain model (conftest.PLAIN_MODEL): these tests check the gate, not the model.
    base = plain(SMALL)
    raw = {
        **base,
        "model_name": MODEL,
        "training": {**base["training"], "epochs": epochs, "refit": refit, "mode": mode},
        "tracking": {"uri": uri, "retries": 2, "backoff_seconds": 0.2},
        "gate": {"bootstrap_samples": 500},
    }
    if dense:  # a dense_log rule that applies to any log and changes nothing
        raw["dense_log"] = {"min_events_per_user": 1, "settings": {"training.learning_rate": 0.01}}
    path = root / f"epochs{epochs}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = cli.main(list(args))
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    return out.out


@pytest.fixture(scope="module")
def two_nights(
    server: MlflowServer, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[str]]:
    """Workdir and the CLI output of both nights (run in-process: TensorFlow loads once)."""
    root = tmp_path_factory.mktemp("e2e")
    work = root / "work"
    outputs = []
    nights = ((DAY1, 1, "all", False, "full"), (DAY2, 3, "off", True, "incremental"))
    for date, epochs, refit, dense, mode in nights:
        config = _config(root, server.uri, epochs, refit, dense, mode)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = cli.main(
                ["nightly", "--config", str(config), "--workdir", str(work), "--date", date]
            )
        assert code == 0, printed.getvalue()  # promote or keep: both succeed
        outputs.append(printed.getvalue())
    return work, outputs


def test_cli_prints_the_gate_decision(two_nights: tuple[Path, list[str]]) -> None:
    _, (first, second) = two_nights
    assert "registered:  version 1 (champion now: 1)" in first
    assert "gate: PROMOTE: no champion yet" in first
    assert "registered:  version 2" in second
    assert "gate: PROMOTE" in second or "gate: KEEP" in second
    assert "recall_at_50: delta" in second and "CI [" in second
    assert "champion: version 1" in second


def test_second_night_is_gated_against_the_first(
    two_nights: tuple[Path, list[str]], server: MlflowServer
) -> None:
    client = MlflowClient(server.uri)
    versions = {v.version: v for v in client.search_model_versions(f"name = '{MODEL}'")}
    assert set(versions) == {"1", "2"}
    first, second = (client.get_run(versions[v].run_id) for v in ("1", "2"))
    assert first.data.tags["run_date"] == DAY1 and second.data.tags["run_date"] == DAY2
    assert first.data.tags["config_digest"] != second.data.tags["config_digest"]
    assert first.data.tags["gate.decision"] == "promote"
    assert first.data.tags["gate.champion_version"] == "none"
    assert second.data.tags["gate.champion_version"] == "1"
    assert second.data.tags["device.strategy"]  # from the training result, or the default
    assert first.data.tags["dense_log_settings"] == "{}"
    assert second.data.tags["dense_log_settings"] == '{"training.learning_rate": 0.01}'

    gate = json.loads(Path(client.download_artifacts(second.info.run_id, "gate.json")).read_text())
    aliases = client.get_registered_model(MODEL).aliases
    assert aliases["challenger"] == "2"
    assert aliases["champion"] == ("2" if gate["promote"] else "1")
    assert second.data.tags["gate.decision"] == gate["decision"]
    assert second.data.metrics["gate_promoted"] == float(gate["promote"])

    # The champion was evaluated on today's test split exactly as `recsys evaluate` does it:
    # both nights share the date, so it must reproduce the champion's own evaluation, which
    # scored its first fit (refit all: the served model also trained on the test split).
    assert first.data.tags["evaluated_model"] == "eval_model"
    assert second.data.tags["evaluated_model"] == "model"
    logged_models = {a.path for a in client.list_artifacts(first.info.run_id)}
    assert {"trained_model", "evaluation_model"} <= logged_models
    run1, run2 = Path(first.data.tags["run_dir"]), Path(second.data.tags["run_dir"])
    # The second night is incremental: it started from the champion's served model.
    trained = json.loads((run2 / "train.json").read_text())
    assert trained["incremental_from"] == str(run1 / "model")
    assert json.loads((run1 / "train.json").read_text())["incremental_from"] is None
    assert first.data.tags["data_dir"] == second.data.tags["data_dir"]
    logged = pq.read_table(run2 / "gate" / "champion_per_user_eval.parquet").to_pydict()
    own = pq.read_table(run1 / "per_user_eval.parquet").to_pydict()
    assert logged.keys() == own.keys() and logged["user_id"] == own["user_id"]
    for column in own:
        if column != "user_id":
            np.testing.assert_allclose(logged[column], own[column], err_msg=column)
    users, per_user = own["user_id"], own
    challenger = pq.read_table(run2 / "per_user_eval.parquet").to_pydict()
    assert sorted(challenger["user_id"]) == sorted(users)  # same evaluation users
    by_user = dict(zip(challenger["user_id"], challenger["recall_at_50"], strict=True))
    diff = np.array([by_user[u] for u in users]) - np.asarray(per_user["recall_at_50"])
    assert gate["primary"]["delta"] == pytest.approx(diff.mean())
    assert gate["primary"]["ci_low"] <= diff.mean() <= gate["primary"]["ci_high"]
    assert gate["users"] == len(users)
    artifacts = {a.path for a in client.list_artifacts(second.info.run_id, "gate")}
    assert artifacts == {"gate/champion_per_user_eval.parquet"}


def test_compare_report_with_segments(
    two_nights: tuple[Path, list[str]],
    server: MlflowServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    work, _ = two_nights
    config = _config(tmp_path, server.uri, 1)
    out = tmp_path / "report"
    printed = _run(
        capsys, "compare", "v1", "v2", "--config", str(config), "--workdir", str(work),
        "--output", str(out),
    )  # fmt: skip
    assert "recall_at_50" in printed and "comparisons experiment" in printed
    saved = json.loads((out / "comparison.json").read_text())
    assert set(saved["segments"]) == {"new users", "returning users", "head items", "tail items"}
    assert (out / "comparison.png").stat().st_size > 10_000

    # A segment's value is the plain mean of the per-user metric over its common users.
    client = MlflowClient(server.uri)
    runs = [client.get_run(r["run_id"]) for r in saved["runs"]]
    tables = []
    for run in runs:
        path = client.download_artifacts(run.info.run_id, "per_user_eval.parquet", str(tmp_path))
        tables.append(pq.read_table(path).to_pydict())
    common = set(tables[0]["user_id"]) & set(tables[1]["user_id"])
    labels = user_segments(Path(runs[0].data.tags["data_dir"]))
    for segment in ("head items", "returning users"):
        members = [u for u in common if segment in labels[u]]
        for ref, table in zip(("v1", "v2"), tables, strict=True):
            values = dict(zip(table["user_id"], table["recall_at_50"], strict=True))
            expected = np.mean([values[u] for u in members]) if members else float("nan")
            got = saved["segments"][segment][ref]["value"]
            assert got == pytest.approx(expected, nan_ok=True)
            assert saved["segments"][segment][ref]["users"] == len(members)
