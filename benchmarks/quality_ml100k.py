"""Quality and training speed on MovieLens 100K, everything measured in one run.

Under one protocol (docs/ARCHITECTURE.md: leave-last-out, train+validation items removed,
exact ranking over the whole catalog) it measures:

- baselines: popularity, EASE (lambda tuned on the validation item), implicit ALS (tuned on
  the validation item);
- the TFRS tutorial two-tower as published (ids only, dim 32, Adagrad 0.1, batch 8192,
  3 epochs, FactorizedTopK metrics computed while training) = speed reference (a);
- the same model with training metrics off = (b);
- our trainer on the same model settings = (c), and our default config;
- exact evaluation (`recsys.evaluation`) vs TFRS FactorizedTopK `evaluate` on the same
  embeddings, on ML-100K and on a generated 100K-item catalog.

Usage:
    .venv/bin/python benchmarks/quality_ml100k.py --data ../shared/data/ml-100k \
        --out benchmarks/results/quality_ml100k.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import recsys  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)

# isort: split
import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from recsys import baselines, schema, stages
from recsys import evaluation as ev
from recsys.config import EvaluationConfig, RecsysConfig, load_config
from recsys.layout import Workdir
from recsys.training.dataset import load_split

REPO = Path(__file__).resolve().parent.parent
DATE = dt.date(1998, 4, 30)  # after the last rating in u.data
EVAL = EvaluationConfig()
REPORTED = stages.REPORTED_METRICS


def _ids(values: np.ndarray) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


class Splits:
    """The Beam job's splits in catalog index space, with both evaluation sets."""

    def __init__(self, data_dir: Path) -> None:
        self.items = (data_dir / "vocab" / "items.txt").read_text().splitlines()
        self.position = {item: i for i, item in enumerate(self.items)}
        self.train = load_split(data_dir, "train")
        self.validation = load_split(data_dir, "validation")
        self.test = load_split(data_dir, "test")
        self.valid_set = ev.build_eval_set(self.items, self.validation, [self.train])
        self.test_set = ev.build_eval_set(self.items, self.test, [self.train, self.validation])
        self.counts = np.bincount(
            [self.position[i] for i in _ids(self.train[schema.ITEM_ID])],
            minlength=len(self.items),
        )

    def history(self, users: list[str], parts: list[dict[str, np.ndarray]]) -> np.ndarray:
        """Binary users x items matrix of the given splits' interactions, rows in `users` order."""
        row = {u: r for r, u in enumerate(users)}
        rows, cols = [], []
        for part in parts:
            for u, i in zip(_ids(part[schema.USER_ID]), _ids(part[schema.ITEM_ID]), strict=True):
                if u in row and i in self.position:
                    rows.append(row[u])
                    cols.append(self.position[i])
        return baselines.interaction_matrix(
            np.array(rows, int), np.array(cols, int), len(users), len(self.items)
        )

    def train_matrix(self) -> tuple[list[str], np.ndarray]:
        """All training users' interaction matrix (what EASE and ALS are fitted on)."""
        users = sorted(set(_ids(self.train[schema.USER_ID])))
        return users, self.history(users, [self.train])


def _metrics(score_fn: ev.ScoreFn, data: ev.EvalSet) -> dict[str, float]:
    result = ev.evaluate(score_fn, data, EVAL).metrics
    return {k: round(result[k], 4) for k in REPORTED}


def run_baselines(s: Splits) -> dict[str, Any]:
    """Popularity, EASE and ALS, each tuned on validation and reported on test."""
    out: dict[str, Any] = {
        "popularity": {"test": _metrics(ev.popularity_scores(s.counts), s.test_set)}
    }
    _, x = s.train_matrix()
    val_hist = s.history(s.valid_set.users, [s.train])
    test_hist = s.history(s.test_set.users, [s.train, s.validation])
    best = None
    for l2 in (50.0, 100.0, 200.0, 400.0, 800.0, 1600.0):
        val = _metrics(baselines.ease_scores(val_hist, baselines.ease_weights(x, l2)), s.valid_set)
        if best is None or val["ndcg_at_10"] > best[1]["ndcg_at_10"]:
            best = (l2, val)
    assert best is not None
    b = baselines.ease_weights(x, best[0])
    out["ease"] = {
        "lambda": best[0],
        "validation": best[1],
        "test": _metrics(baselines.ease_scores(test_hist, b), s.test_set),
    }
    best_als = None
    # A small grid: each implicit-ALS fit is ~10 s on 2 cores (exact per-row solves).
    for factors in (64, 128):
        for reg in (1.0, 10.0):
            for alpha in (5.0, 20.0):
                _, items = baselines.als_factors(x, factors, reg, alpha, iterations=10)
                val = _metrics(baselines.als_scores(val_hist, items, reg, alpha), s.valid_set)
                if best_als is None or val["ndcg_at_10"] > best_als[1]["ndcg_at_10"]:
                    best_als = ((factors, reg, alpha), val, items)
    assert best_als is not None
    (factors, reg, alpha), val, items = best_als
    out["als"] = {
        "factors": factors,
        "reg": reg,
        "alpha": alpha,
        "validation": val,
        "test": _metrics(baselines.als_scores(test_hist, items, reg, alpha), s.test_set),
    }
    return out


