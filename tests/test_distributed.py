"""Device layouts: MirroredStrategy over 2 logical CPUs, MultiWorkerMirroredStrategy on 127.0.0.1.

Logical devices must be configured before TensorFlow initialises, and a multi-worker cluster
needs one process per worker, so every check runs in fresh Python processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# One global batch through one replica and through two replicas (first half / second half):
# with global-batch negatives the summed loss and the weights after one SGD step must agree.
MIRRORED_CHILD = textwrap.dedent(
    """
    import json, sys
    import recsys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    from recsys.core.config import ModelConfig
    from recsys.model import (
        HISTORY_INDEX, ITEM_INDEX, ITEM_LOG_PROB, USER_INDEX, TrainedModel, TwoTowerModel,
    )
    from recsys.training.trainer import make_strategy

    config = ModelConfig(embedding_dim=8, hidden_dims=[8], history_length=4, oov_buckets=1)
    users, items = [f"u{i}" for i in range(20)], [f"i{i}" for i in range(30)]
    rng = np.random.default_rng(0)
    batch = {
        USER_INDEX: rng.integers(1, 21, 16),
        ITEM_INDEX: rng.integers(1, 31, 16),  # repeats: accidental hits across replicas too
        HISTORY_INDEX: np.where(rng.random((16, 4)) < 0.6, rng.integers(1, 31, (16, 4)), -1),
        ITEM_LOG_PROB: np.log(rng.dirichlet(np.ones(16))).astype(np.float32),
    }

    def run(strategy):
        with strategy.scope():
            tf.keras.utils.set_random_seed(3)
            trained = TrainedModel.build(users, items, config)
            model = TwoTowerModel(trained.query_tower, trained.candidate_tower, config)
            model.compile(optimizer=tf.keras.optimizers.SGD(0.1))
        ds = tf.data.Dataset.from_tensors(batch)
        dist = strategy.experimental_distribute_dataset(ds)
        per_replica = strategy.run(model.compute_loss, args=(next(iter(dist)),))
        loss = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        model.fit(ds, epochs=1, verbose=0)
        towers = (trained.query_tower, trained.candidate_tower)
        weights = [w for t in towers for w in t.get_weights()]
        return strategy.num_replicas_in_sync, float(loss), weights

    n1, loss1, w1 = run(make_strategy("one_device", []))
    n2, loss2, w2 = run(make_strategy("mirrored", []))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(w1, w2))
    print(json.dumps({"replicas": [n1, n2], "loss": [loss1, loss2], "weight_diff": diff}))
    """
)


def _child_env() -> dict[str, str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TF_CONFIG", None)
    return env


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_two_replicas_match_one_replica_on_the_same_global_batch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", MIRRORED_CHILD],
        capture_output=True,
        text=True,
        timeout=300,
        env=_child_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _last_json(proc.stdout)
    assert out["replicas"] == [1, 2]
    # Per-replica negatives would score each query against 8 candidates instead of 16.
    assert out["loss"][1] == pytest.approx(out["loss"][0], rel=1e-5)
    assert out["weight_diff"] < 1e-5


WORKER_CHILD = textwrap.dedent(
    """
    import datetime as dt, json, sys
    import recsys
    from pathlib import Path
    from conductor import stages
    from recsys.core.config import RecsysConfig
    from recsys.core.layout import Workdir

    config = RecsysConfig.model_validate_json(Path(sys.argv[1]).read_text())
    date = dt.date.fromisoformat(sys.argv[3])
    run_dir, result = stages.train(config, Workdir(Path(sys.argv[2])), date)
    print(json.dumps({"replicas": result.replicas, "strategy": result.strategy,
                      "loss": result.history["loss"], "run_dir": run_dir and str(run_dir)}))
    """
)


def _free_ports(n: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.slow
def test_multi_worker_mirrored_on_two_local_processes(tmp_path: Path) -> None:
    """strategy auto + a 2-worker TF_CONFIG -> MultiWorkerMirroredStrategy, one shared model."""
    import datetime as dt

    from conductor import stages
    from recsys.core.config import parse_config
    from recsys.core.layout import Workdir
    from tests.conftest import SMALL, SMALL_DATE

    config = parse_config(SMALL)
    work = Workdir(tmp_path / "work")
    stages.preprocess(config, work, dt.date.fromisoformat(SMALL_DATE))
    raw = config.model_dump(mode="json")
    raw["training"].update({"epochs": 1, "batch_size": 256, "strategy": "auto"})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(2)]}
    args = [str(work.root), SMALL_DATE]
    workers = []
    for index in range(2):
        env = _child_env()
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        workers.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER_CHILD, str(tmp_path / "config.json"), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outputs = []
    try:
        for proc in workers:
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-3000:]
            outputs.append(_last_json(stdout))
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [o["strategy"] for o in outputs] == ["multi_worker"] * 2
    assert [o["replicas"] for o in outputs] == [2, 2]
    # Both workers hold the same synchronously trained model: the same mean loss.
    assert outputs[0]["loss"] == pytest.approx(outputs[1]["loss"], rel=1e-4)
    # Only the chief (worker 0: the cluster names no chief) wrote a run folder.
    assert outputs[1]["run_dir"] is None
    runs = list(work.runs(dt.date.fromisoformat(SMALL_DATE)).iterdir())
    assert [str(p) for p in runs] == [outputs[0]["run_dir"]]
    assert (runs[0] / "_SUCCESS").is_file() and (runs[0] / "model" / "model.json").is_file()


TRAINER_MIRRORED_CHILD = textwrap.dedent(
    """
    import json, sys
    import recsys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    from pathlib import Path
    from recsys.core.config import RecsysConfig
    from recsys.training.trainer import train

    config = RecsysConfig.model_validate_json(Path(sys.argv[1]).read_text())
    result = train(config, Path(sys.argv[2]))
    vectors = result.model.user_embeddings(result.model.users[:2], [[], []])
    print(json.dumps({"replicas": result.replicas, "strategy": result.strategy,
                      "history": result.history, "dtype": str(vectors.dtype)}))
    """
)


@pytest.mark.slow
def test_trainer_mirrored_on_two_logical_cpus(tmp_path: Path) -> None:
    """The whole trainer (tf.data, validation recall, bfloat16) under MirroredStrategy."""
    import datetime as dt

    from conductor import stages
    from recsys.core.config import parse_config
    from recsys.core.layout import Workdir
    from tests.conftest import SMALL, SMALL_DATE

    config = parse_config(SMALL)
    data_dir, _ = stages.preprocess(
        config, Workdir(tmp_path / "work"), dt.date.fromisoformat(SMALL_DATE)
    )
    raw = config.model_dump(mode="json")
    raw["training"].update(
        {"epochs": 2, "strategy": "mirrored", "precision": "mixed_bfloat16", "batch_size": 128}
    )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            TRAINER_MIRRORED_CHILD,
            str(tmp_path / "config.json"),
            str(data_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_child_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _last_json(proc.stdout)
    assert (out["strategy"], out["replicas"], out["dtype"]) == ("mirrored", 2, "float32")
    history = out["history"]
    assert len(history["loss"]) == 2 and all(v == v for v in history["loss"])  # not NaN
    assert history["loss"][1] < history["loss"][0]
    assert len(history["val_recall_at_50"]) == 2
