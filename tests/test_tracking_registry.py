"""Publishing a finished run against a real server: log -> register -> aliases -> gate; sync.

Run folders are built by hand (no training), so these tests take seconds; the gate with a real
champion evaluation is covered end to end in tests/test_gate_e2e.py.
"""

from __future__ import annotations

import datetime as dt
import json
import socket
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from mlflow import MlflowClient

from conductor import stages
from conductor.promotion import PENDING, publish_run
from recsys.core.config import RecsysConfig, TrackingConfig
from recsys.core.errors import TrackingError
from recsys.core.layout import Workdir, mark_complete, new_run_id
from recsys.core.records import (
    ExportRecord,
    MetricsRecord,
    SampleSize,
    StatsRecord,
    TrainRecord,
    write_record,
)
from recsys.core.resolve import resolve_config, write_settings
from recsys.tracking import registry
from tests.mlflow_server import MlflowServer, free_port, mlflow_server

DATE = dt.date(2026, 1, 5)


def configured(config: RecsysConfig, uri: str, model_name: str) -> RecsysConfig:
    """`config` logging to `uri` under its own model name (one registered model per test)."""
    tracking = TrackingConfig(uri=uri, retries=2, backoff_seconds=0.1)
    return config.model_copy(update={"tracking": tracking, "model_name": model_name})


def fake_run(
    workdir: Workdir,
    config: RecsysConfig,
    date: dt.date,
    per_user: dict[str, list[float]],
    *,
    fingerprint: str = "fp-1",
) -> Path:
    """A finished run folder as train/evaluate/export leave it (tiny files, no real model)."""
    data_dir = workdir.data(date)
    data_dir.mkdir(parents=True, exist_ok=True)
    stats = StatsRecord(
        run_date=date.isoformat(),
        fingerprint=fingerprint,
        input_lines=10,
        input_rows=10,
        accepted=10,
        rejected=0,
        duplicates=0,
        splits={"train": 6, "validation": 2, "test": 2},
        users=2,
        items=3,
    )
    write_record(data_dir / "stats.json", stats)
    run_dir = workdir.run(date, new_run_id(config.digest()))
    (run_dir / "model").mkdir(parents=True)
    # No model.json: not a loadable model, so a gate against it keeps the champion (with a
    # reason) without loading TensorFlow; real champion evaluation is tested end to end.
    (run_dir / "model" / "weights.bin").write_bytes(b"\x00weights")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    write_settings(run_dir / "resolved_config.yaml", resolve_config(config).records())
    train = TrainRecord(
        data_dir=str(data_dir),
        config_digest=config.digest(),
        data_fingerprint=fingerprint,
        examples_per_second=1234.5,
        steady_examples_per_second=1234.5,
        epoch_seconds=[2.0],
        seconds=2.0,
        strategy="one_device",
        replicas=1,
        precision="float32",
        best_epoch=None,
        refit_epochs=None,
        refit_seconds=0.0,
        refit_splits=[],
        dense_log_settings={},
        input="sequences",
        incremental_from=None,
        evaluated_model="model",
    )
    write_record(run_dir / "train.json", train)
    (run_dir / "history.json").write_text(json.dumps({"loss": [3.0, 2.0], "val_loss": [3.5, 2.5]}))
    summary = {k: float(np.mean(v)) for k, v in per_user.items() if k != "user_id"}
    report = MetricsRecord(
        protocol="leave-last-out",
        evaluated_model="model",
        model={**summary, "coverage_at_10": 0.5},
        baselines={"popularity": summary},
        intervals={},
        sample=SampleSize(users=len(per_user["user_id"]), of=len(per_user["user_id"])),
    )
    write_record(run_dir / "metrics.json", report)
    pq.write_table(pa.table(per_user), run_dir / "per_user_eval.parquet")
    version = len(list((workdir.root / "export" / "query").glob("*"))) + 1
    models = {}
    for name in ("query", "retrieval"):
        models[name] = workdir.export(name) / str(version)
        models[name].mkdir(parents=True)
        (models[name] / "saved_model.pb").write_bytes(f"{name}-{version}".encode())
    emb = workdir.embeddings(version)
    emb.mkdir(parents=True)
    pq.write_table(pa.table({"item_id": ["a", "b"]}), emb / "items.parquet")
    (emb / "manifest.json").write_text(json.dumps({"files": {"items": {"rows": 2}}}))
    exported = ExportRecord(
        version=version,
        models={k: str(v) for k, v in models.items()},
        embeddings={"items": str(emb / "items.parquet")},
        embeddings_manifest=str(emb / "manifest.json"),
        ann=None,
        serving={},
        verification={},
        seconds={},
    )
    write_record(run_dir / "export.json", exported)
    mark_complete(run_dir)
    return run_dir


