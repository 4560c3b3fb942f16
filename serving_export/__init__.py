"""Serving artifacts of a trained model: TF Serving SavedModels, embeddings Parquet, verification.

`recsys` is imported first because it sets TF_USE_LEGACY_KERAS, which must happen before
TensorFlow is imported anywhere in the process.
"""

import recsys  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from serving_export.embeddings import (
    read_embeddings,
    write_item_embeddings,
    write_user_embeddings,
)
from serving_export.savedmodels import export_savedmodels
from serving_export.verify import verify_export

__all__ = [
    "export_savedmodels",
    "read_embeddings",
    "verify_export",
    "write_item_embeddings",
    "write_user_embeddings",
]
