"""`recsys compare` against a real server: refs resolve, files exist, numbers match by hand."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from conductor.promotion import publish_run
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.errors import ConfigError
from recsys.core.layout import Workdir
from recsys.evaluation import per_user_values
from recsys.tracking.compare import compare, format_table, recall_ndcg_curves
from recsys.tracking.gate import paired_bootstrap
from tests.mlflow_server import MlflowServer
from tests.test_tracking_registry import configured, fake_run

DAY_A, DAY_B = dt.date(2026, 1, 5), dt.date(2026, 1, 6)


def _per_user(users: list[str], ranks: np.ndarray) -> dict[str, list]:
    config = parse_config({"evaluation": {"ks": [10, 50]}}).evaluation
    values = per_user_values(np.where(ranks < 0, np.inf, ranks).astype(float), config)
    return {"user_id": users, **{k: v.tolist() for k, v in values.items()}}


@pytest.fixture(scope="module")
def published(
    server: MlflowServer, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RecsysConfig, Path, dict[str, dict[str, list]], list[str]]:
    """Two published runs: A (champion, v1) and B (challenger, v2) on overlapping users."""
    from tests.conftest import SMALL

    config = configured(parse_config(SMALL), server.uri, "cmp-model")
    root = tmp_path_factory.mktemp("compare")
    workdir = Workdir(root)
    rng = np.random.default_rng(0)
    tables = {
        # A: users u0..u299; B: u50..u349 with better ranks -> 250 common users.
        "A": _per_user([f"u{i}" for i in range(300)], rng.integers(-1, 150, 300)),
        "B": _per_user([f"u{i}" for i in range(50, 350)], rng.integers(-1, 60, 300)),
    }
    run_ids = []
    for date, name in ((DAY_A, "A"), (DAY_B, "B")):
        run_dir = fake_run(workdir, config, date, tables[name], fingerprint=f"fp-{name}")
        run_ids.append(publish_run(config, workdir, date, run_dir).mlflow_run_id)
    return config, root, tables, run_ids


def test_compare_files_and_numbers(
    published: tuple[RecsysConfig, Path, dict[str, dict[str, list]], list[str]],
    server: MlflowServer,
) -> None:
    config, root, tables, run_ids = published
    out = root / "report"
    result = compare(config, root, ["champion", "challenger"], out)

    assert [r.run_id for r in result.runs] == run_ids
    assert [r.version for r in result.runs] == ["1", "2"]
    for kind in ("chart", "markdown", "html", "json"):
        assert result.files[kind].is_file() and result.files[kind].stat().st_size > 0
    assert result.files["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Direct computation on the 250 common users.
    a = {k: np.asarray(v) for k, v in tables["A"].items()}
    b = {k: np.asarray(v) for k, v in tables["B"].items()}
    common = sorted(set(a["user_id"]) & set(b["user_id"]))
    ia = [list(a["user_id"]).index(u) for u in common]
    ib = [list(b["user_id"]).index(u) for u in common]
    saved = json.loads(result.files["json"].read_text())
    rows = {r["metric"]: r for r in saved["rows"]}
    expected = {"recall_at_10", "recall_at_50", "ndcg_at_10", "mrr_at_100", "coverage_at_10"}
    assert set(rows) == expected
    gate = config.gate
    for metric in ("recall_at_10", "recall_at_50", "ndcg_at_10"):
        diff = b[metric][ib] - a[metric][ia]
        ci = paired_bootstrap(
            diff, samples=gate.bootstrap_samples, confidence=gate.confidence, seed=gate.seed
        )
        row = rows[metric]
        assert row["users"] == 250
        assert row["baseline"] == pytest.approx(a[metric][ia].mean())
        assert row["value"] == pytest.approx(b[metric][ib].mean())
        assert row["delta"] == pytest.approx(diff.mean())
        assert (row["ci_low"], row["ci_high"]) == pytest.approx((ci.low, ci.high))
    assert rows["coverage_at_10"]["ci_low"] is None  # catalog-level: no per-user values

    ranks_a = np.where(a["rank"][ia] < 0, np.inf, a["rank"][ia])
    for k in (1, 10, 50, 100):
        assert saved["curves"]["recall"]["champion"][k - 1] == pytest.approx(
            float((ranks_a < k).mean())
        )
    direct = recall_ndcg_curves(ranks_a)
    assert saved["curves"]["ndcg"]["champion"] == pytest.approx(direct["ndcg"])
    assert saved["curves"]["recall"]["champion"][9] == pytest.approx(
        rows["recall_at_10"]["baseline"]
    )
    assert "segments skipped" in saved["notes"][0]  # the fake runs have no real data folder

    table = format_table(result)
    assert "recall_at_50" in table and f"{rows['recall_at_50']['delta']:+.4f}" in table
    markdown = result.files["markdown"].read_text()
    assert "| recall_at_50 | challenger |" in markdown and "comparison.png" in markdown
    assert "<table>" in result.files["html"].read_text()

    client = MlflowClient(server.uri)
    assert result.mlflow_run_id is not None
    run = client.get_run(result.mlflow_run_id)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "comparisons"
    assert run.data.tags["compared_run_ids"] == ",".join(run_ids)
    logged = {a.path for a in client.list_artifacts(result.mlflow_run_id)}
    assert {"comparison.png", "comparison.md", "comparison.html", "comparison.json"} <= logged


def test_refs_by_version_date_and_run_id(
    published: tuple[RecsysConfig, Path, dict[str, dict[str, list]], list[str]],
) -> None:
    config, root, _, run_ids = published
    result = compare(
        config, root, ["v2", "2026-01-05", run_ids[1]], root / "r2", log_to_mlflow=False
    )
    assert [r.run_id for r in result.runs] == [run_ids[1], run_ids[0], run_ids[1]]
    assert result.mlflow_run_id is None
    same = [r for r in result.rows if r.run == run_ids[1] and r.ci_low is not None]
    assert same and all(r.delta == 0 and r.ci_low == 0 == r.ci_high for r in same)
    with pytest.raises(ConfigError, match="no version v9"):
        compare(config, root, ["v9", "v1"], root / "r3", log_to_mlflow=False)
    with pytest.raises(ConfigError, match="no completed nightly run"):
        compare(config, root, ["2025-01-01", "v1"], root / "r4", log_to_mlflow=False)
    with pytest.raises(ConfigError, match="not a run id"):
        compare(config, root, ["nope", "v1"], root / "r5", log_to_mlflow=False)
