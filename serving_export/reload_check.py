"""Child process of verify_export: load SavedModels with TensorFlow alone and run them.

Run as `python -I reload_check.py REQUEST.json` (by path, so the serving_export package and
recsys are never imported: the point is to prove the exports need nothing but TensorFlow, as
in TF Serving). Keep this file free of project imports.

REQUEST.json: {"models": {name: dir}, "user_ids": [str], "histories": [[str]] (optional, one
per user, padded here with ""), "outputs": path.npz, "report": path.json}
Writes `<name>.<output>` arrays to the .npz (strings as unicode arrays, so no pickle is needed)
and, per model, the serving_default signature's inputs and outputs to the report.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

SIGNATURE = "serving_default"


def describe(specs: dict[str, tf.TensorSpec]) -> dict[str, dict[str, Any]]:
    """Name -> {dtype, shape} of a signature's tensors (None for unknown dimensions)."""
    return {
        name: {"dtype": spec.dtype.name, "shape": spec.shape.as_list()}
        for name, spec in sorted(specs.items())
    }


def as_numpy(tensor: tf.Tensor) -> np.ndarray:
    """A numpy array; byte strings decoded to unicode so np.load needs no pickle."""
    array = tensor.numpy()
    if tensor.dtype == tf.string:
        return np.vectorize(lambda b: b.decode("utf-8"), otypes=[str])(array).astype(str)
    return array


def padded(histories: list[list[str]], rows: int) -> tf.Tensor:
    """[rows, longest] string tensor of the histories, right-padded with "" as clients do."""
    width = max((len(h) for h in histories), default=0)
    return tf.constant(
        [h + [""] * (width - len(h)) for h in histories] or [[]] * rows,
        dtype=tf.string,
        shape=[rows, width],
    )


def run_model(
    model_dir: str, user_ids: list[str], histories: list[list[str]] | None = None
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Load one SavedModel, describe its serving signature and call it on `user_ids`."""
    start = time.perf_counter()
    loaded = tf.saved_model.load(model_dir)
    if SIGNATURE not in loaded.signatures:
        raise KeyError(f"{model_dir}: no {SIGNATURE} signature (has {list(loaded.signatures)})")
    fn = loaded.signatures[SIGNATURE]
    _, inputs = fn.structured_input_signature
    args = {"user_id": tf.constant(user_ids, dtype=tf.string)}
    if "history" in inputs:
        args["history"] = padded(histories or [[] for _ in user_ids], len(user_ids))
    outputs = fn(**args)
    info = {
        "inputs": describe(inputs),
        "outputs": describe(fn.structured_outputs),
        "seconds": round(time.perf_counter() - start, 3),
    }
    return info, {name: as_numpy(value) for name, value in outputs.items()}


def main(argv: list[str]) -> int:
    """Entry point: `reload_check.py REQUEST.json`."""
    if len(argv) != 1:
        print(
            "usage: python -I reload_check.py REQUEST.json (see the module docstring)",
            file=sys.stderr,
        )
        return 2
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    report: dict[str, Any] = {"tensorflow": tf.__version__, "models": {}}
    arrays: dict[str, np.ndarray] = {}
    for name, model_dir in request["models"].items():
        info, outputs = run_model(model_dir, request["user_ids"], request.get("histories"))
        report["models"][name] = info
        arrays.update({f"{name}.{key}": value for key, value in outputs.items()})
    # Evidence for the report that nothing from the project was needed to serve.
    report["project_modules_loaded"] = sorted(
        m for m in sys.modules if m.split(".")[0] in ("recsys", "serving_export")
    )
    np.savez(request["outputs"], **arrays)
    Path(request["report"]).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
