"""One causal pass per sequence against one example per prefix: speed and validation quality.

For one data set (a shipped config and its raw log), the Beam job runs once (per-row histories
and sequence records in one data folder); then, for each seed, the same config trains its
first fit (early stopping on validation, no refit) once per `training.input`, interleaved in
one process: `rows` (every interaction an example whose stored history is encoded on its own)
and `sequences` (windows of each user's sequence, every position trained in one causal pass).
Both train on the same training positions with the same model, loss and negatives.

Reported per run: epochs, the best epoch, seconds per epoch of training steps after the first
(which traces the graph), trained positions per second, and the kept weights' VALIDATION
metrics (each user's item before the test item, training items removed, exact ranking over
the catalog; the same validation examples for both inputs). The summary gives the mean over
seeds and the positions/s ratio.

Usage:
    .venv/bin/python benchmarks/one_pass.py --config configs/movielens-100k.yaml \\
        --input-path PATH/u.data --date 1998-04-23 --root /tmp/one-pass-ml \\
        --seeds 0 1 2 --out benchmarks/results/one_pass_ml100k.json \\
        [--set model.negatives=mixed ...] [--inputs rows sequences]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
import numpy as np
import tensorflow as tf
import yaml

from conductor import stages
from recsys import evaluation as ev
from recsys.core.config import EvaluationConfig, RecsysConfig, load_config, set_values
from recsys.core.layout import SUCCESS, Workdir
from recsys.core.records import read_stats
from recsys.training import trainer
from recsys.training.windows import TrainingSequences

EVAL = EvaluationConfig(ks=[10, 50], ndcg_k=10, mrr_k=100, coverage_k=10)
REPORTED = ("recall_at_10", "recall_at_50", "ndcg_at_10")


def prepare(config: RecsysConfig, input_path: str, date: dt.date, root: Path) -> Path:
    """The data folder (preprocessed once per root)."""
    workdir = Workdir(root / "work")
    data_dir = workdir.data(date)
    if not (data_dir / SUCCESS).is_file():
        stages.preprocess(config.with_input(input_path), workdir, date)
    return data_dir


def validation_metrics(config: RecsysConfig, data_dir: Path, model: Any) -> dict[str, float]:
    """The model's validation metrics from the sequence records (the same set for both inputs:
    each validation item with the `model.history_length` items before it)."""
    sequences = TrainingSequences.load(data_dir, model.config.oov_buckets)
    callback = trainer.validation_callback(config, data_dir, model, sequences=sequences)
    assert callback is not None, "the data has no validation split"
    scores = ev.dot_product_scores(callback.queries(model), model.item_embeddings())
    metrics = ev.evaluate(scores, callback.eval_set, EVAL).metrics
    return {k: round(metrics[k], 4) for k in REPORTED}


def run(config: RecsysConfig, data_dir: Path) -> dict[str, Any]:
    """Train one first fit; its cost and validation quality."""
    tf.keras.backend.clear_session()
    start = time.perf_counter()
    result = trainer.train(config, data_dir)
    wall = time.perf_counter() - start
    epochs = len(result.epoch_seconds)
    steady = result.epoch_seconds[1:] or result.epoch_seconds
    per_epoch = result.examples / max(epochs, 1)
    return {
        "epochs_run": epochs,
        "best_epoch": result.best_epoch,
        "positions_per_epoch": round(per_epoch),
        "seconds_per_epoch": round(float(np.mean(steady)), 2),
        "positions_per_second": round(per_epoch / float(np.mean(steady))),
        "wall_seconds": round(wall, 1),
        "validation": validation_metrics(config, data_dir, result.model),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds per input, and sequences / rows ratios."""
    out: dict[str, Any] = {}
    for mode in sorted({r["input"] for r in runs}):
        mine = [r for r in runs if r["input"] == mode]
        out[mode] = {
            "seeds": len(mine),
            "positions_per_second": round(
                float(np.mean([r["positions_per_second"] for r in mine]))
            ),
            "seconds_per_epoch": round(float(np.mean([r["seconds_per_epoch"] for r in mine])), 2),
            "epochs_run": round(float(np.mean([r["epochs_run"] for r in mine])), 2),
            **{k: round(float(np.mean([r["validation"][k] for r in mine])), 4) for k in REPORTED},
        }
    if {"rows", "sequences"} <= out.keys():
        rows, seqs = out["rows"], out["sequences"]
        out["speedup"] = round(seqs["positions_per_second"] / rows["positions_per_second"], 2)
        out["ndcg_at_10_change"] = round(seqs["ndcg_at_10"] / rows["ndcg_at_10"] - 1, 4)
    return out


def _pairs(items: list[str]) -> dict[str, Any]:
    """`key=value` arguments as settings (values parsed as YAML)."""
    pairs = {}
    for item in items:
        key, _, value = item.partition("=")
        pairs[key] = yaml.safe_load(value)
    return pairs


def main() -> int:
    """Run the interleaved fits and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--input-path", required=True, help="the raw log the config reads")
    parser.add_argument("--date", required=True, help="run date: the log up to this day")
    parser.add_argument("--root", required=True, help="scratch folder (the data is kept)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--inputs", nargs="+", default=["rows", "sequences"])
    parser.add_argument("--set", action="append", default=[], help="key=value (YAML value)")
    parser.add_argument(
        "--rows-set",
        action="append",
        default=[],
        help="key=value for the rows runs only (e.g. the per-prefix path's former settings)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("recsys.training").setLevel(logging.INFO)
    base = load_config(args.config)
    # One first fit per input: the default candidates would add fits the ratio is not about.
    settings = {"training.refit": "off", "training.candidates": [], **_pairs(args.set)}
    rows_settings = _pairs(args.rows_set)
    base = set_values(base, settings)
    data_dir = prepare(base, args.input_path, dt.date.fromisoformat(args.date), Path(args.root))
    out_path = Path(args.out)
    results: dict[str, Any] = {
        "config": args.config,
        "settings": settings,
        "rows_settings": rows_settings,
        "data": read_stats(data_dir).as_dict()["splits"],
        "runs": [],
    }
    for seed in args.seeds:
        for mode in args.inputs:
            extra = rows_settings if mode == "rows" else {}
            config = set_values(base, {"training.input": mode, "training.seed": seed, **extra})
            record = {"input": mode, "seed": seed, **run(config, data_dir)}
            results["runs"].append(record)
            print(json.dumps(record), flush=True)
            results["summary"] = summary(results["runs"])
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
