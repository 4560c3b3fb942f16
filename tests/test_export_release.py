"""The export stage end to end: staging, atomic publish, models.config, retention."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from conductor import stages
from recsys.core.config import ExportConfig, RecsysConfig
from recsys.core.layout import Workdir
from recsys.core.records import RecordError
from serving_export import savedmodels
from serving_export.manifest import load_embeddings
from serving_export.release import finish_release, prune_versions, versions
from serving_export.serving_config import (
    MODELS_CONFIG,
    read_version_labels,
    set_version_labels,
    write_models_config,
)
from serving_export.signatures import MODEL_NAMES
from tests.conftest import SMALL_DATE, plain_prepared, use_store
from tests.object_stores import ObjectStore

DATE = dt.date.fromisoformat(SMALL_DATE)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def prepared(prepared: tuple[RecsysConfig, Workdir, Path]) -> tuple[RecsysConfig, Workdir, Path]:
    """SMALL's data with the plain model (conftest.PLAIN_MODEL): these tests check the export
    and its publication, not the model."""
    return plain_prepared(prepared)


@pytest.fixture(scope="module")
def trained(prepared: tuple[RecsysConfig, Workdir, Path]) -> tuple[RecsysConfig, Workdir, Path]:
    """SMALL preprocessed and trained once for the module: (config, workdir, run_dir)."""
    config, workdir, data_dir = prepared
    run_dir, _ = stages.train(config, workdir, DATE, data_dir)
    return config, workdir, run_dir


@pytest.fixture(scope="module")
def exported(trained: tuple[RecsysConfig, Workdir, Path]) -> stages.ExportResult:
    config, workdir, run_dir = trained
    return stages.export(config, workdir, DATE, run_dir.name, verify=False)


def visible(workdir: Workdir) -> dict[str, list[int]]:
    """What TF Serving and index builders would see: integer version folders per base."""
    bases = {name: workdir.export(name) for name in MODEL_NAMES}
    bases["embeddings"] = workdir.root / "embeddings"
    return {name: versions(base) for name, base in bases.items()}


def staging_dirs(workdir: Workdir) -> list[Path]:
    return sorted((workdir.root / "export").glob(".staging-*"))


def test_export_releasees_models_embeddings_manifest_and_config(
    exported: stages.ExportResult, trained: tuple[RecsysConfig, Workdir, Path]
) -> None:
    import tensorflow as tf

    _, workdir, run_dir = trained
    version = exported.version
    assert {name: [version] for name in [*MODEL_NAMES, "embeddings"]} == visible(workdir)
    assert staging_dirs(workdir) == []
    items = load_embeddings(workdir.embeddings(version), "items")
    users = load_embeddings(workdir.embeddings(version), "users")
    manifest = items.manifest
    assert manifest["model_version"] == version and manifest["similarity"] == "dot"
    query_dir = workdir.export("query") / str(version)
    fingerprint = tf.saved_model.experimental.read_fingerprint(str(query_dir))
    assert manifest["models"]["query"]["saved_model_checksum"] == str(
        fingerprint.saved_model_checksum
    )
    assert manifest["ann"] is None  # brute force is the default
    # Extra columns: popularity is the training count the model's logQ used.
    features = pq.read_table(stages.run_data_dir(run_dir) / "item_features.parquet").to_pydict()
    counts = dict(zip(features["item_id"], features["train_count"], strict=True))
    assert items.columns["popularity"] == [counts[i] for i in items.ids]
    assert all(n > 0 for n in users.columns["interactions"])
    assert all(t is not None for t in users.columns["last_seen"] + items.columns["last_seen"])
    config_text = (workdir.root / "export" / MODELS_CONFIG).read_text()
    parsed = text_format.Parse(config_text, model_server_config_pb2.ModelServerConfig())
    assert sorted(c.name for c in parsed.model_config_list.config) == sorted(MODEL_NAMES)
    assert read_version_labels(workdir.root / "export") == {}
    assert Path(exported.models["retrieval"]) == workdir.export("retrieval") / str(version)


def test_users_parquet_uses_the_latest_histories(
    exported: stages.ExportResult, trained: tuple[RecsysConfig, Workdir, Path]
) -> None:
    from recsys.data_io import latest_histories
    from recsys.model import TrainedModel
    from serving_export.activity import read_activity

    _, workdir, run_dir = trained
    model = TrainedModel.load(run_dir / "model")
    data_dir = stages.run_data_dir(run_dir)
    length = model.config.history_length
    activity = read_activity(data_dir, model.users, model.items, length)
    assert activity.histories == latest_histories(data_dir, model.users, length)
    users = load_embeddings(workdir.embeddings(exported.version), "users")
    expected = model.user_embeddings(model.users, activity.histories)
    np.testing.assert_allclose(users.vectors, expected, atol=1e-6)


@pytest.mark.parametrize("sample", [0, 50])
def test_streamed_test_split_evaluates_as_the_whole_split(
    trained: tuple[RecsysConfig, Workdir, Path], sample: int
) -> None:
    """evaluate_model streams the test split (the sample only, or vectors per batch): the
    metrics equal the former whole-split-in-memory computation's."""
    import itertools

    from recsys import evaluation as ev
    from recsys.core import schema
    from recsys.data_io import iter_split, load_split
    from recsys.model import TrainedModel
    from recsys.model_evaluation import evaluate_model

    config, _, run_dir = trained
    evaluation = config.evaluation.model_copy(update={"sample_users": sample})
    config = config.model_copy(update={"evaluation": evaluation})
    data_dir = stages.run_data_dir(run_dir)
    model = TrainedModel.load(run_dir / "model")
    test = ev.sample_rows(load_split(data_dir, "test"), sample, config.evaluation.sample_seed)
    ids = (schema.USER_ID, schema.ITEM_ID)
    known = itertools.chain(*(iter_split(data_dir, s, ids) for s in ("train", "validation")))
    eval_set = ev.build_eval_set(model.items, test, known)
    vectors = model.user_embeddings(eval_set.users, list(test[schema.HISTORY]))
    expected = ev.evaluate(
        ev.dot_product_scores(vectors, model.item_embeddings()), eval_set, config.evaluation
    )
    got_set, got = evaluate_model(config, run_dir / "model", data_dir)
    assert got_set.users == eval_set.users
    assert got.metrics == expected.metrics
    assert (got_set.population is not None) == bool(sample)


