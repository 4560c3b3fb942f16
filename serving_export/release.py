"""Staging, release and retention of a version's serving artifacts.

"Release" is the export stage's last step: a verified folder renamed to where TF Serving and
the retrieval indexes read it. (The nightly's fifth stage, "publish", is another thing: it
logs and registers the run in MLflow and gates it.)


The nightly export (conductor.stages.export) writes every artifact of a version into one
staging folder (`export/.staging-<version>-<random>/`: the three SavedModels and
`embeddings/<version>/`), verifies the SavedModels there, and only then releases each folder
with one rename. An exception or a killed process before that leaves nothing visible; the
staging folder is ignored by TF Serving (not an integer name) and removed by the next run.
After the release, `models.config` is rewritten (labels kept) and old versions are pruned.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from recsys.core.config import ExportConfig
from recsys.core.layout import EmbeddingsFile, replace_dir, temp_name
from recsys.model import TrainedModel
from serving_export.activity import Activity
from serving_export.ann import build_ann
from serving_export.embeddings import read_embeddings, write_item_embeddings, write_user_embeddings
from serving_export.integrity import forget_checksums
from serving_export.manifest import MANIFEST, write_manifest
from serving_export.serving_config import read_version_labels, write_models_config

log = logging.getLogger(__name__)


def stage_embeddings(
    model: TrainedModel,
    directory: Path,
    version: int,
    models: dict[str, Path],
    config: ExportConfig,
    activity: Activity | None = None,
) -> dict[str, Any]:
    """items.parquet, users.parquet, the optional ANN index and manifest.json in `directory`.

    `models` are the same version's SavedModel dirs (their fingerprints go into the
    manifest); `activity` gives the users' latest histories and the extra columns.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    items = write_item_embeddings(
        model,
        directory / EmbeddingsFile.ITEMS,
        version,
        activity.item_columns if activity else None,
    )
    users = write_user_embeddings(
        model,
        model.users,
        directory / EmbeddingsFile.USERS,
        version,
        histories=activity.histories if activity else None,
        columns=activity.user_columns if activity else None,
    )
    ann = None
    if config.ann == "faiss":
        ann = _build_ann(directory, config)
    write_manifest(
        directory,
        version,
        model.output_dim,
        {"items": model.items, "users": model.users},
        models={name: path for name, path in models.items() if name != "retrieval"},
        ann=ann,
        normalization=model.normalization,
    )
    return {"items": items, "users": users, "manifest": directory / MANIFEST, "ann": ann}


def _build_ann(directory: Path, config: ExportConfig) -> dict[str, Any]:
    # Built from the files just written, as an external consumer would build it.
    _, items, _ = read_embeddings(directory / EmbeddingsFile.ITEMS)
    _, users, _ = read_embeddings(directory / EmbeddingsFile.USERS)
    entry = build_ann(
        directory, items, users, config.ann_nlist, config.ann_nprobe, config.ann_recall_k
    )
    recall = entry["recall"]
    log.info("ANN index %s: recall@%d %.4f", entry["index"], recall["k"], recall["value"])
    return entry


def release_dir(source: Path, target: Path) -> Path:
    """Move a finished folder onto `target` by rename (an existing target is replaced whole)."""
    return replace_dir(source, target)


def versions(base: Path) -> list[int]:
    """The integer version folders under a TF Serving model base (or embeddings/), ascending."""
    if not Path(base).is_dir():
        return []
    return sorted(int(p.name) for p in Path(base).iterdir() if p.name.isdigit() and p.is_dir())


def prune_versions(base: Path, keep: int, protect: Iterable[int] = ()) -> list[int]:
    """Delete all but the newest `keep` versions under `base`, never a protected one.

    Each version is renamed away first (one atomic step: TF Serving sees it gone, never half
    deleted), then removed. Returns the versions removed.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    protected = {int(v) for v in protect}
    present = versions(base)
    doomed = [v for v in present[: max(len(present) - keep, 0)] if v not in protected]
    for version in doomed:
        # A recsys temporary name: a leftover of a killed prune is cleaned up by the next run.
        trash = Path(base) / temp_name("old", str(version))
        os.replace(Path(base) / str(version), trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def finish_release(
    export_root: Path,
    embeddings_root: Path,
    names: Iterable[str],
    version: int,
    config: ExportConfig,
    keep: Iterable[int] = (),
) -> dict[str, Any]:
    """After a release: rewrite models.config (labels kept) and prune to export.keep_versions.

    The versions labelled champion/challenger in models.config (recsys.serving_state sets
    them from the registry), those in `keep` (champion.json's) and the new version are never
    pruned.
    """
    names = list(names)
    labels = read_version_labels(export_root)
    config_path = write_models_config(export_root, names, labels, config.serving_base_path)
    protect = {*labels.values(), *(int(v) for v in keep), version}
    pruned = {
        name: prune_versions(Path(export_root) / name, config.keep_versions, protect)
        for name in names
    }
    for name in names:
        forget_checksums(export_root, name, pruned[name])
    pruned["embeddings"] = prune_versions(embeddings_root, config.keep_versions, protect)
    if any(pruned.values()):
        log.info("pruned old versions: %s", {k: v for k, v in pruned.items() if v})
    return {"models_config": str(config_path), "labels": labels, "pruned": pruned}