PER_USER = {
    "user_id": ["u1", "u2", "u3", "u4"],
    "recall_at_10": [1.0, 0.0, 0.0, 1.0],
    "recall_at_50": [1.0, 1.0, 0.0, 1.0],
    "ndcg_at_10": [0.5, 0.0, 0.0, 1.0],
    "rank": [3, 20, -1, 0],
}


def test_first_run_is_logged_registered_and_champion(
    server: MlflowServer, small_config: RecsysConfig, tmp_path: Path
) -> None:
    config = configured(small_config, server.uri, "reg-first")
    workdir = Workdir(tmp_path)
    run_dir = fake_run(workdir, config, DATE, PER_USER)
    timings = {"train_seconds": 2.5}
    device = {"strategy": "mirrored", "replicas": "2", "precision": "mixed_bfloat16"}
    result = publish_run(config, workdir, DATE, run_dir, timings=timings, device=device)

    assert result.version == "1" and result.champion_version == "1"
    assert result.decision.promote and result.decision.first_model
    assert not (run_dir / PENDING).exists()
    client = MlflowClient(server.uri)
    run = client.get_run(result.mlflow_run_id)
    tags = run.data.tags
    assert tags["device.strategy"] == "mirrored" and tags["device.replicas"] == "2"
    assert tags["device.precision"] == "mixed_bfloat16"
    assert tags["run_date"] == "2026-01-05" and tags["data_fingerprint"] == "fp-1"
    assert len(tags["git_commit"]) == 40 or tags["git_commit"] == "unknown"
    assert tags["model_path"] == str((run_dir / "model").resolve())
    assert tags["gate.decision"] == "promote" and tags["registered_version"] == "1"
    metrics = run.data.metrics
    assert metrics["test_recall_at_50"] == 0.75 and metrics["train_seconds"] == 2.5
    assert metrics["train_examples_per_second"] == 1234.5 and metrics["gate_promoted"] == 1.0
    assert [m.value for m in client.get_metric_history(run.info.run_id, "val_loss")] == [3.5, 2.5]
    inputs = run.inputs.dataset_inputs
    assert len(inputs) == 1 and inputs[0].dataset.digest == "fp-1"
    assert str(workdir.data(DATE).resolve()) in inputs[0].dataset.source
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {
        "config.yaml", "stats.json", "metrics.json", "per_user_eval.parquet", "history.json",
        "export.json", "embeddings", "gate.json", "savedmodels", "trained_model",
    } <= top  # fmt: skip
    saved = {a.path for a in client.list_artifacts(run.info.run_id, "savedmodels")}
    assert saved == {"savedmodels/query", "savedmodels/retrieval"}
    logged = client.download_artifacts(run.info.run_id, "embeddings/manifest.json", str(run_dir))
    assert json.loads(Path(logged).read_text())["files"]["items"]["rows"] == 2

    version = client.get_model_version("reg-first", "1")
    assert version.run_id == run.info.run_id and version.source.endswith("/mlflow_model")
    model = client.get_registered_model("reg-first")
    assert model.aliases == {"champion": "1", "challenger": "1"}