def test_exception_after_the_first_model_is_staged_publishes_nothing(
    exported: stages.ExportResult,
    trained: tuple[RecsysConfig, Workdir, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config, workdir, run_dir = trained
    before = visible(workdir)
    config_before = (workdir.root / "export" / MODELS_CONFIG).read_text()
    real_publish = savedmodels._publish
    staged: list[Path] = []

    def publish_once_then_fail(module: object, target: Path, extra: object) -> Path:
        if staged:
            raise OSError("disk full")  # the second model fails after the first was staged
        staged.append(real_publish(module, target, extra))
        return staged[-1]

    monkeypatch.setattr(savedmodels, "_publish", publish_once_then_fail)
    with pytest.raises(OSError, match="disk full"):
        stages.export(config, workdir, DATE, run_dir.name, verify=False)
    assert len(staged) == 1 and not staged[0].exists()  # staged, then removed with the staging
    assert visible(workdir) == before
    assert staging_dirs(workdir) == []
    assert (workdir.root / "export" / MODELS_CONFIG).read_text() == config_before


def test_a_killed_export_leaves_no_visible_version(
    exported: stages.ExportResult, trained: tuple[RecsysConfig, Workdir, Path], tmp_path: Path
) -> None:
    """SIGKILL (an OOM kill) after all three SavedModels are staged, before any rename."""
    config, workdir, run_dir = trained
    before = visible(workdir)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    child = textwrap.dedent(f"""
        import os, signal
        import recsys
        from pathlib import Path
        from conductor import stages
        from recsys.core.config import load_config
        from recsys.core.layout import Workdir

        def killed(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        stages.stage_embeddings = killed  # stages imports it by name
        stages.export(load_config({str(tmp_path / "config.yaml")!r}),
                      Workdir(Path({str(workdir.root)!r})),
                      __import__("datetime").date.fromisoformat({SMALL_DATE!r}),
                      {run_dir.name!r}, verify=False)
    """)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", child], cwd=REPO, env=env, capture_output=True, timeout=600
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert visible(workdir) == before
    leftovers = staging_dirs(workdir)
    assert len(leftovers) == 1 and not leftovers[0].name.isdigit()  # TF Serving ignores it
    assert versions(leftovers[0] / "query") == [exported.version]  # it died after staging
    shutil.rmtree(leftovers[0])  # what recsys.core.layout.clean_temporaries does under the lock


def committed_versions(uri: str) -> dict[str, list[int]]:
    """What a reader of a bucket workdir sees: the committed versions of each model base."""
    from recsys.core import storage

    seen = {}
    for base in [*(f"export/{name}" for name in MODEL_NAMES), "embeddings"]:
        names = {n.split("/")[0] for n in storage.list_files(f"{uri}/{base}")}
        seen[base] = sorted(
            int(n) for n in names if n.isdigit() and storage.committed(f"{uri}/{base}/{n}")
        )
    return seen


@pytest.mark.slow
def test_a_killed_upload_to_a_bucket_leaves_no_committed_version(
    exported: stages.ExportResult,
    trained: tuple[RecsysConfig, Workdir, Path],
    tmp_path: Path,
    s3_store: ObjectStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same workdir in an S3 bucket: `recsys export` killed after its first upload."""
    from recsys.core import mirror, storage

    config, workdir, run_dir = trained
    use_store(s3_store, monkeypatch)
    uri = f"{s3_store.new_bucket()}/work"
    copy = tmp_path / "copy"
    shutil.copytree(workdir.root, copy, ignore=shutil.ignore_patterns(".recsys.lock"))
    # Unreserved, the run's next export is a new version (the reservation is per run).
    (copy / run_dir.relative_to(workdir.root) / "export_version.json").unlink()
    mirror.Mirror(uri, copy).push()
    before = committed_versions(uri)
    assert exported.version in before["export/query"]
    raw = {
        **config.model_dump(mode="json"),
        "export": {**config.export.model_dump(), "verify": False},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    command = [sys.executable, "-m", "conductor.cli", "export", "--config",
               str(tmp_path / "config.yaml"), "--workdir", uri, "--date", SMALL_DATE,
               "--run-id", run_dir.name]  # fmt: skip
    env = {**os.environ, **s3_store.env, "RECSYS_CACHE_DIR": str(tmp_path / "cache")}
    fault = {"RECSYS_FAULT": "storage:uploaded:embeddings:kill"}
    killed = subprocess.run(
        command, cwd=REPO, capture_output=True, timeout=600, env={**env, **fault}
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    new = max(before["export/query"]) + 1
    assert storage.list_files(f"{uri}/embeddings/{new}")  # uploaded in part ...
    assert committed_versions(uri) == before  # ... and taken by no reader
    done = subprocess.run(command, cwd=REPO, capture_output=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert all(v == [*before[base], new] for base, v in committed_versions(uri).items())


def test_prune_keeps_the_newest_and_never_a_protected_version(tmp_path: Path) -> None:
    for version in range(1, 8):
        (tmp_path / str(version)).mkdir()
    (tmp_path / ".staging-9-abc").mkdir()
    assert prune_versions(tmp_path, keep=2, protect=[2]) == [1, 3, 4, 5]
    assert versions(tmp_path) == [2, 6, 7]
    assert (tmp_path / ".staging-9-abc").is_dir()  # not a version: not ours to prune
    assert sorted(p.name for p in tmp_path.iterdir()) == [".staging-9-abc", "2", "6", "7"]
    assert prune_versions(tmp_path, keep=5) == []
    assert prune_versions(tmp_path / "missing", keep=1) == []
    with pytest.raises(ValueError):
        prune_versions(tmp_path, keep=0)


def test_finish_publish_protects_the_labelled_versions(tmp_path: Path) -> None:
    export_root, emb_root = tmp_path / "export", tmp_path / "embeddings"
    for version in range(1, 6):
        for base in [*(export_root / n for n in MODEL_NAMES), emb_root]:
            (base / str(version)).mkdir(parents=True)
    write_models_config(export_root, MODEL_NAMES, {"champion": 1, "challenger": 4})
    result = finish_release(export_root, emb_root, MODEL_NAMES, 5, ExportConfig(keep_versions=1))
    assert result["labels"] == {"champion": 1, "challenger": 4}
    assert all(v == [2, 3] for v in result["pruned"].values())
    assert versions(export_root / "query") == [1, 4, 5] and versions(emb_root) == [1, 4, 5]


def test_models_config_is_a_tf_serving_model_config_list(tmp_path: Path) -> None:
    for name in MODEL_NAMES:
        for version in (3, 4):
            (tmp_path / name / str(version)).mkdir(parents=True)
    path = write_models_config(
        tmp_path, MODEL_NAMES, {"champion": 3, "challenger": 4, "stale": 1}, base_path="/models/"
    )
    parsed = text_format.Parse(path.read_text(), model_server_config_pb2.ModelServerConfig())
    configs = {c.name: c for c in parsed.model_config_list.config}
    assert sorted(configs) == sorted(MODEL_NAMES)
    retrieval = configs["retrieval"]
    assert retrieval.base_path == "/models/retrieval" and retrieval.model_platform == "tensorflow"
    # A label may only name a loaded version: exactly the labelled ones are served.
    assert list(retrieval.model_version_policy.specific.versions) == [3, 4]
    assert dict(retrieval.version_labels) == {"champion": 3, "challenger": 4}  # 1: not on disk
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == [MODELS_CONFIG]
    # No labels yet: TF Serving's default policy (latest version), local absolute base paths.
    set_version_labels(tmp_path, {})
    parsed = text_format.Parse(path.read_text(), model_server_config_pb2.ModelServerConfig())
    query = {c.name: c for c in parsed.model_config_list.config}["query"]
    assert query.base_path == str(tmp_path / "query") and not query.HasField("model_version_policy")
    assert set_version_labels(tmp_path / "nothing-here", {"champion": 1}) is None


def test_serving_follows_the_registry_aliases(tmp_path: Path) -> None:
    """recsys.serving_state: registry alias -> run tag model_version -> label, champion.json."""
    from mlflow import MlflowClient

    from recsys.serving_state import champion_record, sync_serving
    from recsys.tracking import registry
    from recsys.tracking.runs import ensure_local_store

    workdir = Workdir(tmp_path)
    for name in MODEL_NAMES:
        for version in (1, 2):
            (tmp_path / "export" / name / str(version)).mkdir(parents=True)
    client = MlflowClient(f"sqlite:///{ensure_local_store(tmp_path)}")
    experiment = client.create_experiment("m")
    for export in ("1", "2"):
        run = client.create_run(experiment, tags={"model_version": export, "run_date": "x"})
        registry.register_run(client, "m", run.info.run_id)
    registry.set_alias(client, "m", registry.CHAMPION, 1)
    registry.set_alias(client, "m", registry.CHALLENGER, 2)
    sync_serving(client, "m", workdir, None)
    assert read_version_labels(tmp_path / "export") == {"champion": 1, "challenger": 2}
    first = champion_record(workdir)
    assert first is not None and first.registered_version == "1"
    # champion.json as an earlier release wrote it (no record kind) reads as the same record,
    # and the next sync rewrites it in today's shape.
    legacy = first.model_dump(exclude={"record", "format_version"})
    workdir.champion_file().write_text(json.dumps(legacy))
    assert champion_record(workdir) == first
    sync_serving(client, "m", workdir, None)
    assert json.loads(workdir.champion_file().read_text())["record"] == "champion"
    registry.set_alias(client, "m", registry.CHAMPION, 2)  # the challenger was promoted
    state = sync_serving(client, "m", workdir, None)
    assert read_version_labels(tmp_path / "export") == {"champion": 2, "challenger": 2}
    second = champion_record(workdir)
    assert second is not None and second.export_version == "2" and state.problems == []
    # A damaged file is a record error naming the file and the field, not a KeyError later.
    workdir.champion_file().write_text(json.dumps({**legacy, "registered_version": None}))
    with pytest.raises(RecordError, match=r"champion\.json: field 'registered_version'"):
        champion_record(workdir)
    sync_serving(client, "m", workdir, None)  # a derived cache: the sync writes it again
    assert champion_record(workdir) == second
