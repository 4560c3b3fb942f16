"""Do user side features help on MovieLens 100K? The default config with and without them.

Protocol (docs/PROTOCOL.md, as benchmarks/quality_ml100k.py): our Beam job's leave-last-out
split of `u.data` (with `u.user` joined into user_features.parquet: age, gender, occupation,
zip code), the test item ranked exactly against the whole catalog with train and validation
items removed. For each seed, `configs/movielens-100k.yaml` is trained with
`model.user_features` false and true; popularity is the baseline of the same evaluation.

Usage:
    .venv/bin/python benchmarks/user_features_ml100k.py --data datasets/ml-100k \
        --out benchmarks/results/user_features_ml100k.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
import numpy as np
import tensorflow as tf

from conductor import stages
from recsys.core.config import load_config
from recsys.core.layout import Workdir

REPO = Path(__file__).resolve().parent.parent
DATE = dt.date(1998, 4, 30)  # after the last rating in u.data
REPORTED = ("recall_at_10", "recall_at_50", "ndcg_at_10")


def main() -> int:
    """Train both variants per seed; print and write the test metrics and their means."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO / "datasets/ml-100k"))
    parser.add_argument("--config", default=str(REPO / "configs/movielens-100k.yaml"))
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/user_features_ml100k.json"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = load_config(args.config)
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Workdir(Path(tmp))
        data_dir, _ = stages.preprocess(config, workdir, DATE, str(Path(args.data) / "u.data"))
        for seed in args.seeds:
            for variant, on in (("without", False), ("with", True)):
                cfg = config.model_copy(
                    update={
                        "model": config.model.model_copy(update={"user_features": on}),
                        "training": config.training.model_copy(update={"seed": seed}),
                    }
                )
                tf.keras.utils.set_random_seed(seed)
                run_dir, _ = stages.train(cfg, workdir, DATE, data_dir)
                _, report = stages.evaluate(cfg, workdir, DATE, run_dir.name)
                runs[variant].append(
                    {"seed": seed, **{k: round(report.model[k], 4) for k in REPORTED}}
                )
                popularity = {k: round(report.baselines["popularity"][k], 4) for k in REPORTED}
    results = {
        "protocol": __doc__.split("\n\n")[1].replace("\n", " "),
        "popularity": popularity,
        "mean": {
            variant: {k: round(float(np.mean([r[k] for r in rows])), 4) for k in REPORTED}
            for variant, rows in runs.items()
        },
        "runs": runs,
    }
    text = json.dumps(results, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
