"""The on-disk format of a trained model and its migrations.

A model folder holds `users.txt` / `items.txt` (vocabularies in index order), `model.json`
(the `ModelConfig`), the side-feature tables (`item_features.*`, `user_features.*`) and one TF
checkpoint per tower (`query/weights`, `candidate/weights`). Keys added to `model.json` after
the first saved models take their 'absent' value (`ADDED_OFF`), so an old champion still loads
and warm-starts; a checkpoint that does not match the rebuilt tower is a `DataError`.
"""

from __future__ import annotations

import json
from pathlib import Path

import tensorflow as tf

from recsys.core.config import ModelConfig
from recsys.core.errors import DataError, StageNotReadyError
from recsys.core.layout import ModelFile
from recsys.model.features import ItemFeatures, UserFeatures

USERS = ModelFile.USER_VOCAB
ITEMS = ModelFile.ITEM_VOCAB
CONFIG = ModelFile.CONFIG
TOWERS = ("query", "candidate")

ADDED_OFF = {
    "history_length": 0,
    "item_features": False,
    "normalize": True,
    "user_features": False,
    "query_encoder": "mean",
    "negatives": "in_batch",
    "encoder_positions": "absolute",
    "user_embedding": True,
    "history_mean": False,
}
"""ModelConfig keys added after the first saved models, with the value that means 'absent'
(models saved before `normalize` existed were always normalised, before `query_encoder`
mean-pooled their histories, before `user_embedding` had a per-user table). Not the current
defaults, which may differ: an old model must rebuild as it was trained."""


def write_model(
    path: Path,
    users: list[str],
    items: list[str],
    config: ModelConfig,
    features: tuple[ItemFeatures, UserFeatures],
    towers: dict[str, tf.keras.Model],
) -> None:
    """Weights (TF checkpoints), vocabularies, side features and model config under `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / USERS).write_text("\n".join(users) + "\n", encoding="utf-8")
    (path / ITEMS).write_text("\n".join(items) + "\n", encoding="utf-8")
    (path / CONFIG).write_text(json.dumps(config.model_dump(), indent=2))
    for table in features:
        table.save(path)
    for name in TOWERS:
        towers[name].save_weights(str(path / name / "weights"))


def read_config(path: Path) -> ModelConfig:
    """`model.json`, migrated: keys it predates take the value that means 'absent'."""
    if not (path / CONFIG).is_file():
        raise StageNotReadyError(f"no trained model at {path}: run `recsys train` first")
    raw = json.loads((path / CONFIG).read_text())
    for key, off in ADDED_OFF.items():
        raw.setdefault(key, off)
    return ModelConfig.model_validate(raw)


def restore_weights(path: Path, towers: dict[str, tf.keras.Model]) -> None:
    """Load each tower's checkpoint; a mismatch with the rebuilt tower is a DataError."""
    for name in TOWERS:
        status = towers[name].load_weights(str(path / name / "weights"))
        try:
            status.assert_existing_objects_matched()
        except AssertionError as exc:
            raise DataError(
                f"{path / name}: checkpoint does not match the {name} tower rebuilt from "
                f"{CONFIG} ({str(exc)[:300]}); retrain or re-export the model"
            ) from None
        status.expect_partial()  # optimizer slots are not needed to serve or warm start
