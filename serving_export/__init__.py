"""Serving artifacts of a trained model: TF Serving SavedModels, embeddings Parquet, verification.

`set_tf_env` runs first: TF_USE_LEGACY_KERAS must be set before TensorFlow is imported anywhere
in the process. The public functions are imported lazily, so `serving_export.serving_config`
(models.config) can be used without loading TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

from recsys.core.tf_env import set_tf_env

set_tf_env()

_PUBLIC = {
    "export_savedmodels": "serving_export.savedmodels",
    "load_embeddings": "serving_export.manifest",
    "prune_versions": "serving_export.release",
    "read_embeddings": "serving_export.embeddings",
    "verify_export": "serving_export.verify",
    "write_item_embeddings": "serving_export.embeddings",
    "write_models_config": "serving_export.serving_config",
    "write_user_embeddings": "serving_export.embeddings",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'serving_export' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
