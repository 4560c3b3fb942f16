"""TF Serving's `models.config` (a model_config_list text proto) beside the exports.

With version labels `champion` and `challenger` an online A/B test routes requests by label
(`/v1/models/retrieval/labels/challenger:predict`, or `model_spec.version_label` in gRPC) and a
promotion is one config change, which TF Serving picks up with `--model_config_file_poll_wait_
seconds`. A label may only name a version TF Serving has loaded, so the config serves exactly
the labelled versions (`model_version_policy { specific { ... } }`); with no labels yet, the
default policy (the latest version) applies. Written with the tensorflow-serving-api protos
and published with os.replace, so TF Serving never reads a half-written file.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

from recsys.core.layout import WorkdirFile

log = logging.getLogger(__name__)

MODELS_CONFIG = WorkdirFile.MODELS_CONFIG
LABELS = ("champion", "challenger")


def models_config_text(
    export_root: Path,
    names: Sequence[str],
    labels: dict[str, int],
    base_path: str | None = None,
) -> str:
    """The model_config_list text for `names`, labels (label -> version) on every model."""
    from google.protobuf import text_format
    from tensorflow_serving.config import model_server_config_pb2

    config = model_server_config_pb2.ModelServerConfig()
    versions = sorted(set(labels.values()))
    for name in names:
        entry = config.model_config_list.config.add()
        entry.name = name
        entry.base_path = (
            f"{base_path.rstrip('/')}/{name}" if base_path else str(Path(export_root) / name)
        )
        entry.model_platform = "tensorflow"
        if versions:
            entry.model_version_policy.specific.versions.extend(versions)
        for label in sorted(labels):
            entry.version_labels[label] = labels[label]
    return text_format.MessageToString(config)


def write_models_config(
    export_root: Path,
    names: Sequence[str],
    labels: dict[str, int],
    base_path: str | None = None,
) -> Path:
    """Atomically (re)write export_root/models.config; labels whose version is missing dropped.

    A label pointing at a version that is not on disk for every model would make TF Serving
    reject the whole config, so such a label is left out (with a warning) instead.
    """
    export_root = Path(export_root)
    kept = {}
    for label, version in labels.items():
        missing = [n for n in names if not (export_root / n / str(version)).is_dir()]
        if missing:
            log.warning("models.config: %s=%s not in %s: label left out", label, version, missing)
        else:
            kept[label] = int(version)
    path = export_root / MODELS_CONFIG
    export_root.mkdir(parents=True, exist_ok=True)
    tmp = export_root / f".{MODELS_CONFIG}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(models_config_text(export_root, names, kept, base_path), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_version_labels(export_root: Path) -> dict[str, int]:
    """label -> version of the first model in export_root/models.config ({} if none)."""
    from google.protobuf import text_format
    from tensorflow_serving.config import model_server_config_pb2

    path = Path(export_root) / MODELS_CONFIG
    if not path.is_file():
        return {}
    config = text_format.Parse(
        path.read_text(encoding="utf-8"), model_server_config_pb2.ModelServerConfig()
    )
    models = config.model_config_list.config
    return dict(models[0].version_labels) if models else {}


def set_version_labels(
    export_root: Path, labels: dict[str, int], base_path: str | None = None
) -> Path | None:
    """Rewrite models.config for the models exported under `export_root` with new labels.

    The hook after a promotion: `labels` maps champion/challenger to export versions. None
    when nothing was exported there yet.
    """
    export_root = Path(export_root)
    names = (
        sorted(p.name for p in export_root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if export_root.is_dir()
        else []
    )
    if not names:
        return None
    return write_models_config(export_root, names, labels, base_path)
