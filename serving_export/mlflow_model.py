"""The retrieval SavedModel as an MLflow Model (pyfunc, models from code): what is registered.

`write_mlflow_model` wraps an exported `retrieval/<version>/` SavedModel, the one TF Serving
serves, with serving_export/mlflow_pyfunc.py (copied as code, nothing pickled): MLflow's own
tools then load and serve the registered version (`mlflow.pyfunc.load_model
("models:/<name>@champion")`, `mlflow models serve`). Logged with it: a signature (columns
`user_id`, optional `history`; outputs `item_ids`, `scores`; param `k`), an input example and
the pinned requirements of the environment that exported it.
"""

from __future__ import annotations

import itertools
import os
from importlib.metadata import version
from pathlib import Path
from unittest.mock import patch

import mlflow
import pandas as pd
from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR
from mlflow.models import ModelSignature
from mlflow.types.schema import Array, ColSpec, DataType, ParamSchema, ParamSpec, Schema

from recsys.core.layout import DataDir, RunFile, atomic_dir
from recsys.core.schema import HISTORY, USER_ID
from serving_export.signatures import ITEM_IDS, PAD_ITEM_ID, SCORES, SIGNATURE, K

MODEL_CODE = Path(__file__).with_name("mlflow_pyfunc.py")
ARTIFACT = "retrieval"
"""The MLflow Model's artifact holding the retrieval SavedModel."""
DEFAULT_K = 10
REQUIREMENTS = ("mlflow", "tensorflow", "pandas", "numpy")
MLMODEL = "MLmodel"
"""MLflow's description file at the root of every MLflow Model."""
UNKNOWN_USER = "new-user"
"""The input example's second row: a user the model never saw (hashed, still answered)."""


def signature(top_k: int) -> ModelSignature:
    """Inputs user_id (+ optional history), outputs item_ids and scores, param k."""
    return ModelSignature(
        inputs=Schema(
            [
                ColSpec(DataType.string, USER_ID),
                ColSpec(Array(DataType.string), HISTORY, required=False),
            ]
        ),
        outputs=Schema(
            [ColSpec(Array(DataType.string), ITEM_IDS), ColSpec(Array(DataType.double), SCORES)]
        ),
        params=ParamSchema([ParamSpec(K, DataType.long, default_k(top_k))]),
    )


def default_k(top_k: int) -> int:
    """k when a request gives none: 10, or the export's top_k when that is smaller."""
    return min(DEFAULT_K, top_k)


def input_example(users: list[str], items: list[str]) -> pd.DataFrame:
    """A known user with two catalog items as history, and an unknown user without one."""
    rows: list[tuple[str, list[str]]] = [(UNKNOWN_USER, [])]
    if users and items:
        rows.insert(0, (users[0], items[:2]))
    return pd.DataFrame({USER_ID: [r[0] for r in rows], HISTORY: [r[1] for r in rows]})


def run_mlflow_model(run_dir: Path, data_dir: Path, retrieval_dir: Path, top_k: int) -> Path:
    """The run folder's MLflow Model of its exported retrieval SavedModel (written once)."""
    target = run_dir / RunFile.MLFLOW_MODEL
    if (target / MLMODEL).is_file():
        return target  # derived from the run's export alone: a rerun reuses it
    data = DataDir(data_dir)
    users, items = (_ids(path) for path in (data.user_vocab, data.item_vocab))
    return write_mlflow_model(retrieval_dir, target, top_k, users, items)


def _ids(vocab: Path, count: int = 2) -> list[str]:
    if not vocab.is_file():
        return []
    with vocab.open(encoding="utf-8") as lines:
        return [line.rstrip("\n") for line in itertools.islice(lines, count)]


def write_mlflow_model(
    retrieval_dir: Path, target: Path, top_k: int, users: list[str], items: list[str]
) -> Path:
    """Write the MLflow Model wrapping `retrieval_dir` to `target` (replaced whole).

    `top_k` is the largest k the SavedModel was exported for (export.top_k); `users` and
    `items` give the input example its ids (the data's vocabularies; may be empty).
    """
    # MLflow draws a terminal bar while it copies the artifact: noise in a cron log.
    quiet = {MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name: "false"}
    with atomic_dir(target) as tmp, patch.dict(os.environ, quiet):
        mlflow.pyfunc.save_model(
            path=str(tmp),
            python_model=str(MODEL_CODE),
            artifacts={ARTIFACT: str(retrieval_dir)},
            model_config={
                "artifact": ARTIFACT,
                "signature": SIGNATURE,
                "top_k": top_k,
                "default_k": default_k(top_k),
                "pad_item_id": PAD_ITEM_ID,
                "names": {
                    "user_id": USER_ID,
                    "history": HISTORY,
                    "k": K,
                    "item_ids": ITEM_IDS,
                    "scores": SCORES,
                },
            },
            signature=signature(top_k),
            input_example=(input_example(users, items), {K: default_k(top_k)}),
            # Given, not inferred: inference loads the model in a subprocess to see its imports.
            pip_requirements=[f"{name}=={version(name)}" for name in REQUIREMENTS],
        )
    return target
