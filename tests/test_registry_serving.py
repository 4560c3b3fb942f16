"""The registry, serving and A/B never disagree: reproductions run through the real CLI.

Every check reads the registry with MlflowClient from the working directory's own store. One
working directory gets three nights: 2026-01-05 (version 1: champion and challenger), then
the older 2026-01-04 (version 2: must not take `challenger`), then 2026-01-05 again with
another config (version 3: the newest candidate; `gate.min_delta: 1` keeps version 1
champion). The A/B test promotes version 3; repair puts tampered records back.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from mlflow import MlflowClient
from mlflow.entities import RunStatus

from conductor import cli
from recsys.ab import simulate as sim
from recsys.tracking import registry
from recsys.tracking.runs import default_tracking_uri
from serving_export.serving_config import read_version_labels, set_version_labels
from tests.conftest import SMALL, SMALL_DATE

pytestmark = pytest.mark.slow

OLDER = "2026-01-04"
MODEL = SMALL["model_name"]


@dataclass
class Cli:
    """What one `recsys` invocation returned and printed."""

    code: int
    out: str
    err: str


def run(*args: str) -> Cli:
    """`recsys ARGS` in this process (TensorFlow loads once for the module)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return Cli(code, out.getvalue(), err.getvalue())


def write_config(root: Path, name: str, **changes: Any) -> Path:
    """SMALL, fast (one epoch, no fresh-process verification); the gate keeps the champion."""
    raw = {
        **SMALL,
        "training": {**SMALL["training"], "epochs": changes.pop("epochs", 1)},
        "export": {**SMALL["export"], "verify": False},
        "gate": {"bootstrap_samples": 100, "min_delta": 1.0},
        # The log runs to SMALL_DATE: a night for an earlier date rejects the later rows.
        "preprocess": {"max_rejected_fraction": 0.5},
        **changes,
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def client_of(work: Path) -> MlflowClient:
    """A client on the working directory's own tracking store."""
    return MlflowClient(default_tracking_uri(work))


def aliases(work: Path) -> dict[str, str]:
    """alias -> registered version, read from the registry."""
    found = {}
    for alias in (registry.CHAMPION, registry.CHALLENGER):
        version = registry.alias_version(client_of(work), MODEL, alias)
        if version is not None:
            found[alias] = str(version.version)
    return found


def expected_labels(work: Path) -> dict[str, int]:
    """What models.config must say: each alias -> its version's export folder (run tag)."""
    client = client_of(work)
    labels = {}
    for alias, version in aliases(work).items():
        run_id = registry.model_version(client, MODEL, version).run_id
        labels[alias] = int(client.get_run(run_id).data.tags["model_version"])
    return labels


def assert_records_agree(work: Path) -> None:
    """The invariant: models.config and champion.json say what the aliases say."""
    assert read_version_labels(work / "export") == expected_labels(work)
    champion = aliases(work).get(registry.CHAMPION)
    record = json.loads((work / "champion.json").read_text())
    assert record["registered_version"] == champion
    assert record["export_version"] == str(expected_labels(work)["champion"])


@pytest.fixture(scope="module")
def nights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three nights on one working directory, with what the registry said after each."""
    root = tmp_path_factory.mktemp("registry")
    work = root / "work"
    first, second = write_config(root, "first"), write_config(root, "second", epochs=2)
    seen: dict[str, Any] = {"work": work, "configs": (first, second)}
    for key, config, date in (("newer", first, SMALL_DATE), ("older", first, OLDER),
                              ("again", second, SMALL_DATE)):  # fmt: skip
        result = run("nightly", "--config", str(config), "--workdir", str(work), "--date", date)
        assert result.code == 0, result.err[-3000:]
        seen[key] = {"cli": result, "aliases": aliases(work),
                     "labels": read_version_labels(work / "export")}  # fmt: skip
    return seen


def test_an_older_date_never_takes_challenger_from_a_newer_one(nights: dict[str, Any]) -> None:
    assert nights["newer"]["aliases"] == {"champion": "1", "challenger": "1"}
    older = nights["older"]
    assert older["aliases"]["challenger"] == "1", older["aliases"]
    assert older["labels"]["challenger"] == nights["newer"]["labels"]["challenger"]
    note = f"challenger stays version 1 (run date {SMALL_DATE}): this run's date {OLDER} is older"
    assert note in older["cli"].out
    (summary,) = (nights["work"] / "runs" / OLDER).glob("*/summary.md")
    assert note in summary.read_text()
    # The same date again, a newer registration: the newest candidate takes it.
    assert nights["again"]["aliases"] == {"champion": "1", "challenger": "3"}


def test_export_verify_false_is_honoured_and_said(nights: dict[str, Any]) -> None:
    for run_dir in (nights["work"] / "runs").glob("*/*"):
        if (run_dir / "export.json").is_file():
            assert json.loads((run_dir / "export.json").read_text())["verification"] == {}
            assert "NOT verified: export.verify is false" in (run_dir / "summary.md").read_text()


def test_an_ab_promotion_moves_serving_with_the_alias(
    nights: dict[str, Any], tmp_path: Path
) -> None:
    work, (first, _) = nights["work"], nights["configs"]
    common = ["--config", str(first), "--workdir", str(work)]
    before = aliases(work)
    assert before["champion"] != before["challenger"]
    users = tmp_path / "users.txt"
    users.write_text("\n".join(f"u{i}" for i in range(3000)) + "\n")
    assigned = run("ab", "assign", "--experiment", "feed", "--users", str(users), *common)
    assert assigned.code == 0, assigned.err[-3000:]
    events = tmp_path / "events.parquet"
    sim.event_log(np.random.default_rng(0), users=3000, days=10, lift=0.3,
                  experiment="feed").to_parquet(events)  # fmt: skip
    analyzed = run("ab", "analyze", "--experiment", "feed", "--events", str(events),
                   "--start", "2026-01-01", "--promote", *common)  # fmt: skip
    assert analyzed.code == 0, analyzed.err[-3000:]
    winner = before["challenger"]
    assert f"promoted: champion -> version {winner}" in analyzed.out
    assert aliases(work)["champion"] == winner
    assert_records_agree(work)  # models.config and champion.json moved with it
    # ... and every night keeps them there, even one with nothing left to do.
    set_version_labels(work / "export", {"champion": 1, "challenger": 1})
    again = run("nightly", *common, "--date", SMALL_DATE)
    assert again.code == 0 and "already done" in again.out, again.err[-3000:]
    assert_records_agree(work)


def test_repair_puts_every_record_back(nights: dict[str, Any]) -> None:
    work, (first, _) = nights["work"], nights["configs"]
    common = ["--config", str(first), "--workdir", str(work)]
    client = client_of(work)
    # Drift: stale labels, a lost champion.json, a run a killed process left RUNNING.
    set_version_labels(work / "export", {"champion": 2, "challenger": 2})
    (work / "champion.json").unlink()
    experiment = client.get_experiment_by_name(MODEL).experiment_id
    # How recsys tags the runs it creates: host and working directory, and the process.
    tags = {"recsys.owner": f"{socket.gethostname()}:{work.resolve()}", "recsys.pid": "999999999"}
    abandoned = client.create_run(experiment, tags=tags, run_name="killed").info.run_id

    check = run("repair", "--check", *common)
    assert check.code == 12, check.err[-3000:]
    assert "models.config labels" in check.out and "champion.json" in check.out
    assert abandoned in check.out
    assert client.get_run(abandoned).info.status == "RUNNING"  # --check changes nothing

    fixed = run("repair", *common)
    assert fixed.code == 0, fixed.err[-3000:]
    assert_records_agree(work)
    assert client.get_run(abandoned).info.status == RunStatus.to_string(RunStatus.KILLED)
    clean = run("repair", "--check", *common)
    assert clean.code == 0 and "all records agree" in clean.out


@pytest.fixture(scope="module")
def rerun(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A published date; `--rerun-from train` on a 0-byte shard; `--rerun-from preprocess`."""
    root = tmp_path_factory.mktemp("rerun")
    work, config = root / "work", write_config(root, "c")
    args = ["--config", str(config), "--workdir", str(work), "--date", SMALL_DATE]
    assert run("nightly", *args).code == 0
    for shard in (work / "data" / SMALL_DATE).glob("*.tfrecord.gz"):
        shard.write_bytes(b"")  # 0-byte shards, whichever records training reads
    broken = run("nightly", *args, "--rerun-from", "train")
    repaired = run("nightly", *args, "--rerun-from", "preprocess")
    return {"work": work, "broken": broken, "repaired": repaired}


def test_a_rerun_publishes_what_it_exports(rerun: dict[str, Any]) -> None:
    work = rerun["work"]
    assert rerun["broken"].code == 3, rerun["broken"].err[-3000:]
    assert rerun["repaired"].code == 0, rerun["repaired"].err[-3000:]
    runs = sorted(p for p in (work / "runs" / SMALL_DATE).iterdir() if not p.name.startswith("."))
    # No run folder is left holding nothing but its key.
    assert [p.name for p in runs if sorted(c.name for c in p.iterdir()) == ["nightly.json"]] == []
    newest = json.loads((runs[-1] / "export.json").read_text())["version"]
    assert newest == 2
    # The new export is a registered version of its own MLflow run, and serving routes to it.
    client = client_of(work)
    tagged = {
        client.get_run(v.run_id).data.tags["model_version"]: v
        for v in client.search_model_versions(f"name = '{MODEL}'")
    }
    assert sorted(tagged) == ["1", "2"]
    assert client.get_run(tagged["2"].run_id).data.tags["run_folder"] == runs[-1].name
    assert aliases(work)["challenger"] == str(tagged["2"].version)
    assert_records_agree(work)
