"""The registered MLflow Model's code: top-k recommendations from the retrieval SavedModel.

MLflow's "models from code": this file is copied into the MLflow Model (no pickled object)
and run when the model is loaded (`mlflow.pyfunc.load_model`, `mlflow models serve`). It
needs only TensorFlow, pandas and MLflow, not recsys: names and limits come from the model
config that serving_export.mlflow_model writes (one definition of each, in
serving_export.signatures).

Input: a DataFrame with `user_id` (string) and, optionally, `history` (list of item id
strings, oldest first; missing, null or [] means none). Params: `k` (default 10, at most the
export's `top_k`). Output: one row per input row, `item_ids` (best first) and `scores`, at
most k of each (fewer only when the catalog is smaller). The answer is the retrieval
SavedModel's `serving_default` signature, the one TF Serving serves.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import tensorflow as tf
from mlflow.exceptions import MlflowException
from mlflow.models import set_model
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel


class TopKRecommender(PythonModel):
    """user_id (+ history) -> the k highest-scoring catalog items, via the retrieval SavedModel."""

    def load_context(self, context: Any) -> None:
        """Load the retrieval SavedModel artifact and the names and limits of the config."""
        config = context.model_config
        self.names: dict[str, str] = config["names"]
        self.top_k = int(config["top_k"])
        self.default_k = int(config["default_k"])
        self.pad_item_id = str(config["pad_item_id"])
        model = tf.saved_model.load(context.artifacts[config["artifact"]])
        self.serve = model.signatures[config["signature"]]

    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        """One row of `item_ids` and `scores` (best first) per input row."""
        k = self._k(params)
        names = self.names
        if names["user_id"] not in model_input.columns:
            raise MlflowException(
                f"the input has no {names['user_id']!r} column (columns: "
                f"{list(model_input.columns)})",
                INVALID_PARAMETER_VALUE,
            )
        users = [str(u) for u in model_input[names["user_id"]].tolist()]
        if not users:
            return pd.DataFrame({names["item_ids"]: [], names["scores"]: []})
        raw = model_input[names["history"]].tolist() if names["history"] in model_input else []
        histories = [_items(h) for h in raw] or [[] for _ in users]
        width = max(len(h) for h in histories)
        padded = [h + [self.pad_item_id] * (width - len(h)) for h in histories]
        out = self.serve(
            **{
                names["user_id"]: tf.constant(users, tf.string),
                names["history"]: tf.constant(padded, tf.string, shape=[len(users), width]),
                names["k"]: tf.fill([len(users)], tf.constant(k, tf.int32)),
            }
        )
        ids, scores = out[names["item_ids"]].numpy(), out[names["scores"]].numpy()
        rows = [row != self.pad_item_id.encode() for row in ids]
        return pd.DataFrame(
            {
                names["item_ids"]: [[i.decode() for i in ids[r][m]] for r, m in enumerate(rows)],
                names["scores"]: [[float(s) for s in scores[r][m]] for r, m in enumerate(rows)],
            }
        )

    def _k(self, params: dict[str, Any] | None) -> int:
        value = (params or {}).get(self.names["k"], self.default_k)
        try:
            k = int(value)
        except (TypeError, ValueError):
            k = 0
        if not 1 <= k <= self.top_k or k != value:
            raise MlflowException(
                f"params k={value!r}: k must be an integer from 1 to {self.top_k} (the "
                "export's top_k; raise export.top_k in the config and re-export for more)",
                INVALID_PARAMETER_VALUE,
            )
        return k


def _items(history: Any) -> list[str]:
    """A history cell as a list of item ids (None, NaN and [] are no history)."""
    if history is None or (isinstance(history, float) and math.isnan(history)):
        return []
    if isinstance(history, str):
        raise MlflowException(
            f"history must be a list of item id strings, got the string {history!r}",
            INVALID_PARAMETER_VALUE,
        )
    return [str(item) for item in history]


set_model(TopKRecommender())
