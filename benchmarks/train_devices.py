"""Training throughput across device layouts and precisions, measured in one run.

Made for a machine with GPUs and TensorFlow (the CI machine has neither): it trains our
two-tower model on a generated log with every combination of

    precision in {float32, mixed_bfloat16, mixed_float16 (GPU only: emulated on CPU)}
    strategy  in {one_device, mirrored (all GPUs; skipped with fewer than 2)}
    input     in {sequences (one causal pass per window), rows (one example per prefix)}

and reports examples (trained positions) per second after the first epoch (the first
includes tracing) and the ratio of each variant to float32 on one device with the same
input, with the GPU names, the XLA and in-memory-cache
settings each variant ran with (`--jit`, `--cache`: the trainer's `training.jit_compile`
and `training.cache`; auto = XLA on one replica only, cache under 1 GiB) and the final loss
(a sanity check that mixed precision trains). On CPU it still runs (`--smoke`, small data),
which is how the script itself is kept working.

Usage (GPU host, from the repository root, after `make install`):
    .venv/bin/python benchmarks/train_devices.py --users 200000 --items 50000 \
        --per-user 50 --epochs 3 --batch-size 8192 --out benchmarks/results/train_devices.json
    # the same with XLA forced on for the mirrored variants too, data held in memory:
    .venv/bin/python benchmarks/train_devices.py --jit on --cache memory ...
    .venv/bin/python benchmarks/train_devices.py --smoke        # CPU, about a minute
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
import tensorflow as tf

from conductor import stages
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.layout import Workdir


def base_config(args: argparse.Namespace) -> RecsysConfig:
    """A synthetic-data config sized by the command line."""
    days = 14
    return parse_config(
        {
            "model_name": "device-benchmark",
            "data": {
                "source": "synthetic",
                "synthetic": {
                    "num_users": args.users,
                    "num_items": args.items,
                    "mean_interactions_per_user": args.per_user,
                    "days": days,
                    "start_date": "2026-01-01",
                },
            },
            "training": {
                "epochs": args.epochs,
                "batch_size": args.batch_size,
                "learning_rate": args.learning_rate,
                "jit_compile": args.jit,
                "cache": args.cache,
                "learning_rate_schedule": "constant",
                "early_stopping_patience": 0,
                "refit": "off",
                "candidates": [],
            },
            # The model and fits these step times were measured on, pinned: the code's
            # defaults are the benchmarked model (transformer, full softmax, refit).
            "model": {
                "query_encoder": "mean",
                "user_embedding": True,
                "negatives": args.negatives,
            },
        }
    )


def variants(gpus: int, inputs: list[str]) -> list[tuple[str, str, str]]:
    """(input, strategy, precision) triples this machine can run."""
    precisions = ["float32", "mixed_bfloat16"] + (["mixed_float16"] if gpus else [])
    strategies = ["one_device"] + (["mirrored"] if gpus >= 2 else [])
    return [(i, s, p) for i in inputs for s in strategies for p in precisions]


def run_variant(
    config: RecsysConfig,
    workdir: Workdir,
    data_dir: Path,
    source: str,
    strategy: str,
    precision: str,
) -> dict[str, Any]:
    """Train once with the given layout; examples/s over the epochs after the first."""
    update = {"strategy": strategy, "precision": precision, "input": source}
    if source == "sequences" and config.training.jit_compile == "on":
        update["jit_compile"] = "auto"  # the one-pass step is not XLA-compilable
    training = config.training.model_copy(update=update)
    config = config.model_copy(update={"training": training})
    _, result = stages.train(config, workdir, DATE, data_dir)
    return {
        "input": source,
        "strategy": result.strategy,
        "replicas": result.replicas,
        "precision": result.precision,
        "jit_compile": result.jit_compile,
        "cached": result.cached,
        "examples_per_second": round(result.steady_examples_per_second),
        "final_loss": round(result.history["loss"][-1], 4),
    }


DATE = dt.date(2026, 1, 14)


def main() -> int:
    """Run every variant and print/write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=200_000)
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--per-user", type=float, default=50)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--jit", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--cache", choices=["auto", "memory", "none"], default="auto")
    parser.add_argument("--negatives", default="auto", help="model.negatives")
    parser.add_argument("--inputs", nargs="+", default=["sequences", "rows"])
    parser.add_argument("--smoke", action="store_true", help="tiny data for a CPU check")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.users, args.items, args.per_user, args.epochs, args.batch_size = 500, 200, 10, 2, 256
    logging.basicConfig(level=logging.WARNING)
    gpus = len(tf.config.list_physical_devices("GPU"))
    config = base_config(args)
    results: dict[str, Any] = {
        "gpus": gpus,
        "gpu_names": [
            tf.config.experimental.get_device_details(g).get("device_name", g.name)
            for g in tf.config.list_physical_devices("GPU")
        ],
        "tensorflow": tf.__version__,
        "args": vars(args),
        "variants": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Workdir(Path(tmp))
        data_dir, stats = stages.preprocess(config, workdir, DATE)
        results["train_examples"] = stats["splits"]["train"]
        for source, strategy, precision in variants(gpus, args.inputs):
            results["variants"].append(
                run_variant(config, workdir, data_dir, source, strategy, precision)
            )
    for variant in results["variants"]:
        reference = next(
            v["examples_per_second"] for v in results["variants"] if v["input"] == variant["input"]
        )
        variant["speedup_vs_float32_one_device"] = round(
            variant["examples_per_second"] / reference, 2
        )
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
