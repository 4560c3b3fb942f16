"""Per-step training time against vocabulary size, and quality, for Adam vs LazyAdam.

Part `steps`: the project's two-tower model (ids + mean-pooled 20-item history, dim 64,
batch 1024, blocked in-batch softmax with logQ) trained on random batches (Zipf-distributed
ids, as real logs are) with embedding tables of 20K, 200K and 2M rows in total (80% user
rows, 20% item rows), for each optimizer: tf_keras Adam (dense moment decay of every row),
LazyAdam (recsys/training/lazy_adam.py, touched rows only) and Adagrad (tf_keras' sparse
path). Median ms/step over the timed steps of each run; runs are interleaved over
`--rounds` rounds (size x optimizer in one order per round) on the same machine.

Part `quality`: the real nightly stages (Beam preprocess -> trainer -> exact evaluation,
the protocol of docs/PROTOCOL.md: leave-last-out, train(+validation) items removed, full catalog,
ties by catalog order) with `training.optimizer` adam vs lazy_adam, everything else from
the dataset's config, over `--seeds`: validation R@10 / NDCG@10 (where settings are
chosen) and test R@10 / NDCG@10, on MovieLens 100K and on the embedded synthetic log.

Usage:
    nice .venv/bin/python benchmarks/sparse_optimizer.py --part steps \\
        --out benchmarks/results/sparse_optimizer_steps.json
    nice .venv/bin/python benchmarks/sparse_optimizer.py --part quality \\
        --out benchmarks/results/sparse_optimizer_quality.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import recsys  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)

# isort: split
import numpy as np
import tensorflow as tf

from conductor import stages
from recsys import evaluation as ev
from recsys.core import schema
from recsys.core.config import (
    EvaluationConfig,
    ModelConfig,
    RecsysConfig,
    TrainingConfig,
    load_config,
)
from recsys.core.layout import Workdir
from recsys.data_io import iter_split, load_split
from recsys.model import (
    HISTORY_INDEX,
    ITEM_INDEX,
    ITEM_LOG_PROB,
    USER_INDEX,
    TrainedModel,
    TwoTowerModel,
)
from recsys.model_evaluation import evaluate_model
from recsys.training import trainer

REPO = Path(__file__).resolve().parent.parent
SIZES = (20_000, 200_000, 2_000_000)
OPTIMIZERS = ("adam", "lazy_adam", "adagrad")
METRICS = ("recall_at_10", "ndcg_at_10")
HEAD = 4_000  # distinct ranks ids are drawn from: at most the smallest table's item rows
# The model these step times were measured on: a per-user table (the sparse-update case),
# mean pooling and in-batch negatives (pinned: the code's defaults are the benchmarked model).
MEASURED_MODEL = {"query_encoder": "mean", "negatives": "in_batch", "user_embedding": True}


def _batches(users: int, items: int, batch: int, history: int, seed: int) -> tf.data.Dataset:
    """Endless random batches that touch the same number of rows at every table size.

    Ids are Zipf(1.1) ranks folded into the first HEAD ranks (heavy head, long tail), then
    scattered over the whole table by a fixed random permutation: only the table's size
    changes between sizes, not how many rows a step touches or how they repeat.
    """
    rng = np.random.default_rng(seed)
    rows = {n: rng.permutation(n)[:HEAD] for n in (users, items)}  # one scatter per table

    def zipf(n: int, shape: tuple[int, ...]) -> np.ndarray:
        ranks = (rng.zipf(1.1, size=shape) - 1) % HEAD
        return rows[n][ranks] + 1  # index 0 is the OOV bucket

    pool = 64  # distinct batches, cycled: input cost stays out of the step time
    data = {
        USER_INDEX: zipf(users, (pool, batch)),
        ITEM_INDEX: zipf(items, (pool, batch)),
        ITEM_LOG_PROB: np.full((pool, batch), -np.log(items), np.float32),
        HISTORY_INDEX: zipf(items, (pool, batch, history)),
    }
    return tf.data.Dataset.from_tensor_slices(data).repeat()


def step_time(rows: int, optimizer: str, steps: int, warmup: int) -> dict[str, Any]:
    """Median ms/step of `steps` training steps after `warmup` ones, tables of `rows` rows."""
    tf.keras.backend.clear_session()
    gc.collect()
    users, items = int(rows * 0.8), int(rows * 0.2)
    config = ModelConfig(item_features=False, **MEASURED_MODEL)
    model_ids = TrainedModel.build(
        [f"u{i}" for i in range(users)], [f"i{i}" for i in range(items)], config
    )
    model = TwoTowerModel(model_ids.query_tower, model_ids.candidate_tower, config)
    training = TrainingConfig(optimizer=optimizer)
    model.compile(optimizer=trainer.make_optimizer(training, "float32"))
    timer = _StepTimer()
    data = _batches(users, items, training.batch_size, config.history_length, seed=0)
    model.fit(data, epochs=1, steps_per_epoch=warmup + steps, callbacks=[timer], verbose=0)
    times = timer.seconds[warmup:]
    return {
        "rows": rows,
        "optimizer": optimizer,
        "median_ms": round(1000 * statistics.median(times), 2),
        "p90_ms": round(1000 * float(np.percentile(times, 90)), 2),
        "steps": len(times),
    }


class _StepTimer(tf.keras.callbacks.Callback):
    """Wall seconds of every training step (one step per call)."""

    def __init__(self) -> None:
        super().__init__()
        self._supports_tf_logs = True
        self.seconds: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        # The loss tensor forces the step to finish before the clock stops.
        if logs and "loss" in logs:
            float(logs["loss"])
        self.seconds.append(time.perf_counter() - self._start)


def interleaved(optimizer: str, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """One process, one model per size, `steps` steps of each size in turn per round: the
    sizes see the same machine load (on a shared machine, load swings between separate runs
    exceed the effect measured). Median ms/step per size over all rounds."""
    models = {}
    for rows in SIZES:
        users, items = int(rows * 0.8), int(rows * 0.2)
        config = ModelConfig(item_features=False, **MEASURED_MODEL)
        built = TrainedModel.build(
            [f"u{i}" for i in range(users)], [f"i{i}" for i in range(items)], config
        )
        model = TwoTowerModel(built.query_tower, built.candidate_tower, config)
        model.compile(
            optimizer=trainer.make_optimizer(TrainingConfig(optimizer=optimizer), "float32")
        )
        data = iter(_batches(users, items, 1024, config.history_length, seed=0))
        step = tf.function(model.train_step)
        for _ in range(warmup):
            step(next(data))
        models[rows] = (step, data)
    times: dict[int, list[float]] = {rows: [] for rows in SIZES}
    for _ in range(rounds):
        for rows, (step, data) in models.items():
            for _ in range(steps):
                batch = next(data)
                start = time.perf_counter()
                float(step(batch)["loss"])
                times[rows].append(time.perf_counter() - start)
    median = {rows: round(1000 * statistics.median(t), 2) for rows, t in times.items()}
    return {
        "optimizer": optimizer,
        "median_ms": median,
        "growth_2M_over_20K": round(median[SIZES[-1]] / median[SIZES[0]], 2),
        "steps_per_size": rounds * steps,
    }


def run_steps(rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Every (size, optimizer) once per round, each in a fresh process (no memory carried
    over between runs); per pair the median over rounds."""
    runs = []
    for r in range(rounds):
        for rows in SIZES:
            for optimizer in OPTIMIZERS:
                cmd = [sys.executable, __file__, "--one", f"{rows},{optimizer}"]
                cmd += ["--steps", str(steps), "--warmup", str(warmup), "--part", "steps"]
                cmd += ["--out", "-"]
                done = subprocess.run(cmd, check=True, capture_output=True, text=True)
                result = json.loads(done.stdout.strip().splitlines()[-1]) | {"round": r}
                print(json.dumps(result), flush=True)
                runs.append(result)
    table = {}
    for rows in SIZES:
        for optimizer in OPTIMIZERS:
            ms = [x["median_ms"] for x in runs if x["rows"] == rows and x["optimizer"] == optimizer]
            table[f"{optimizer}@{rows}"] = statistics.median(ms)
    growth = {
        opt: round(table[f"{opt}@{SIZES[-1]}"] / table[f"{opt}@{SIZES[0]}"], 2)
        for opt in OPTIMIZERS
    }
    return {"runs": runs, "median_ms": table, "growth_2M_over_20K": growth}


