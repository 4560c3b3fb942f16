"""Query encoders and negatives on validation (to choose defaults), then the test split.

For one data set already preprocessed by the Beam job (`--data-dir`, e.g. from
`recsys preprocess --config configs/movielens-100k.yaml`), trains each named variant of
the default model and training settings (configs/default.yaml: only the data differs, as when
the project is scored) and reports, on the VALIDATION split (each user's item before the test
item, training items removed, exact ranking over the catalog), Recall@10/50 and NDCG@10 of
the weights kept, with the cost: wall seconds per epoch (training steps only) and examples/s.
With `--test`, the named variants and EASE / ALS (tuned on validation,
benchmarks/quality_ml100k.py) are also scored on the test split, the protocol of
docs/PROTOCOL.md.

Usage (one variant per `name=key:value,...`, keys `model.x` / `training.x`):
    .venv/bin/python benchmarks/sequence_encoders.py --data-dir WORK/data/DATE \
        --variant mean=model.query_encoder:mean,model.negatives:in_batch \
        --variant sasrec=model.query_encoder:transformer,model.negatives:full \
        --out benchmarks/results/sequence_encoders_ml100k.json [--test] [--baselines]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
import numpy as np
import tensorflow as tf
import yaml

from recsys import baselines
from recsys import evaluation as ev
from recsys.core.config import EvaluationConfig, RecsysConfig, load_config
from recsys.core.records import read_stats
from recsys.data_io import load_split
from recsys.training import trainer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from quality_ml100k import Splits, _ids, _metrics  # the same baseline code

EVAL = EvaluationConfig(ks=[10, 50], ndcg_k=10, mrr_k=100, coverage_k=10)
REPORTED = ("recall_at_10", "recall_at_50", "ndcg_at_10")


def parse_value(raw: str) -> Any:
    """A YAML scalar: 50 -> int, 0.2 -> float, true -> bool, mean -> str."""
    return yaml.safe_load(raw)


def variant_config(base: RecsysConfig, spec: str) -> tuple[str, RecsysConfig]:
    """`name=model.k:v,training.k:v` -> (name, base with those keys replaced)."""
    name, _, items = spec.partition("=")
    raw = base.model_dump()
    for item in filter(None, items.split(",")):
        key, _, value = item.partition(":")
        section, field = key.split(".")
        raw[section][field] = parse_value(value)
    return name, RecsysConfig.model_validate(raw)


def validation_metrics(config: RecsysConfig, data_dir: Path, result: Any) -> dict[str, float]:
    """The kept weights' validation metrics (exact ranking, training items removed)."""
    callback = trainer.validation_callback(config, data_dir, result.model)
    model = result.model
    users = callback.queries(model)
    scores = ev.dot_product_scores(users, model.item_embeddings())
    metrics = ev.evaluate(scores, callback.eval_set, EVAL).metrics
    return {k: round(metrics[k], 4) for k in REPORTED}


def test_metrics(result: Any, data_dir: Path) -> dict[str, float]:
    """Test split: histories from the test examples, train + validation items removed."""
    test = load_split(data_dir, "test")
    eval_set = ev.build_eval_set(
        result.model.items,
        test,
        [load_split(data_dir, "train"), load_split(data_dir, "validation")],
    )
    users = result.model.user_embeddings(eval_set.users, list(test["history"]))
    scores = ev.dot_product_scores(users, result.model.item_embeddings())
    metrics = ev.evaluate(scores, eval_set, EVAL).metrics
    return {k: round(metrics[k], 4) for k in REPORTED}


def run_variant(config: RecsysConfig, data_dir: Path, test: bool) -> dict[str, Any]:
    """Train one variant; validation (and test) metrics and the cost per epoch."""
    tf.keras.backend.clear_session()
    start = time.perf_counter()
    result = trainer.train(config, data_dir)
    seconds = time.perf_counter() - start
    epochs = len(result.epoch_seconds)
    out = {
        "model": {
            k: v
            for k, v in result.model.config.model_dump().items()
            if k in ("query_encoder", "negatives", "history_length", "temperature", "normalize")
            or k.startswith(("encoder_", "sampled_", "negative_"))
        },
        "training": {
            k: config.training.model_dump()[k]
            for k in ("learning_rate", "batch_size", "epochs", "early_stopping_patience")
        },
        "epochs_run": epochs,
        "best_epoch": result.best_epoch,
        "seconds_per_epoch": round(sum(result.epoch_seconds[1:]) / max(epochs - 1, 1), 2),
        "first_epoch_seconds": round(result.epoch_seconds[0], 2) if epochs else None,
        "examples_per_second": round(result.steady_examples_per_second),
        "wall_seconds": round(seconds, 1),
        "val_history": [
            round(v, 4)
            for v in result.history.get(f"val_{config.training.early_stopping_metric}", [])
        ],
        "validation": validation_metrics(config, data_dir, result),
    }
    if test:
        out["test"] = test_metrics(result, data_dir)
    return out


