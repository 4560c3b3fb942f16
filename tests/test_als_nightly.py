"""The classic baseline through whole nights against a real MLflow server.

Two first nights in one working directory, each of its own registered model, both with a
model trained one epoch at a learning rate of 1e-6 (its random initial towers, in effect),
which ALS beats on SMALL's log: under `evaluation.classic_baseline.policy: refuse` nothing is
promoted; under `warn` the first model becomes champion as before. Both say so in their
summary and report, and log ALS beside the model in MLflow.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from conductor import cli
from recsys.core.layout import RunFile
from recsys.core.records import read_metrics
from tests.conftest import SMALL, SMALL_DATE, plain
from tests.mlflow_server import MlflowServer

pytestmark = pytest.mark.slow

POLICIES = ("refuse", "warn")


def _config(root: Path, uri: str, policy: str) -> Path:
    base = plain(SMALL)
    raw = {
        **base,
        "model_name": f"als-{policy}",
        "training": {**base["training"], "epochs": 1, "learning_rate": 1e-6},
        "evaluation": {**base["evaluation"], "classic_baseline": {"policy": policy}},
        "export": {**base["export"], "verify": False},  # checked elsewhere; seconds here
        "tracking": {"uri": uri, "retries": 2, "backoff_seconds": 0.2},
        "gate": {"bootstrap_samples": 200},
    }
    path = root / f"{policy}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def nights(server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each policy's night (in-process: TensorFlow loads once): policy -> its CLI output."""
    root = tmp_path_factory.mktemp("als-nights")
    printed: dict[str, str] = {}
    for policy in POLICIES:
        out = io.StringIO()
        args = ["--config", str(_config(root, server.uri, policy)), "--date", SMALL_DATE]
        with contextlib.redirect_stdout(out):
            code = cli.main(["nightly", *args, "--workdir", str(root / "work")])
        assert code == 0, out.getvalue()
        printed[policy] = out.getvalue()
    return printed


def _run(client: MlflowClient, policy: str) -> tuple[str, Path]:
    (version,) = client.search_model_versions(f"name = 'als-{policy}'")
    assert version.run_id is not None
    return version.run_id, Path(client.get_run(version.run_id).data.tags["run_dir"])


def test_refuse_promotes_nothing_on_a_first_night_that_als_wins(
    nights: dict[str, str], server: MlflowServer
) -> None:
    client = MlflowClient(server.uri)
    run_id, run_dir = _run(client, "refuse")
    als = read_metrics(run_dir).als
    assert als is not None and als.comparison.model_loses  # the premise: ALS won
    tags = client.get_run(run_id).data.tags
    assert tags["gate.decision"] == "keep" and tags["gate.champion_version"] == "none"
    assert "no champion yet, but ALS beat the model on recall_at_50" in tags["gate.reasons"]
    assert "champion" not in client.get_registered_model("als-refuse").aliases
    out = nights["refuse"]
    assert "gate: KEEP: no champion yet, but ALS beat the model" in out
    assert "(champion now: none)" in out
    assert "  FAIL recall_at_50 vs ALS: delta -" in out
    summary = (run_dir / RunFile.SUMMARY).read_text()
    assert f"- {als.comparison.line('ALS')}" in summary
    assert "nothing is promoted" in summary


def test_warn_gates_as_before(nights: dict[str, str], server: MlflowServer) -> None:
    client = MlflowClient(server.uri)
    run_id, run_dir = _run(client, "warn")
    als = read_metrics(run_dir).als
    assert als is not None and als.comparison.model_loses
    assert client.get_registered_model("als-warn").aliases["champion"] == "1"
    tags = client.get_run(run_id).data.tags
    assert tags["gate.decision"] == "promote"
    assert tags["gate.reasons"] == "no champion yet: the first model becomes champion"
    out = nights["warn"]
    assert "gate: PROMOTE: no champion yet" in out
    # The plain line, in the CLI's report and in summary.md.
    assert als.comparison.line("ALS") in out and out.count("ALS beat the model") == 1
    assert f"- {als.comparison.line('ALS')}" in (run_dir / RunFile.SUMMARY).read_text()


@pytest.mark.parametrize("policy", POLICIES)
def test_mlflow_run_has_als_beside_the_model(
    nights: dict[str, str], server: MlflowServer, policy: str
) -> None:
    client = MlflowClient(server.uri)
    run_id, run_dir = _run(client, policy)
    report = read_metrics(run_dir)
    als = report.als
    assert als is not None
    run = client.get_run(run_id).data
    for name in ("recall_at_10", "recall_at_50", "ndcg_at_10", "mrr_at_100", "coverage_at_10"):
        assert f"test_{name}" in run.metrics and f"popularity_{name}" in run.metrics
        assert run.metrics[f"als_{name}"] == pytest.approx(report.baselines["als"][name])
    assert run.metrics["als_seconds"] == pytest.approx(als.seconds)
    assert run.metrics["als_validation_recall_at_50"] == pytest.approx(als.validation)
    assert run.metrics["model_minus_als_recall_at_50"] == pytest.approx(als.comparison.delta)
    assert run.metrics["model_minus_als_recall_at_50_ci_low"] < 0
    assert run.tags["als.factors"] == str(als.factors)
    assert run.tags["als.regularization"] == f"{als.regularization:g}"
    assert run.tags["als.alpha"] == f"{als.alpha:g}"
    assert run.tags["als.settings_tried"] == "12 of 12"
    assert run.tags["als.budget_exhausted"] == "false"
    assert run.tags["als.verdict"].startswith("ALS beat the model on recall_at_50")
    # The resolved settings, as every setting: the grid and the policy.
    assert run.params["evaluation.classic_baseline.policy"] == policy