def quality_run(base: RecsysConfig, data_dir: Path, optimizer: str, seed: int) -> dict[str, Any]:
    """Train with `optimizer` and `seed`; validation and test R@10 / NDCG@10 (exact protocol)."""
    training = base.training.model_copy(update={"optimizer": optimizer, "seed": seed})
    config = base.model_copy(update={"training": training})
    tf.keras.backend.clear_session()
    start = time.perf_counter()
    result = trainer.train(config, data_dir)
    seconds = time.perf_counter() - start
    validation = load_split(data_dir, "validation")
    ids = (schema.USER_ID, schema.ITEM_ID)
    valid_set = ev.build_eval_set(
        result.model.items, validation, iter_split(data_dir, "train", ids)
    )
    histories = list(validation[schema.HISTORY])
    eval_config = EvaluationConfig(ks=[10], ndcg_k=10, mrr_k=10, coverage_k=0)
    scores = ev.dot_product_scores(
        result.model.user_embeddings(valid_set.users, histories), result.model.item_embeddings()
    )
    valid = ev.evaluate(scores, valid_set, eval_config).metrics
    with tempfile.TemporaryDirectory() as tmp:
        result.model.save(Path(tmp) / "model")
        _, test = evaluate_model(config, Path(tmp) / "model", data_dir)
    return {
        "optimizer": optimizer,
        "seed": seed,
        "train_seconds": round(seconds, 1),
        "validation": {m: round(valid[m], 4) for m in METRICS},
        "test": {m: round(test.metrics[m], 4) for m in METRICS},
    }


