"""Query vectors of a log's validation users: the shipped encoding against two plain ones.

`TrainedModel.query_embeddings` (what every epoch's validation, the evaluation and the
embeddings export call) runs the query tower as one traced graph over groups of rows whose
histories have the same width, each trimmed of its padding. This script times it, on a data
folder's validation positions and a trained model, against two references computed on the
same inputs in the same process:

- `eager, full width`: the tower called eagerly on [rows, history_length] chunks of
  `encode_rows()` rows (the implementation before the shipped one);
- `graph, full width`: the same chunks through one `tf.function` (the strongest plain
  reference: graph mode without the width groups).

Each variant runs once to warm up (tracing included), then `--repeats` times; the best
time counts. The largest difference from the eager vectors is reported for each.

    .venv/bin/python benchmarks/query_encoding.py --data-dir WORKDIR/data/DATE \\
        --model WORKDIR/runs/DATE/RUN/model --out benchmarks/results/query_encoding_X.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, the repository root is not on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
import numpy as np
import tensorflow as tf

from recsys import evaluation as ev
from recsys.model import HISTORY_INDEX, USER_INDEX, TrainedModel
from recsys.training.windows import TrainingSequences

Encode = Callable[[np.ndarray, np.ndarray], np.ndarray]


def full_width(call: Callable[[dict[str, tf.Tensor]], tf.Tensor], rows: int) -> Encode:
    """Encode [n, history_length] histories in chunks of `rows` through `call`."""

    def encode(users: np.ndarray, history: np.ndarray) -> np.ndarray:
        parts = [
            call(
                {
                    USER_INDEX: tf.constant(users[i : i + rows]),
                    HISTORY_INDEX: tf.constant(history[i : i + rows]),
                }
            ).numpy()
            for i in range(0, len(users), rows)
        ]
        return np.concatenate(parts).astype(np.float32)

    return encode


def best_seconds(encode: Encode, users: np.ndarray, history: np.ndarray, repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one warm-up call."""
    encode(users, history)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        encode(users, history)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    """Time the three encodings; print a table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="a preprocessed data folder")
    parser.add_argument("--model", type=Path, required=True, help="a run's model/ folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = TrainedModel.load(args.model)
    cfg = model.config
    sequences = TrainingSequences.load(args.data_dir, cfg.oov_buckets)
    examples = ev.eval_examples(sequences.sequences, "validation", cfg.oov_buckets)
    history = examples.histories(sequences.sequences.items, cfg.history_length)
    users = sequences.user_index[examples.rows]
    tower = model.query_tower
    graph = tf.function(lambda inputs: tower(inputs, training=False), reduce_retracing=True)
    rows = model.encode_rows()
    variants: dict[str, Encode] = {
        "eager, full width": full_width(lambda inputs: tower(inputs), rows),
        "graph, full width": full_width(graph, rows),
        "shipped: graph, width groups": model.query_embeddings,
    }
    reference = variants["eager, full width"](users, history)
    seconds = {name: best_seconds(f, users, history, args.repeats) for name, f in variants.items()}
    eager, plain_graph = seconds["eager, full width"], seconds["graph, full width"]
    results = []
    for name, encode in variants.items():
        results.append(
            {
                "variant": name,
                "seconds": round(seconds[name], 3),
                "users_per_second": round(len(users) / seconds[name]),
                "speedup_vs_eager": round(eager / seconds[name], 2),
                "speedup_vs_graph": round(plain_graph / seconds[name], 2),
                "max_abs_diff": float(np.abs(encode(users, history) - reference).max()),
            }
        )
        print(results[-1], flush=True)
    filled = float((history >= 0).sum() / max(history.size, 1))
    report = {
        "command": "benchmarks/query_encoding.py " + " ".join(sys.argv[1:]),
        "model": {
            "query_encoder": cfg.query_encoder,
            "history_length": cfg.history_length,
            "embedding_dim": cfg.embedding_dim,
        },
        "validation_users": len(users),
        "history_slots_filled": round(filled, 3),
        "threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
