"""Training and evaluation speed on MovieLens 100K against the TFRS tutorial, in one run.

Kept for its speed measurements. Its quality rows use the Beam job's split, whose ties in a
user's last second break by item id as a STRING ("98" after "1000"), not the numeric order of
the evaluation protocol (docs/PROTOCOL.md): every model scores higher there. Quality under the
protocol, on any dataset and over seeds, is `benchmarks/quality.py`.

Under one split (docs/ARCHITECTURE.md: leave-last-out, train+validation items removed,
exact ranking over the whole catalog) it measures:

- baselines: popularity, EASE (lambda tuned on the validation item), implicit ALS (tuned on
  the validation item);
- the TFRS tutorial two-tower as published (ids only, dim 32, Adagrad 0.1, batch 8192,
  3 epochs, FactorizedTopK metrics computed while training) = speed reference (a);
- the same model with training metrics off = (b);
- our trainer on the same model settings = (c), and our default config;
- exact evaluation (`recsys.evaluation`) vs TFRS FactorizedTopK `evaluate` on the same
  embeddings, on ML-100K and on a generated 100K-item catalog, with the peak memory of each.

Timings on a shared machine are noisy, so (a), (b) and (c) run in `--rounds` interleaved
rounds (a, b, c, a, b, c, ...) and the medians and per-round ratios are reported, with the
load average seen during the run.

Usage:
    .venv/bin/python benchmarks/quality_ml100k.py --data datasets/ml-100k \
        --out benchmarks/results/quality_ml100k.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from conductor import stages
from recsys import baselines
from recsys import evaluation as ev
from recsys.core import schema
from recsys.core.config import EvaluationConfig, RecsysConfig, load_config
from recsys.core.layout import Workdir
from recsys.data_io import load_split

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
        "jit_compile": result.jit_compile,
        "cached": result.cached,
        "final_loss": round(history["loss"][-1], 4),
        "test": {k: round(report.model[k], 4) for k in REPORTED},
    }


def speed_rounds(
    contenders: dict[str, Callable[[], dict[str, Any]]], rounds: int
) -> dict[str, Any]:
    """Every contender once per round, interleaved; medians and same-round ratios to the first.

    On a shared machine the load drifts between minutes: comparing runs of the same round
    cancels most of it.
    """
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    loads = []
    for r in range(rounds):
        for name, run in contenders.items():
            runs[name].append(run())
            loads.append(os.getloadavg()[0])
            speed = runs[name][-1]["examples_per_second"]
            print(f"round {r + 1} {name}: {speed} ex/s, load {loads[-1]:.1f}", file=sys.stderr)
    out: dict[str, Any] = {}
    names = list(contenders)
    for name in names:
        speeds = [run["examples_per_second"] for run in runs[name]]
        out[name] = {
            **runs[name][0],
            "examples_per_second": round(statistics.median(speeds)),
            "examples_per_second_rounds": speeds,
            "recall_at_10_rounds": [run["test"]["recall_at_10"] for run in runs[name]],
        }
    last = names[-1]
    for ref in names[:-1]:
        ratios = [
            c["examples_per_second"] / a["examples_per_second"]
            for c, a in zip(runs[last], runs[ref], strict=True)
        ]
        out[f"ratio_{last}_over_{ref}"] = {
            "median": round(statistics.median(ratios), 2),
            "rounds": [round(x, 2) for x in ratios],
        }
    out["load_average_1min"] = {"min": min(loads), "max": max(loads)}
    return out


def tutorial_settings(config: RecsysConfig) -> RecsysConfig:
    """Our config with the tutorial's model and optimiser (for the equal-settings speed test)."""
    return config.model_copy(
        update={
            "model": config.model.model_copy(
                update={
                    "embedding_dim": 32,
                    "hidden_dims": [],
                    "temperature": 1.0,
                    # The tutorial's towers are plain embeddings: raw dot products, no norm.
                    "normalize": False,
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed_peak(fn: Callable[[], object]) -> tuple[float, int]:
    """(seconds, peak resident memory above the starting level in bytes) of one call.

    A thread samples the process RSS every 2 ms: numpy and TensorFlow allocations both show.
    """
    base, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return seconds, max(peak[0], _rss_bytes()) - base


def exact_vs_factorized(
    users: np.ndarray, items: np.ndarray, data: ev.EvalSet, targets: np.ndarray, rounds: int
) -> dict[str, Any]:
    """Seconds (median of interleaved rounds) and peak memory, exact vs FactorizedTopK."""

    def exact() -> None:
        ev.evaluate(ev.dot_product_scores(users, items), data, EVAL)

    def factorized() -> None:
        metric = tfrs.metrics.FactorizedTopK(
            candidates=tf.data.Dataset.from_tensor_slices(items).batch(128), ks=(10, 50, 100)
        )
        for lo in range(0, len(users), 4096):
            metric.update_state(users[lo : lo + 4096], items[targets[lo : lo + 4096]])
        metric.result()

    exact()  # warm-up: BLAS threads, TF graph building
    factorized()
    e_runs, f_runs = [], []
    for _ in range(rounds):
        e_runs.append(timed_peak(exact))
        f_runs.append(timed_peak(factorized))
    ratios = [f[0] / e[0] for e, f in zip(e_runs, f_runs, strict=True)]
    mib = 1 << 20
    return {
        "exact_seconds": round(statistics.median(e[0] for e in e_runs), 3),
        "factorized_topk_seconds": round(statistics.median(f[0] for f in f_runs), 3),
        "speedup": round(statistics.median(ratios), 1),
        "speedup_rounds": [round(x, 1) for x in ratios],
        "exact_peak_mib": round(max(e[1] for e in e_runs) / mib, 1),
        "factorized_topk_peak_mib": round(max(f[1] for f in f_runs) / mib, 1),
        "scores_batch_mib": round(
            ev.batch_plan(len(users), data.num_items, EVAL.user_batch_size)[1]
            * data.num_items
            * 4
            / mib,
            1,
        ),
    }


def run_eval_speed(s: Splits, tutorial: TutorialModel, rounds: int) -> dict[str, Any]:
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
    out = {"ml100k": exact_vs_factorized(users, items, data, data.targets, rounds)}
    rng = np.random.default_rng(0)
    n_users, n_items = 2000, 100_000
    big_users = rng.normal(size=(n_users, 32)).astype(np.float32)
    big_items = rng.normal(size=(n_items, 32)).astype(np.float32)
    targets = rng.integers(0, n_items, n_users)
    exclude = [rng.integers(0, n_items, 50) for _ in range(n_users)]
    exclude = [e[e != t] for e, t in zip(exclude, targets, strict=True)]
    big = ev.EvalSet([f"u{i}" for i in range(n_users)], targets, exclude, n_items)
    out["generated_100k_items"] = exact_vs_factorized(big_users, big_items, big, targets, rounds)
    return out


def main() -> int:
    """Run everything and print/write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO / "datasets/ml-100k"))
    parser.add_argument("--config", default=str(REPO / "configs/movielens-100k.yaml"))
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/quality_ml100k.json"))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved speed rounds")
    parser.add_argument("--skip-baselines", action="store_true", help="speed only (quicker)")
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
        if not args.skip_baselines:
            results["baselines"] = run_baselines(s)
        tutorials: dict[bool, TutorialModel] = {}

        def tutorial(metrics_in_training: bool) -> dict[str, Any]:
            out, tutorials[metrics_in_training] = run_tutorial(s, metrics_in_training)
            return out

        speed = speed_rounds(
            {
                "a": lambda: tutorial(True),
                "b": lambda: tutorial(False),
                "c": lambda: run_ours(tutorial_settings(config), workdir, data_dir),
            },
            args.rounds,
        )
        results["tutorial_a_metrics_in_training"] = speed.pop("a")
        results["tutorial_b_metrics_off"] = speed.pop("b")
        results["ours_c_tutorial_settings"] = speed.pop("c")
        results["speed_ratios"] = {
            "c_over_a": speed.pop("ratio_c_over_a"),
            "c_over_b": speed.pop("ratio_c_over_b"),
        }
        results["speed_load_average_1min"] = speed.pop("load_average_1min")
        results["ours_default"] = run_ours(config, workdir, data_dir)
        results["evaluation_speed"] = run_eval_speed(s, tutorials[False], args.rounds)
        results["evaluation_load_average_1min"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    json.dump(results, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