def run_quality(seeds: list[int], work: Path) -> dict[str, Any]:
    """Both optimizers on MovieLens 100K and the embedded synthetic log."""
    datasets = {
        "ml-100k": (REPO / "configs/movielens-100k.yaml", dt.date(1998, 4, 30)),
        "synthetic-default": (REPO / "configs/default.yaml", dt.date(2026, 1, 14)),
    }
    out: dict[str, Any] = {}
    for name, (path, date) in datasets.items():
        os.chdir(REPO)  # the ML-100K config's data path is relative to the repository
        config = load_config(path)
        data_dir, _ = stages.preprocess(config, Workdir(work / name), date)
        runs = []
        for seed in seeds:
            for optimizer in ("adam", "lazy_adam"):
                runs.append(quality_run(config, data_dir, optimizer, seed))
                print(name, json.dumps(runs[-1]), flush=True)
        out[name] = {"runs": runs, "mean": _means(runs)}
    return out


def _means(runs: list[dict[str, Any]]) -> dict[str, Any]:
    means: dict[str, Any] = {}
    for optimizer in ("adam", "lazy_adam"):
        mine = [r for r in runs if r["optimizer"] == optimizer]
        means[optimizer] = {
            split: {m: round(statistics.mean(r[split][m] for r in mine), 4) for m in METRICS}
            for split in ("validation", "test")
        }
    return means


def main() -> int:
    """Run one part and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("steps", "quality"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seeds", default="42,43")
    parser.add_argument("--work", default=None, help="workdir for the quality part")
    parser.add_argument("--one", default=None, help="ROWS,OPTIMIZER: one step-time run")
    parser.add_argument(
        "--interleaved", default=None, help="OPTIMIZER: all sizes in one process, in turns"
    )
    args = parser.parse_args()
    if args.interleaved:
        result = interleaved(args.interleaved, args.rounds, args.steps, args.warmup)
        result["command"] = " ".join(sys.argv)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result))
        return 0
    if args.one:
        rows, optimizer = args.one.split(",")
        print(json.dumps(step_time(int(rows), optimizer, args.steps, args.warmup)))
        return 0
    load = os.getloadavg()
    if args.part == "steps":
        result = run_steps(args.rounds, args.steps, args.warmup)
    else:
        work = Path(args.work or tempfile.mkdtemp(prefix="sparse-opt-"))
        result = run_quality([int(s) for s in args.seeds.split(",")], work)
    result |= {
        "command": " ".join(sys.argv),
        "load_average_start": [round(x, 2) for x in load],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
