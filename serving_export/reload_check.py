"""Child process of verify_export: load SavedModels with TensorFlow alone and run them.

Run as `python -I reload_check.py REQUEST.json` (by path, so the serving_export package and
recsys are never imported: the point is to prove the exports need nothing but TensorFlow, as
in TF Serving). Keep this file free of project imports.

REQUEST.json: {"models": {name: dir}, "calls": [{"id": str, "model": name, "signature": str,
"inputs": {input: {"dtype": "string" | "int32", "shape": [..], "values": [..]}}}],
"outputs": path.npz, "report": path.json}; string values are base64 (tf.Examples are bytes).
Writes `<call id>.<output>` arrays to the .npz (strings as unicode arrays, so no pickle is
needed) and, per model, every signature's inputs and outputs, and the outcome of replaying
its TF Serving warmup records (assets.extra/tf_serving_warmup_requests), to the report.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

WARMUP = Path("assets.extra") / "tf_serving_warmup_requests"


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


def to_tensor(spec: dict[str, Any]) -> tf.Tensor:
    """One encoded input (see the module docstring) as a tensor."""
    if spec["dtype"] == "string":
        values = [base64.b64decode(v) for v in spec["values"]]
        return tf.constant(values, dtype=tf.string, shape=spec["shape"])
    return tf.constant(spec["values"], dtype=spec["dtype"], shape=spec["shape"])


def replay_warmup(model_dir: str, loaded: Any) -> dict[str, Any]:
    """Replay the model's warmup PredictionLogs against the loaded model, as TF Serving does."""
    path = Path(model_dir) / WARMUP
    if not path.is_file():
        return {"file": False, "requests": 0}
    from tensorflow_serving.apis import prediction_log_pb2

    count = 0
    for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
        request = prediction_log_pb2.PredictionLog.FromString(record).predict_log.request
        fn = loaded.signatures[request.model_spec.signature_name or "serving_default"]
        fn(**{key: tf.constant(tf.make_ndarray(p)) for key, p in request.inputs.items()})
        count += 1
    return {"file": True, "requests": count}


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
    loaded = {}
    for name, model_dir in request["models"].items():
        start = time.perf_counter()
        loaded[name] = tf.saved_model.load(model_dir)
        signatures = {
            sig: {
                "inputs": describe(fn.structured_input_signature[1]),
                "outputs": describe(fn.structured_outputs),
            }
            for sig, fn in loaded[name].signatures.items()
        }
        report["models"][name] = {
            "signatures": signatures,
            "warmup": replay_warmup(model_dir, loaded[name]),
            "seconds": round(time.perf_counter() - start, 3),
        }
    for call in request["calls"]:
        fn = loaded[call["model"]].signatures[call["signature"]]
        outputs = fn(**{key: to_tensor(spec) for key, spec in call["inputs"].items()})
        arrays.update({f"{call['id']}.{key}": as_numpy(value) for key, value in outputs.items()})
    # Evidence for the report that nothing from the project was needed to serve.
    report["project_modules_loaded"] = sorted(
        m for m in sys.modules if m.split(".")[0] in ("recsys", "serving_export")
    )
    np.savez(request["outputs"], allow_pickle=False, **arrays)
    Path(request["report"]).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
