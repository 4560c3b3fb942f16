"""End to end: the real `recsys` CLI in fresh processes, every output checked independently."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from recsys.core import schema
from tests.conftest import SMALL, SMALL_DATE

pytestmark = pytest.mark.slow


def recsys(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a fresh process; fail with its output if it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "conductor.cli", *args], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"recsys {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def nightly(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One `recsys nightly` on SMALL's synthetic data; returns (workdir, stdout)."""
    root = tmp_path_factory.mktemp("nightly")
    config = root / "small.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    proc = recsys(
        "nightly", "--config", str(config), "--workdir", str(root / "work"), "--date", SMALL_DATE
    )
    return root / "work", proc.stdout


def _single(folder: Path) -> Path:
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1, entries
    return entries[0]


def test_tfrecords_parse_with_the_schema_and_counts_reconcile(nightly: tuple[Path, str]) -> None:
    import tensorflow as tf

    work, _ = nightly
    data = work / "data" / SMALL_DATE
    assert (data / "_SUCCESS").is_file()
    stats = json.loads((data / "stats.json").read_text())
    raw = _single(work / "raw")
    input_rows = len(raw.read_text().splitlines()) - 1  # header
    assert stats["input_rows"] == input_rows
    counted = 0
    for split in schema.SPLITS:
        files = sorted(str(p) for p in data.glob(f"{split}-*.tfrecord.gz"))
        ds = tf.data.TFRecordDataset(files, "GZIP").batch(4096)
        n = 0
        for batch in ds.map(lambda b: tf.io.parse_example(b, schema.feature_spec())):
            n += int(batch[schema.USER_ID].shape[0])
            assert set(batch) == set(schema.FEATURE_NAMES)
        assert n == stats["splits"][split]
        counted += n
    assert counted + stats["rejected"] == input_rows


def test_cli_prints_outputs_and_metrics(nightly: tuple[Path, str]) -> None:
    work, out = nightly
    for expected in (
        "data:",
        "run:",
        "savedmodel:",
        "embeddings:",
        "mlflow run:",
        "recall_at_50",
        "popularity",
    ):
        assert expected in out, out
    assert str(work) in out


def test_metrics_and_per_user_values(nightly: tuple[Path, str]) -> None:
    work, _ = nightly
    run = _single(work / "runs" / SMALL_DATE)
    report = json.loads((run / "metrics.json").read_text())
    stats = json.loads((work / "data" / SMALL_DATE / "stats.json").read_text())
    assert report["model"]["eval_users"] == stats["splits"]["test"]
    assert pq.read_table(run / "per_user_eval.parquet").num_rows == stats["splits"]["test"]


def test_mlflow_run_has_params_metrics_and_artifacts(nightly: tuple[Path, str]) -> None:
    from mlflow import MlflowClient

    work, _ = nightly
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(SMALL["model_name"])
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.data.tags["run_date"] == SMALL_DATE
    assert run.data.tags["data_fingerprint"]
    assert run.data.params["training.epochs"] == str(SMALL["training"]["epochs"])
    # Params are the values trained with; `written.*` keeps what an `auto` replaced.
    assert run.data.params["model.negatives"] == "full"
    assert run.data.params["written.model.negatives"] == "auto"
    assert run.data.params["training.precision"] == "float32"
    for name in (
        "test_recall_at_10",
        "test_recall_at_50",
        "test_ndcg_at_10",
        "popularity_recall_at_10",
    ):
        assert name in run.data.metrics
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert len(loss) == SMALL["training"]["epochs"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "resolved_config.yaml", "stats.json", "metrics.json"} <= artifacts


def test_run_folder_records_the_settings_it_trained_with(nightly: tuple[Path, str]) -> None:
    """config.yaml is the config as given; resolved_config.yaml says what ran, and why."""
    work, _ = nightly
    run = _single(work / "runs" / SMALL_DATE)
    stats = json.loads((work / "data" / SMALL_DATE / "stats.json").read_text())
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["negatives"] == "auto"
    settings = yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert settings["model.negatives"] == {
        "value": "full",
        "source": "auto",
        "written": "auto",
        "why": f"full: {stats['items']} items <= 50000",
    }
    assert settings["model.embedding_dim"] == {"value": 16, "source": "file"}
    assert settings["model.query_encoder"] == {"value": "transformer", "source": "default"}
    assert settings["training.strategy"]["value"] == "one_device"


def test_embeddings_parquet_shapes_and_ids(nightly: tuple[Path, str]) -> None:
    work, _ = nightly
    data = work / "data" / SMALL_DATE
    version_dir = _single(work / "embeddings")
    dim = SMALL["model"]["embedding_dim"]
    for name, key in (("items", "item_id"), ("users", "user_id")):
        table = pq.read_table(version_dir / f"{name}.parquet")
        vocab = (data / "vocab" / f"{name}.txt").read_text().splitlines()
        assert table[key].to_pylist() == vocab
        assert table.schema.field("embedding").type == pa.list_(pa.float32(), dim)
        vectors = np.stack(table["embedding"].to_numpy(zero_copy_only=False))
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-4)
        assert set(table["model_version"].to_pylist()) == {int(version_dir.name)}