def run_baselines(data_dir: Path, lambdas: list[float], als: list[str]) -> dict[str, Any]:
    """Popularity, EASE and ALS tuned on validation (NDCG@10), scored on test.

    The same code as benchmarks/quality_ml100k.py, with the grids given (EASE inverts an
    items x items matrix per lambda; each ALS fit solves every user and item row).
    """
    s = Splits(data_dir)
    out: dict[str, Any] = {
        "popularity": {"test": _metrics(ev.popularity_scores(s.counts), s.test_set)}
    }
    _, x = s.train_matrix()
    val_hist = s.history(s.valid_set.users, [s.train])
    test_hist = s.history(s.test_set.users, [s.train, s.validation])
    best: tuple[Any, ...] | None = None
    for l2 in lambdas:
        b = baselines.ease_weights(x, l2)
        val = _metrics(baselines.ease_scores(val_hist, b), s.valid_set)
        if best is None or val["ndcg_at_10"] > best[1]["ndcg_at_10"]:
            best = (l2, val, _metrics(baselines.ease_scores(test_hist, b), s.test_set))
        del b
    assert best is not None
    out["ease"] = {"lambda": best[0], "validation": best[1], "test": best[2]}
    best = None
    for spec in als:
        factors, reg, alpha = (float(v) for v in spec.split("/"))
        _, items = baselines.als_factors(x, int(factors), reg, alpha, iterations=10)
        val = _metrics(baselines.als_scores(val_hist, items, reg, alpha), s.valid_set)
        if best is None or val["ndcg_at_10"] > best[1]["ndcg_at_10"]:
            test = _metrics(baselines.als_scores(test_hist, items, reg, alpha), s.test_set)
            best = (spec, val, test)
    assert best is not None
    out["als"] = {"factors/reg/alpha": best[0], "validation": best[1], "test": best[2]}
    return out


def run_sparse_ease(data_dir: Path, lambdas: list[float]) -> dict[str, Any]:
    """EASE tuned on validation (NDCG@10), scored on test, in float32 with sparse histories.

    The dense path of benchmarks/quality_ml100k.py holds users x items float matrices (several
    GiB on Amazon Beauty, 22K x 12K); here only the items x items matrices are dense.
    """
    import scipy.sparse as sp

    s = Splits(data_dir)

    def matrix(users: list[str], parts: list[dict[str, Any]]) -> sp.csr_matrix:
        row = {u: r for r, u in enumerate(users)}
        pairs = {
            (row[u], s.position[i])
            for part in parts
            for u, i in zip(_ids(part["user_id"]), _ids(part["item_id"]), strict=True)
            if u in row and i in s.position
        }
        r, c = np.array(sorted(pairs)).T
        shape = (len(users), len(s.items))
        return sp.csr_matrix((np.ones(len(r), np.float32), (r, c)), shape=shape)

    users = sorted(set(_ids(s.train["user_id"])))
    x = matrix(users, [s.train])
    val_hist = matrix(s.valid_set.users, [s.train])
    test_hist = matrix(s.test_set.users, [s.train, s.validation])
    gram = (x.T @ x).toarray().astype(np.float32)
    best: tuple[Any, ...] | None = None
    for l2 in lambdas:
        diagonal = np.diag(gram).copy()
        gram[np.diag_indices_from(gram)] += l2
        p = np.linalg.inv(gram)
        gram[np.diag_indices_from(gram)] = diagonal
        b = -p / np.diag(p)[None, :]
        del p
        np.fill_diagonal(b, 0.0)
        val = _metrics(lambda rows, b=b: np.asarray(val_hist[rows] @ b), s.valid_set)
        if best is None or val["ndcg_at_10"] > best[1]["ndcg_at_10"]:
            test = _metrics(lambda rows, b=b: np.asarray(test_hist[rows] @ b), s.test_set)
            best = (l2, val, test)
        del b
    assert best is not None
    popularity = _metrics(ev.popularity_scores(s.counts), s.test_set)
    return {
        "popularity": {"test": popularity},
        "ease": {"lambda": best[0], "validation": best[1], "test": best[2]},
    }


def main() -> int:
    """Run the variants (and baselines) and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="a preprocessed data/<date> folder")
    parser.add_argument("--config", default=str(REPO / "configs/default.yaml"))
    parser.add_argument("--variant", action="append", default=[], help="name=key:value,...")
    parser.add_argument("--test", action="store_true", help="also score the test split")
    parser.add_argument("--baselines", action="store_true", help="EASE/ALS/popularity on test")
    parser.add_argument("--sparse-ease", action="store_true", help="EASE only, float32")
    parser.add_argument("--ease-lambda", type=float, action="append", default=[])
    parser.add_argument("--als", action="append", default=[], help="factors/reg/alpha")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("recsys.training.trainer").setLevel(logging.INFO)
    base = load_config(args.config)
    data_dir = Path(args.data_dir)
    stats = read_stats(data_dir).as_dict()
    out_path = Path(args.out)
    results: dict[str, Any] = (
        json.loads(out_path.read_text()) if out_path.is_file() else {"variants": {}}
    )
    results["data"] = {
        "dir": str(data_dir),
        "items": stats["items"],
        "users": stats["users"],
        "splits": stats["splits"],
    }
    if args.sparse_ease:
        results["baselines"] = run_sparse_ease(data_dir, args.ease_lambda or [100.0, 400.0])
        out_path.write_text(json.dumps(results, indent=2) + "\n")
    if args.baselines:
        lambdas = args.ease_lambda or [50.0, 100.0, 200.0, 400.0, 800.0, 1600.0]
        als = args.als or [f"{f}/{r}/{a}" for f in (64, 128) for r in (1, 10) for a in (5, 20)]
        results["baselines"] = run_baselines(data_dir, lambdas, als)
        out_path.write_text(json.dumps(results, indent=2) + "\n")
    for spec in args.variant:
        name, config = variant_config(base, spec)
        with tempfile.TemporaryDirectory():
            results["variants"][name] = {"spec": spec, **run_variant(config, data_dir, args.test)}
        print(name, json.dumps(results["variants"][name]), flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
