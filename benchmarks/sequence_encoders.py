"""Query encoders and negatives on validation (to choose defaults), then the test split.

For one data set already preprocessed by the Beam job (`--data-dir`, e.g. from
`recsys preprocess --config configs/movielens-100k.yaml`), trains each named variant of
configs/default.yaml's model/training sections (only the data differs, as when the project is
scored) and reports, on the VALIDATION split (each user's item before the test item, training
items removed, exact ranking over the catalog), Recall@10/50 and NDCG@10 of the weights kept,
with the cost: wall seconds per epoch (training steps only) and examples/s. With `--test`, the
named variants and EASE / ALS (tuned on validation, benchmarks/quality_ml100k.py) are also
scored on the test split, the protocol of docs/ARCHITECTURE.md.

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

import recsys  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)

# isort: split
import tensorflow as tf
import yaml

from recsys import evaluation as ev
from recsys.config import EvaluationConfig, RecsysConfig, load_config
from recsys.training import trainer
from recsys.training.dataset import load_split

REPO = Path(__file__).resolve().parent.parent
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
    users = model.user_embeddings(callback.eval_set.users, callback.histories)
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


def run_baselines(data_dir: Path) -> dict[str, Any]:
    """Popularity, EASE and ALS tuned on validation, scored on test (quality_ml100k.py)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from quality_ml100k import Splits
    from quality_ml100k import run_baselines as baselines

    return baselines(Splits(data_dir))


def main() -> int:
    """Run the variants (and baselines) and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="a preprocessed data/<date> folder")
    parser.add_argument("--config", default=str(REPO / "configs/default.yaml"))
    parser.add_argument("--variant", action="append", default=[], help="name=key:value,...")
    parser.add_argument("--test", action="store_true", help="also score the test split")
    parser.add_argument("--baselines", action="store_true", help="EASE/ALS/popularity on test")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("recsys.training.trainer").setLevel(logging.INFO)
    base = load_config(args.config)
    data_dir = Path(args.data_dir)
    stats = json.loads((data_dir / "stats.json").read_text())
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
    if args.baselines:
        results["baselines"] = run_baselines(data_dir)
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