class _EpochTimer(tf.keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.seconds.append(time.perf_counter() - self.start)


class TutorialModel(tfrs.Model):
    """The TFRS basic-retrieval tutorial model, as published (item id instead of title)."""

    def __init__(self, users: list[str], items: list[str], metrics_in_training: bool) -> None:
        super().__init__()
        self.metrics_in_training = metrics_in_training
        self.user_model = tf.keras.Sequential(
            [
                tf.keras.layers.StringLookup(vocabulary=users, mask_token=None),
                tf.keras.layers.Embedding(len(users) + 1, 32),
            ]
        )
        self.item_model = tf.keras.Sequential(
            [
                tf.keras.layers.StringLookup(vocabulary=items, mask_token=None),
                tf.keras.layers.Embedding(len(items) + 1, 32),
            ]
        )
        candidates = tf.data.Dataset.from_tensor_slices(items).batch(128).map(self.item_model)
        self.task = tfrs.tasks.Retrieval(metrics=tfrs.metrics.FactorizedTopK(candidates=candidates))

    def compute_loss(self, features: dict[str, tf.Tensor], training: bool = False) -> tf.Tensor:
        return self.task(
            self.user_model(features["user_id"]),
            self.item_model(features["item_id"]),
            compute_metrics=self.metrics_in_training or not training,
        )


def run_tutorial(s: Splits, metrics_in_training: bool) -> tuple[dict[str, Any], TutorialModel]:
    """Train the tutorial model on our train split; speed after epoch 1 and quality on test."""
    tf.keras.utils.set_random_seed(42)
    users = sorted(set(_ids(s.train[schema.USER_ID])))
    model = TutorialModel(users, s.items, metrics_in_training)
    model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1))
    train = tf.data.Dataset.from_tensor_slices(
        {"user_id": s.train[schema.USER_ID], "item_id": s.train[schema.ITEM_ID]}
    )
    n = len(s.train[schema.USER_ID])
    cached = train.shuffle(100_000, seed=42, reshuffle_each_iteration=False).batch(8192).cache()
    timer = _EpochTimer()
    model.fit(cached, epochs=3, verbose=0, callbacks=[timer])
    vectors = model.user_model(tf.constant(s.test_set.users)).numpy()
    items = model.item_model(tf.constant(s.items)).numpy()
    quality = _metrics(ev.dot_product_scores(vectors, items), s.test_set)
    return {"examples_per_second": round(n * 2 / sum(timer.seconds[1:])), "test": quality}, model


def run_ours(config: RecsysConfig, workdir: Workdir, data_dir: Path) -> dict[str, Any]:
    """Our trainer (`recsys train` + `recsys evaluate`) with the given config."""
    tf.keras.utils.set_random_seed(config.training.seed)
    run_dir, result = stages.train(config, workdir, DATE, data_dir)
    _, report = stages.evaluate(config, workdir, DATE, run_dir.name)
    history = json.loads((run_dir / "history.json").read_text())
    return {
        "examples_per_second": round(result.steady_examples_per_second),
        "seconds": round(result.seconds, 1),
        "final_loss": round(history["loss"][-1], 4),
        "test": {k: round(report["model"][k], 4) for k in REPORTED},
    }


