"""Incremental nights against a full retrain each night, on a log split by time.

For each run date D_1 .. D_k (a night each), the Beam job preprocesses the log up to that day
(leave-last-out: each user's newest item up to D is that night's test item), then two chains
train:

- full: a fresh model on every training position, every night;
- incremental (`training.mode: incremental`): night 1 in full, then each night starts from
  the previous night's model and trains only the positions newer than the previous night's
  data plus a `training.replay_fraction` sample of older ones.

Both use the config's model and training settings with `training.refit: off` (the model scored
is the one trained), early stopping on each night's validation items. Each night reports the
TEST split metrics (docs/PROTOCOL.md) of both models on that night's data, the positions each
trained and its training seconds, so a user can weigh quality against cost.

Usage:
    .venv/bin/python benchmarks/incremental.py --config configs/movielens-100k.yaml \\
        --input-path PATH/u.data --first-date 1998-03-10 --nights 7 --step-days 7 \\
        --root /tmp/incremental-ml --out benchmarks/results/incremental_ml100k.json
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
import tensorflow as tf
import yaml

from conductor import stages
from recsys.core.config import RecsysConfig, load_config, set_values
from recsys.core.layout import SUCCESS, Workdir
from recsys.core.records import read_stats
from recsys.model_evaluation import evaluate_model
from recsys.training.trainer import IncrementalStart, train

REPORTED = ("recall_at_10", "recall_at_50", "ndcg_at_10")


def night_data(
    config: RecsysConfig, input_path: str | None, date: dt.date, workdir: Workdir
) -> Path:
    """The data folder of one night (preprocessed once per root)."""
    data_dir = workdir.data(date)
    if not (data_dir / SUCCESS).is_file():
        # Rows after the night's date are not there yet: rejected, not a data problem.
        lenient = set_values(config, {"preprocess.max_rejected_fraction": 1.0})
        stages.preprocess(lenient.with_input(input_path), workdir, date, input_path)
    return data_dir


def fit(
    config: RecsysConfig, data_dir: Path, out: Path, start: IncrementalStart | None
) -> dict[str, Any]:
    """Train one night's model, save it, score it on the night's test split."""
    tf.keras.backend.clear_session()
    begin = time.perf_counter()
    result = train(config, data_dir, start=start)
    seconds = time.perf_counter() - begin
    result.model.save(out)
    _, evaluated = evaluate_model(config, out, data_dir)
    return {
        "positions_trained": result.examples,
        "epochs_run": len(result.epoch_seconds),
        "train_seconds": round(seconds, 1),
        "test": {k: round(evaluated.metrics[k], 4) for k in REPORTED},
    }


def main() -> int:
    """Run both chains night by night and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--input-path", default=None, help="the raw log (none: synthetic data)")
    parser.add_argument("--first-date", required=True)
    parser.add_argument("--nights", type=int, default=7)
    parser.add_argument("--step-days", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="key=value (YAML value)")
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("recsys.training.trainer").setLevel(logging.INFO)
    # One model per night on both chains (an incremental night skips the candidates anyway).
    settings: dict[str, Any] = {
        "training.refit": "off",
        "training.candidates": [],
        "training.seed": args.seed,
    }
    for item in args.set:
        key, _, value = item.partition("=")
        settings[key] = yaml.safe_load(value)
    base = set_values(load_config(args.config), settings)
    incremental = set_values(base, {"training.mode": "incremental"})
    root = Path(args.root)
    workdir = Workdir(root / "work")
    first = dt.date.fromisoformat(args.first_date)
    dates = [first + dt.timedelta(days=args.step_days * n) for n in range(args.nights)]
    results: dict[str, Any] = {"config": args.config, "settings": settings, "nights": []}
    previous: tuple[Path, int] | None = None
    for date in dates:
        data_dir = night_data(base, args.input_path, date, workdir)
        stats = read_stats(data_dir).as_dict()
        night: dict[str, Any] = {"date": date.isoformat(), "splits": stats["splits"]}
        night["full"] = fit(base, data_dir, root / "models" / "full" / date.isoformat(), None)
        start = None if previous is None else IncrementalStart(*previous)
        model_dir = root / "models" / "incremental" / date.isoformat()
        night["incremental"] = fit(incremental, data_dir, model_dir, start)
        previous = (model_dir, int(stats["max_timestamp"]))
        results["nights"].append(night)
        print(json.dumps(night), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