def test_savedmodels_reload_in_a_fresh_process(nightly: tuple[Path, str], tmp_path: Path) -> None:
    """Only TensorFlow in the child; its outputs must match the exported embeddings."""
    work, _ = nightly
    version_dir = _single(work / "embeddings")
    users = pq.read_table(version_dir / "users.parquet")
    items = pq.read_table(version_dir / "items.parquet")
    ids = users["user_id"].to_pylist()[:20]
    expected_users = np.stack(users["embedding"].to_numpy(zero_copy_only=False)[:20])
    item_vectors = np.stack(items["embedding"].to_numpy(zero_copy_only=False))
    # users.parquet holds each user's vector with their latest items: send the same history
    # ("" pads the rows, as a TF Serving client would).
    from recsys.core.config import ModelConfig
    from recsys.data_io import latest_histories

    length = ModelConfig.model_validate(SMALL["model"]).history_length
    hist = latest_histories(work / "data" / SMALL_DATE, ids, length)
    width = max(len(h) for h in hist)
    hist = [h + [""] * (width - len(h)) for h in hist]
    child = textwrap.dedent(f"""
        import json, sys
        import tensorflow as tf
        ids = tf.constant({ids!r})
        hist = tf.constant({hist!r}, tf.string, shape=[{len(ids)}, {width}])
        q = tf.saved_model.load({str(work / "export" / "query" / version_dir.name)!r})
        r = tf.saved_model.load({str(work / "export" / "retrieval" / version_dir.name)!r})
        emb = q.signatures["serving_default"](user_id=ids, history=hist)["embedding"].numpy()
        k = tf.fill(tf.shape(ids), {SMALL["export"]["top_k"]})
        top = r.signatures["serving_default"](user_id=ids, history=hist, k=k)
        json.dump({{"embedding": emb.tolist(), "scores": top["scores"].numpy().tolist(),
                   "item_ids": [[x.decode() for x in row] for row in top["item_ids"].numpy()]}},
                  sys.stdout)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=300,
        env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    np.testing.assert_allclose(np.array(out["embedding"]), expected_users, atol=1e-5)
    expected_scores = np.sort(expected_users @ item_vectors.T, axis=1)[:, ::-1]
    k = len(out["scores"][0])
    assert k == min(SMALL["export"]["top_k"], len(item_vectors))
    np.testing.assert_allclose(np.array(out["scores"]), expected_scores[:, :k], atol=1e-5)
    best = items["item_id"].to_pylist()
    for row, user_vec in zip(out["item_ids"], expected_users, strict=True):
        assert row[0] == best[int(np.argmax(item_vectors @ user_vec))]


def test_stages_run_one_by_one(tmp_path: Path) -> None:
    """preprocess, train, evaluate, export as separate commands on each other's outputs."""
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    common = ["--config", str(config), "--workdir", str(tmp_path / "w"), "--date", SMALL_DATE]
    out = tmp_path / "prepared"
    recsys("preprocess", *common, "--output", str(out))
    assert (out / "_SUCCESS").is_file()
    recsys("preprocess", *common)
    recsys("train", *common)
    evaluated = recsys("evaluate", *common)
    assert "recall_at_10" in evaluated.stdout
    exported = recsys("export", *common, "--verify")
    assert "verified" in exported.stdout
    assert (tmp_path / "w" / "export" / "retrieval" / "1" / "saved_model.pb").is_file()


def test_a_nightly_checks_what_tf_serving_loads(nightly: tuple[Path, str], tmp_path: Path) -> None:
    # The case: a champion file deleted after publishing; the next nightly (here:
    # already done) used to say nothing and exit 0.
    import shutil

    work = tmp_path / "work"
    shutil.copytree(nightly[0], work, symlinks=True)
    (work / "export" / "query" / "1" / "saved_model.pb").unlink()
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    args = ["nightly", "--config", str(config), "--workdir", str(work), "--date", SMALL_DATE]
    proc = subprocess.run(
        [sys.executable, "-m", "conductor.cli", *args], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 11, proc.stderr[-3000:]
    assert re.search(r"query/1 \([a-z, ]*champion[a-z, ]*\): saved_model.pb missing", proc.stderr)
    assert "Traceback" not in proc.stderr
    fix = proc.stderr.split("`recsys export ")[1].split("`")[0].split()
    recsys("export", "--config", str(config), *fix)  # the named command repairs it
    assert "already done" in recsys(*args).stdout
