"""Time and peak memory of export's `read_activity` on one preprocessed data folder.

Usage (DATA_DIR = a `data/<date>` folder written by `recsys preprocess`, e.g. one of
benchmarks/scale.py's):
    .venv/bin/python benchmarks/export_activity.py DATA_DIR [--history-length 20]
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import (the TFRecord reader)

# isort: split
from recsys.core.layout import DataFile
from recsys.model.inputs import read_vocab
from serving_export.activity import read_activity


def main() -> None:
    """Read the folder's vocabularies, then time one `read_activity` call."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--history-length", type=int, default=20)
    args = parser.parse_args()
    users = read_vocab(args.data_dir / DataFile.USER_VOCAB)
    items = read_vocab(args.data_dir / DataFile.ITEM_VOCAB)
    start = time.perf_counter()
    read_activity(args.data_dir, users, items, args.history_length)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{len(users)} users, {len(items)} items: {seconds:.1f} s, peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
