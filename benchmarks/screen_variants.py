"""Screen config variants on VALIDATION only: ours' pipeline on a log without its test rows.

For a dataset of `benchmarks/quality.py` (`ml-100k`, `amazon-beauty`, or a CSV path) the log
minus every protocol test row is preprocessed once; each variant (a dict merged onto
configs/default.yaml, data section replaced as in quality.py) is trained and scored by the
pipeline's own evaluate stage, whose test item is the protocol's validation item. The test
split is never read. One JSON line per variant is appended to `--out`.

Usage:
    .venv/bin/python benchmarks/screen_variants.py --data amazon-beauty \\
        --variants '{"user_table": {"model": {"user_embedding": true}}}' --out screen.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
from benchmarks import quality
from conductor import stages
from recsys.core.config import parse_config


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` merged in, nested dicts key by key."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge(out[key], value) if nested else value
    return out


def screen(name: str, variants: dict[str, Any], root: Path, out: Path, seed: int) -> None:
    """Train and validate each variant; append its figures to `out`."""
    bench = quality.Bench(name)
    ours = quality.Ours(bench, root)
    base = quality.REPO / "configs" / "default.yaml"
    data = root / "data"
    for label, over in variants.items():
        raw = merge(quality.pipeline_config(bench, base, ours.log_csv, seed), over)
        config = parse_config(raw, str(base))
        if not (data / "stats.json").exists():
            stages.preprocess(config, ours.workdir, ours.date, output=data)
        start = time.perf_counter()
        run_dir, result = stages.train(config, ours.workdir, ours.date, data)
        seconds = time.perf_counter() - start
        _, report = stages.evaluate(config, ours.workdir, ours.date, run_dir.name)
        record = {
            "data": name,
            "label": label,
            "override": over,
            "seed": seed,
            "validation": {k: round(report.model[k], 4) for k in quality.REPORTED},
            "epochs_run": len(result.epoch_seconds),
            "best_epoch": result.best_epoch,
            "refit_epochs": result.refit_epochs,
            "seconds_per_epoch": round(statistics.median(result.epoch_seconds), 1),
            "train_seconds": round(seconds),
        }
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


def main() -> int:
    """Parse the arguments and screen the variants."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="ml-100k, amazon-beauty, or a CSV path")
    parser.add_argument("--variants", required=True, help='JSON {"label": {overrides}, ...}')
    parser.add_argument("--out", required=True, help="JSON lines file to append to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="scratch folder (kept; default a new temp folder)")
    args = parser.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="recsys-screen-"))
    screen(args.data, json.loads(args.variants), root, Path(args.out), args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
