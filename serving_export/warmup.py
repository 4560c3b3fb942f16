"""TF Serving warmup records: `assets.extra/tf_serving_warmup_requests` in each SavedModel.

TF Serving replays these PredictionLog records (tensorflow-serving-api protos) when it loads a
version, before the version takes traffic, so the first real requests do not pay for graph
initialisation and lookup-table loading. Each signature gets a batch-1 request and a mixed
batch (unknown ids, empty and long histories, k outside [1, max_k]) so every branch is warm.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recsys.model import TrainedModel
from serving_export import samples
from serving_export.signatures import SIGNATURES

WARMUP_DIR = "assets.extra"
WARMUP_FILE = "tf_serving_warmup_requests"
MIXED_BATCH = 8

Request = tuple[str, dict[str, np.ndarray]]


def warmup_requests(model: TrainedModel, name: str, max_k: int) -> list[Request]:
    """(signature, inputs) pairs for model `name`: batch 1 and a mixed batch per signature."""
    users = samples.sample_users(model, model.users[:1])
    mixed = users[:1] + users[-MIXED_BATCH + 1 :]  # a known user, unknown ones, ""
    histories = samples.sample_histories(model, len(mixed))
    items = samples.sample_items(model)
    count = len(items.ids)
    mixed_items = items.rows([0, *range(max(1, count - MIXED_BATCH + 1), count)])
    requests = []
    for signature in SIGNATURES:
        for n in (1, len(mixed)):
            k = samples.sample_ks(max_k, len(mixed))[:n] if n > 1 else [max_k]
            inputs = samples.request_inputs(
                name,
                signature,
                mixed[:n],
                histories[:n],
                mixed_items.rows(range(min(n, len(mixed_items.ids)))),
                k,
            )
            requests.append((signature, inputs))
    return requests


def write_warmup_requests(model_dir: Path, model_name: str, requests: list[Request]) -> Path:
    """Write `requests` as PredictionLog records into model_dir/assets.extra/; the file path."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_log_pb2

    path = Path(model_dir) / WARMUP_DIR / WARMUP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for signature, inputs in requests:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = model_name
            request.model_spec.signature_name = signature
            for key, value in inputs.items():
                request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
            log = prediction_log_pb2.PredictionLog(
                predict_log=prediction_log_pb2.PredictLog(request=request)
            )
            writer.write(log.SerializeToString())
    return path


def read_warmup_requests(model_dir: Path) -> list[Request]:
    """The (signature, inputs) pairs stored in a SavedModel's warmup file."""
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2

    path = Path(model_dir) / WARMUP_DIR / WARMUP_FILE
    out = []
    for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
        request = prediction_log_pb2.PredictionLog.FromString(record).predict_log.request
        inputs = {key: tf.make_ndarray(proto) for key, proto in request.inputs.items()}
        out.append((request.model_spec.signature_name, inputs))
    return out