def tutorial_settings(config: RecsysConfig) -> RecsysConfig:
    """Our config with the tutorial's model and optimiser (for the equal-settings speed test)."""
    return config.model_copy(
        update={
            "model": config.model.model_copy(
                update={
                    "embedding_dim": 32,
                    "hidden_dims": [],
                    "temperature": 1.0,
                    "logq_correction": False,
                    "remove_accidental_hits": False,
                    # The tutorial model is ids only: no history, no item features.
                    "history_length": 0,
                    "item_features": False,
                }
            ),
            "training": config.training.model_copy(
                update={
                    "optimizer": "adagrad",
                    "learning_rate": 0.1,
                    "batch_size": 8192,
                    "epochs": 3,
                }
            ),
        }
    )


def exact_vs_factorized(
    users: np.ndarray, items: np.ndarray, data: ev.EvalSet, targets: np.ndarray
) -> dict[str, float]:
    """Seconds for exact evaluation vs FactorizedTopK over the same embeddings."""
    start = time.perf_counter()
    ev.evaluate(ev.dot_product_scores(users, items), data, EVAL)
    exact = time.perf_counter() - start
    metric = tfrs.metrics.FactorizedTopK(
        candidates=tf.data.Dataset.from_tensor_slices(items).batch(128), ks=(10, 50, 100)
    )
    start = time.perf_counter()
    for lo in range(0, len(users), 4096):
        metric.update_state(users[lo : lo + 4096], items[targets[lo : lo + 4096]])
    metric.result()
    factorized = time.perf_counter() - start
    return {
        "exact_seconds": round(exact, 3),
        "factorized_topk_seconds": round(factorized, 3),
        "speedup": round(factorized / exact, 1),
    }


def run_eval_speed(s: Splits, tutorial: TutorialModel) -> dict[str, Any]:
    """Exact evaluation vs FactorizedTopK on ML-100K and on a generated 100K-item catalog."""
    known = s.test_set.targets >= 0
    users = tutorial.user_model(tf.constant(s.test_set.users)).numpy()[known]
    items = tutorial.item_model(tf.constant(s.items)).numpy()
    data = ev.EvalSet(
        [u for u, k in zip(s.test_set.users, known, strict=True) if k],
        s.test_set.targets[known],
        [e for e, k in zip(s.test_set.exclude, known, strict=True) if k],
        len(s.items),
    )
    out = {"ml100k": exact_vs_factorized(users, items, data, data.targets)}
    rng = np.random.default_rng(0)
    n_users, n_items = 2000, 100_000
    big_users = rng.normal(size=(n_users, 32)).astype(np.float32)
    big_items = rng.normal(size=(n_items, 32)).astype(np.float32)
    targets = rng.integers(0, n_items, n_users)
    exclude = [rng.integers(0, n_items, 50) for _ in range(n_users)]
    exclude = [e[e != t] for e, t in zip(exclude, targets, strict=True)]
    big = ev.EvalSet([f"u{i}" for i in range(n_users)], targets, exclude, n_items)
    out["generated_100k_items"] = exact_vs_factorized(big_users, big_items, big, targets)
    return out


def main() -> int:
    """Run everything and print/write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO.parent / "shared/data/ml-100k"))
    parser.add_argument("--config", default=str(REPO / "configs/movielens-100k.yaml"))
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/quality_ml100k.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = load_config(args.config)
    results: dict[str, Any] = {
        "protocol": "leave-last-out; test item; train+validation items "
        "removed; exact ranking over the train-vocabulary catalog"
    }
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Workdir(Path(tmp))
        data_dir, stats = stages.preprocess(config, workdir, DATE, str(Path(args.data) / "u.data"))
        s = Splits(data_dir)
        results["data"] = {
            "catalog": len(s.items),
            "test_users": len(s.test_set.users),
            "train_examples": int(stats["splits"]["train"]),
        }
        results["baselines"] = run_baselines(s)
        results["tutorial_a_metrics_in_training"], _ = run_tutorial(s, metrics_in_training=True)
        results["tutorial_b_metrics_off"], tutorial = run_tutorial(s, metrics_in_training=False)
        results["ours_c_tutorial_settings"] = run_ours(tutorial_settings(config), workdir, data_dir)
        results["ours_default"] = run_ours(config, workdir, data_dir)
        results["evaluation_speed"] = run_eval_speed(s, tutorial)
    a = results["tutorial_a_metrics_in_training"]["examples_per_second"]
    b = results["tutorial_b_metrics_off"]["examples_per_second"]
    c = results["ours_c_tutorial_settings"]["examples_per_second"]
    results["speed_ratios"] = {"c_over_a": round(c / a, 2), "c_over_b": round(c / b, 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    json.dump(results, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