def test_rerun_reuses_the_run_and_the_version(
    server: MlflowServer, small_config: RecsysConfig, tmp_path: Path
) -> None:
    config = configured(small_config, server.uri, "reg-rerun")
    workdir = Workdir(tmp_path)
    run_dir = fake_run(workdir, config, DATE, PER_USER)
    first = publish_run(config, workdir, DATE, run_dir)
    again = publish_run(config, workdir, DATE, run_dir)  # the same run folder published again
    assert again.mlflow_run_id == first.mlflow_run_id and again.version == first.version

    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("reg-rerun")
    assert experiment is not None
    assert len(client.search_runs([experiment.experiment_id])) == 1
    assert len(client.search_model_versions("name = 'reg-rerun'")) == 1
    assert len(client.get_metric_history(first.mlflow_run_id, "loss")) == 2

    # A different config (here: epochs) is a different run and a new version.
    other = configured(
        small_config.model_copy(
            update={"training": small_config.training.model_copy(update={"epochs": 3})}
        ),
        server.uri,
        "reg-rerun",
    )
    third = publish_run(other, workdir, DATE, fake_run(workdir, other, DATE, PER_USER))
    assert third.mlflow_run_id != first.mlflow_run_id and third.version == "2"
    assert not third.decision.promote and "could not" not in third.decision.reasons[0]
    assert "neither at its run folder nor in its run's artifacts" in third.decision.reasons[0]
    assert client.get_registered_model("reg-rerun").aliases == {"champion": "1", "challenger": "2"}
    assert len(client.search_runs([experiment.experiment_id])) == 2

    # The same config and data trained again into another run folder (`--rerun-from train`):
    # another export, so another run and version, never the first run's.
    retrained = publish_run(config, workdir, DATE, fake_run(workdir, config, DATE, PER_USER))
    assert retrained.mlflow_run_id not in (first.mlflow_run_id, third.mlflow_run_id)
    assert retrained.version == "3"
    tags = client.get_run(retrained.mlflow_run_id).data.tags
    assert tags["model_version"] == "3" and tags["run_folder"] != run_dir.name


def test_force_promote_overrides_a_kept_gate_and_is_recorded(
    server: MlflowServer, small_config: RecsysConfig, tmp_path: Path
) -> None:
    config = configured(small_config, server.uri, "reg-force")
    workdir = Workdir(tmp_path)
    publish_run(config, workdir, DATE, fake_run(workdir, config, DATE, PER_USER))
    later = dt.date(2026, 1, 6)
    run_dir = fake_run(workdir, config, later, PER_USER, fingerprint="fp-2")
    kept = publish_run(config, workdir, later, run_dir)
    assert not kept.decision.promote and kept.champion_version == "1"
    forced = publish_run(config, workdir, later, run_dir, force_promote=True)
    assert forced.mlflow_run_id == kept.mlflow_run_id and forced.version == kept.version == "2"
    assert forced.decision.promote and forced.decision.forced and forced.champion_version == "2"
    client = MlflowClient(server.uri)
    tags = client.get_run(forced.mlflow_run_id).data.tags
    assert tags["gate.forced"] == "true" and tags["gate.decision"] == "promote"
    assert "FORCED" in tags["gate.reasons"]
    gate = json.loads((run_dir / "gate.json").read_text())
    assert gate["forced"] is True and gate["champion_version"] == "1"


