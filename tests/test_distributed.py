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

    config = ModelConfig(
        embedding_dim=8, hidden_dims=[8], history_length=4, oov_buckets=1,
        query_encoder="mean", negatives="in_batch", user_embedding=True,
    )
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


def _free_ports(n: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


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
    from tests.conftest import SMALL, SMALL_DATE, plain

    config = parse_config(plain(SMALL))  # the device layout is at stake, not the model
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


TRAIN_CHILD = textwrap.dedent(
    """
    import datetime as dt, json, sys
    import recsys
    from pathlib import Path
    from conductor import stages
    from recsys.core.config import RecsysConfig
    from recsys.core.layout import Workdir

    config = RecsysConfig.model_validate_json(Path(sys.argv[1]).read_text())
    work, data_dir = Workdir(Path(sys.argv[2])), Path(sys.argv[3])
    # The CLI's path (checkpoints included); a worker or ps task serves here, never returns.
    run_dir, result = stages.train(config, work, dt.date(2026, 1, 5), data_dir=data_dir)
    towers = (result.model.query_tower, result.model.candidate_tower)
    parts = sorted({v.device for t in towers for v in t.variables if "/part_" in v.name})
    print(json.dumps({"strategy": result.strategy, "replicas": result.replicas,
                      "history": result.history, "run_dir": run_dir and str(run_dir),
                      "shard_devices": parts}))
    """
)


def _cluster(
    roles: dict[str, int], config: Path, workdir: Path, data_dir: Path
) -> dict[tuple[str, int], subprocess.Popen]:
    """One process per task of a TF_CONFIG cluster on 127.0.0.1, all running TRAIN_CHILD."""
    ports = iter(_free_ports(sum(roles.values())))
    cluster = {job: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for job, n in roles.items()}
    procs = {}
    for job, n in roles.items():
        for index in range(n):
            env = _child_env()
            task = {"type": job, "index": index}
            env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})
            procs[(job, index)] = subprocess.Popen(
                [sys.executable, "-c", TRAIN_CHILD, str(config), str(workdir), str(data_dir)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
    return procs


def _stop(procs: dict[tuple[str, int], subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_parameter_servers_train_the_model_multi_worker_mirrored_trains(
    tmp_path: Path, prepared: tuple
) -> None:
    """chief + 2 workers + 2 PS (tables sharded) vs 2 MultiWorkerMirrored workers, same model,
    both through stages.train (the CLI's path: checkpoints, the chief's run folder).

    Both reach the same exact validation recall@10 within seed noise (101 validation users;
    one device, 4 epochs, seeds 1-3: .436-.455, 5 epochs: .426-.505; popularity .277), and
    the sharded model reloads on one device with the same recall. 6 epochs: the asynchronous
    mode lagged by up to .07 after 4 (four runs).
    """
    import pyarrow.parquet as pq

    from recsys import evaluation as ev
    from recsys.core.config import parse_config
    from recsys.model import TrainedModel
    from recsys.training.trainer import validation_callback
    from tests.conftest import SMALL, plain

    # The plain model: the recall bounds below were measured on it (the layouts are at stake).
    _, _, data_dir = prepared
    config = parse_config(plain(SMALL))
    raw = config.model_dump(mode="json")
    raw["training"].update(
        {"epochs": 6, "batch_size": 128, "early_stopping_metric": "recall_at_10"}
    )
    layouts = {
        # 1 KiB: SMALL's 16-dim user (2.4 KiB) and item (1.3 KiB) tables split over both PS.
        "parameter_server": {"chief": 1, "worker": 2, "ps": 2},
        # strategy auto + a 2-worker TF_CONFIG -> MultiWorkerMirroredStrategy.
        "auto": {"worker": 2},
    }
    outputs, others = {}, {}
    for name, roles in layouts.items():  # one cluster at a time: 7 TF processes starve 2 cores
        tc = {**raw["training"], "strategy": name, "ps_min_shard_bytes": 1024}
        (tmp_path / f"{name}.json").write_text(json.dumps({**raw, "training": tc}))
        procs = _cluster(roles, tmp_path / f"{name}.json", tmp_path / name, data_dir)
        try:
            # The chief, then every other task that returns (MultiWorker's worker 1).
            ends = [("chief", 0)] if "chief" in roles else [("worker", 0), ("worker", 1)]
            for key in ends:
                stdout, stderr = procs[key].communicate(timeout=600)
                assert procs[key].returncode == 0, stderr[-3000:]
                (others if key == ("worker", 1) else outputs)[name] = _last_json(stdout)
        finally:
            _stop(procs)
    outputs["multi_worker"] = outputs.pop("auto")
    ps, mirrored = outputs["parameter_server"], outputs["multi_worker"]
    assert (ps["strategy"], mirrored["strategy"]) == ("parameter_server", "multi_worker")
    assert any("/job:ps/replica:0/task:0" in d for d in ps["shard_devices"])
    assert any("/job:ps/replica:0/task:1" in d for d in ps["shard_devices"])
    assert mirrored["shard_devices"] == []
    # MultiWorker: both workers hold the same synchronously trained model (same mean loss);
    # only the chief (worker 0: the cluster names no chief) wrote a run folder.
    assert [mirrored["replicas"], others["auto"]["replicas"]] == [2, 2]
    assert others["auto"]["history"]["loss"] == pytest.approx(mirrored["history"]["loss"], rel=1e-4)
    assert others["auto"]["run_dir"] is None
    assert [str(p) for p in Path(mirrored["run_dir"]).parent.iterdir()] == [mirrored["run_dir"]]
    assert (Path(mirrored["run_dir"]) / "model" / "model.json").is_file()
    recall = {name: out["history"]["val_recall_at_10"][-1] for name, out in outputs.items()}
    # 101 users: one value's binomial standard error is ~.05, a difference's ~.07.
    assert recall["parameter_server"] == pytest.approx(recall["multi_worker"], abs=0.1)
    # Popularity on the same validation users: the floor both must clear by a margin.
    run_dir = Path(ps["run_dir"])
    assert (run_dir / "_SUCCESS").is_file()
    assert not list(run_dir.parent.glob(".backup-*"))  # checkpoints taken, then removed
    reloaded = TrainedModel.load(run_dir / "model")
    validator = validation_callback(parse_config(raw), data_dir, reloaded)
    counts = pq.read_table(data_dir / "item_features.parquet")["train_count"].to_numpy()
    floor = ev.evaluate(ev.popularity_scores(counts), validator.eval_set, validator.eval_config)
    print(f"val recall@10: {recall}, popularity {floor.metrics['recall_at_10']:.4f}")
    assert min(recall.values()) > floor.metrics["recall_at_10"] + 0.05
    # The sharded checkpoint restores into plain variables: the same recall on one device.
    assert validator.score() == pytest.approx(recall["parameter_server"], abs=1e-9)


@pytest.mark.parametrize(
    ("tf_config", "problem"),
    [
        (None, "no chief, worker, ps"),
        ({"cluster": {"worker": ["127.0.0.1:1"]}}, "no chief, ps"),
        ("{not json", "not valid JSON"),
    ],
)
def test_parameter_server_needs_a_cluster_with_every_role(
    monkeypatch: pytest.MonkeyPatch, tf_config: object, problem: str
) -> None:
    from recsys.core.errors import ConfigError
    from recsys.training.parameter_servers import cluster_resolver

    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        raw = tf_config if isinstance(tf_config, str) else json.dumps(tf_config)
        monkeypatch.setenv("TF_CONFIG", raw)
    with pytest.raises(ConfigError, match=problem):
        cluster_resolver()