def test_a_recorded_promotion_completes_but_never_replaces_a_newer_champion(
    server: MlflowServer, small_config: RecsysConfig, tmp_path: Path
) -> None:
    """A rerun after a crash between recording "promote" and moving `champion` moves it; a
    rerun after another version became champion leaves that one serving."""
    config = configured(small_config, server.uri, "reg-recorded")
    workdir = Workdir(tmp_path)
    client = MlflowClient(server.uri)
    run_dir = fake_run(workdir, config, DATE, PER_USER)
    publish_run(config, workdir, DATE, run_dir)
    client.delete_registered_model_alias("reg-recorded", "champion")  # the crash's state
    again = publish_run(config, workdir, DATE, run_dir)
    assert again.decision.promote and again.champion_version == "1"

    days = [dt.date(2026, 1, 6), dt.date(2026, 1, 7)]
    runs = [fake_run(workdir, config, d, PER_USER, fingerprint=f"fp-{d.day}") for d in days]
    forced = publish_run(config, workdir, days[0], runs[0], force_promote=True)
    assert forced.champion_version == "2"
    newer = publish_run(config, workdir, days[1], runs[1], force_promote=True)
    assert newer.champion_version == "3"
    stale = publish_run(config, workdir, days[0], runs[0])  # version 2's decision, recorded
    assert stale.decision.promote and stale.champion_version == "3"
    assert client.get_registered_model("reg-recorded").aliases["champion"] == "3"


def test_publishing_over_a_champion_registered_before_mlflow_models_warns(
    server: MlflowServer,
    small_config: RecsysConfig,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A champion whose source is the old `savedmodels/` folder: MLflow cannot load it, so the
    publish says why (and what to do); the new version is an MLflow Model."""
    config = configured(small_config, server.uri, "reg-legacy")
    workdir = Workdir(tmp_path)
    first = publish_run(config, workdir, DATE, fake_run(workdir, config, DATE, PER_USER))
    client = MlflowClient(server.uri)
    artifacts = client.get_run(first.mlflow_run_id).info.artifact_uri
    legacy = client.create_model_version(
        "reg-legacy", f"{artifacts}/{registry.SAVEDMODELS}", run_id=first.mlflow_run_id
    )
    registry.set_alias(client, "reg-legacy", registry.CHAMPION, legacy.version)
    later = dt.date(2026, 1, 6)
    run_dir = fake_run(workdir, config, later, PER_USER, fingerprint="fp-2")
    with caplog.at_level("WARNING", logger="conductor.promotion"):
        result = publish_run(config, workdir, later, run_dir)
    assert f"version {legacy.version} of reg-legacy was registered before" in caplog.text
    assert "--force-promote" in caplog.text
    new = client.get_model_version("reg-legacy", result.version)
    assert registry.legacy_reason("reg-legacy", new) is None


def test_alias_moves(server: MlflowServer, small_config: RecsysConfig, tmp_path: Path) -> None:
    config = configured(small_config, server.uri, "reg-aliases")
    workdir = Workdir(tmp_path)
    client = MlflowClient(server.uri)
    assert registry.alias_version(client, "reg-aliases", registry.CHAMPION) is None
    runs = []
    for day in (5, 6):
        date = dt.date(2026, 1, day)
        run_dir = fake_run(workdir, config, date, PER_USER, fingerprint=f"fp-{day}")
        # Log only: the registry calls below are under test.
        from recsys.tracking.runs import log_nightly_run

        runs.append(
            log_nightly_run(
                config,
                workdir=tmp_path,
                run_date=date,
                stats={"fingerprint": f"fp-{day}"},
                history={},
                metrics={},
                artifacts=[(run_dir / "model", "savedmodels/query")],
            )
        )
    v1 = registry.register_run(client, "reg-aliases", runs[0])
    assert registry.register_run(client, "reg-aliases", runs[0]).version == v1.version  # no dup
    registry.set_alias(client, "reg-aliases", registry.CHAMPION, v1.version)
    v2 = registry.register_run(client, "reg-aliases", runs[1])
    registry.set_alias(client, "reg-aliases", registry.CHALLENGER, v2.version)
    aliases = client.get_registered_model("reg-aliases").aliases
    assert aliases == {"champion": v1.version, "challenger": v2.version}
    registry.set_alias(client, "reg-aliases", registry.CHAMPION, v2.version)  # promotion
    champion = registry.alias_version(client, "reg-aliases", registry.CHAMPION)
    assert champion is not None and champion.version == "2" and champion.run_id == runs[1]


@pytest.mark.timeout(180)
def test_server_down_then_sync(small_config: RecsysConfig, tmp_path: Path) -> None:
    """Unreachable server: clear error, outputs and a pending marker kept; sync logs them."""
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", port))  # bound, not listening: connections are refused
        config = configured(small_config, f"http://127.0.0.1:{port}", "reg-sync")
        workdir = Workdir(tmp_path / "work")
        run_dir = fake_run(workdir, config, DATE, PER_USER)
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        with pytest.raises(TrackingError) as caught:
            publish_run(config, workdir, DATE, run_dir, timings={"train_seconds": 1.0})
    message = str(caught.value)
    assert f"http://127.0.0.1:{port}" in message and "after 2 attempts" in message
    assert "recsys sync --date 2026-01-05" in message and "intact" in message
    marker = json.loads((run_dir / PENDING).read_text())
    assert marker["timings"] == {"train_seconds": 1.0} and "127.0.0.1" in marker["last_error"]
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert set(before) <= set(after)  # nothing removed
    assert (run_dir / "per_user_eval.parquet").is_file()

    with mlflow_server(tmp_path / "server", port=port) as running:
        results = stages.sync(small_config, workdir, DATE)
        assert len(results) == 1 and results[0].version == "1"
        assert not (run_dir / PENDING).exists()
        client = MlflowClient(running.uri)
        run = client.get_run(results[0].mlflow_run_id)
        assert run.data.metrics["train_seconds"] == 1.0  # the timings kept in the marker
        assert run.data.tags["device.strategy"] == "one_device"  # train.json has none
        assert run.data.tags["run_dir"] == str(run_dir.resolve())
        assert stages.sync(small_config, workdir, DATE) == []  # nothing left pending


def test_cli_sync_ab_and_incomplete_runs(
    small_config: RecsysConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The thin CLI layer, in-process, on the default local store (no server)."""
    from conductor import cli
    from recsys.core.errors import StageNotReadyError

    work = str(tmp_path / "w")
    assert cli.main(["sync", "--workdir", work, "--date", "2026-01-05"]) == 0
    assert "nothing to sync for 2026-01-05" in capsys.readouterr().out
    args = ["ab", "record", "--workdir", work, "--experiment", "home", "--variant", "B"]
    assert cli.main([*args, "--metric", "ctr", "--value", "0.04"]) == 0
    assert "recorded ctr=0.04 for variant B" in capsys.readouterr().out
    assert cli.main([*args, "--metric", "c#tr", "--value", "1"]) == 6  # TrackingError
    assert "not valid in MLflow" in capsys.readouterr().err

    run_dir = fake_run(Workdir(tmp_path), small_config, DATE, PER_USER)
    (run_dir / "export.json").unlink()
    with pytest.raises(StageNotReadyError, match="recsys export"):
        publish_run(small_config, Workdir(tmp_path), DATE, run_dir)


def test_default_local_store_publishes_and_compares(
    small_config: RecsysConfig, tmp_path: Path
) -> None:
    """No server: the SQLite store under the workdir (its registry returns int versions)."""
    from recsys.tracking.compare import compare

    workdir = Workdir(tmp_path)
    first = publish_run(
        small_config, workdir, DATE, fake_run(workdir, small_config, DATE, PER_USER)
    )
    assert (first.version, first.champion_version) == ("1", "1")
    result = compare(small_config, tmp_path, ["v1", "champion"], tmp_path / "cmp")
    assert [r.version for r in result.runs] == ["1", "1"]
    assert "<td>v1</td>" in result.files["html"].read_text()
    assert (tmp_path / "mlflow" / "mlflow.db").is_file()
