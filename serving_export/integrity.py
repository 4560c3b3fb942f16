"""Checksums of published SavedModel versions, and the check of what models.config routes to.

A version folder is verified in staging and published by one rename; from then on only its
files on disk matter to TF Serving. Its files' sizes and sha256 are recorded at publish time
(`export/.checksums/<model>/<version>.json`: a hidden folder, so neither TF Serving nor
`models.config` sees it as a model), and `check_routed` compares every version that
models.config routes to (its labelled versions, or the latest when unlabelled) with that
record: a deleted or altered file is found before TF Serving fails to load it.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from recsys.core.errors import ServedModelError
from serving_export.serving_config import MODELS_CONFIG

CHECKSUMS_DIR = ".checksums"
CHUNK = 1 << 20
# A SavedModel folder must hold these to load at all (older versions have no record).
REQUIRED = ("saved_model.pb", "variables/variables.index")


@dataclass(frozen=True)
class Broken:
    """One routed version folder that TF Serving could not load as published."""

    model: str
    version: int
    labels: tuple[str, ...]
    problems: tuple[str, ...]

    def describe(self, export_root: Path) -> str:
        """`export/query/1 (champion): saved_model.pb missing`."""
        labels = f" ({', '.join(self.labels)})" if self.labels else " (latest)"
        folder = Path(export_root) / self.model / str(self.version)
        return f"{folder}{labels}: {'; '.join(self.problems)}"


def file_digests(folder: Path) -> dict[str, dict[str, int | str]]:
    """relative path -> {bytes, sha256} of every file under `folder`."""
    digests: dict[str, dict[str, int | str]] = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        sha = hashlib.sha256()
        with path.open("rb") as fh:
            while chunk := fh.read(CHUNK):
                sha.update(chunk)
        rel = path.relative_to(folder).as_posix()
        digests[rel] = {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}
    return digests


def record_path(export_root: Path, model: str, version: int) -> Path:
    """Where the checksums of export/<model>/<version> are recorded."""
    return Path(export_root) / CHECKSUMS_DIR / model / f"{version}.json"


def record_checksums(export_root: Path, model: str, version: int) -> Path:
    """Record the files of a just-published version folder (atomically); returns the record."""
    folder = Path(export_root) / model / str(version)
    path = record_path(export_root, model, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"model": model, "version": version, "files": file_digests(folder)}
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def forget_checksums(export_root: Path, model: str, versions: list[int]) -> None:
    """Drop the records of pruned versions."""
    for version in versions:
        record_path(export_root, model, version).unlink(missing_ok=True)


def version_problems(export_root: Path, model: str, version: int) -> list[str]:
    """What is wrong with export/<model>/<version> against its record ([] when intact)."""
    folder = Path(export_root) / model / str(version)
    if not folder.is_dir():
        return ["the folder is missing"]
    path = record_path(export_root, model, version)
    if not path.is_file():
        return [f"{name} missing" for name in REQUIRED if not (folder / name).is_file()]
    recorded = json.loads(path.read_text(encoding="utf-8"))["files"]
    present = file_digests(folder)
    problems = [f"{name} missing" for name in sorted(set(recorded) - set(present))]
    problems += [
        f"{name} changed (sha256 differs from the one recorded at publish time)"
        for name in sorted(set(recorded) & set(present))
        if recorded[name] != present[name]
    ]
    return problems


def routed_versions(export_root: Path) -> dict[str, dict[int, tuple[str, ...]]]:
    """model -> {version: its labels} that models.config makes TF Serving load."""
    from google.protobuf import text_format
    from tensorflow_serving.config import model_server_config_pb2

    path = Path(export_root) / MODELS_CONFIG
    if not path.is_file():
        return {}
    config = text_format.Parse(
        path.read_text(encoding="utf-8"), model_server_config_pb2.ModelServerConfig()
    )
    routed: dict[str, dict[int, tuple[str, ...]]] = {}
    for entry in config.model_config_list.config:
        labels: dict[int, list[str]] = {}
        for label, version in sorted(entry.version_labels.items()):
            labels.setdefault(int(version), []).append(label)
        versions = list(entry.model_version_policy.specific.versions) or _latest(
            Path(export_root) / entry.name
        )
        routed[entry.name] = {int(v): tuple(labels.get(int(v), ())) for v in versions}
    return routed


def _latest(base: Path) -> list[int]:
    # TF Serving's default policy serves the highest integer version folder.
    numbers = [int(p.name) for p in base.iterdir() if p.name.isdigit()] if base.is_dir() else []
    return [max(numbers)] if numbers else []


def check_routed(export_root: Path) -> list[Broken]:
    """Every routed version folder that is missing files or differs from its record."""
    broken = []
    for model, versions in sorted(routed_versions(export_root).items()):
        for version, labels in sorted(versions.items()):
            problems = version_problems(export_root, model, version)
            if problems:
                broken.append(Broken(model, version, labels, tuple(problems)))
    return broken


def runs_by_version(workdir_root: Path) -> dict[int, Path]:
    """export version -> the run folder that reserved it (runs/<date>/<run>/export_version.json)."""
    found = {}
    for path in sorted(Path(workdir_root).glob("runs/*/*/export_version.json")):
        try:
            found[int(json.loads(path.read_text(encoding="utf-8"))["version"])] = path.parent
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def check_serving(workdir_root: Path) -> None:
    """ServedModelError naming each broken routed version and the command that re-exports it."""
    export_root = Path(workdir_root) / "export"
    broken = check_routed(export_root)
    if not broken:
        return
    runs = runs_by_version(workdir_root)
    fixes = []
    for version in sorted({b.version for b in broken}):
        run = runs.get(version)
        fixes.append(
            f"`recsys export --date {run.parent.name} --run-id {run.name} --workdir {workdir_root}`"
            if run is not None
            else f"version {version}: its run folder is gone; promote another version"
        )
    raise ServedModelError(
        "models.config routes TF Serving to a broken version: "
        + " | ".join(b.describe(export_root) for b in broken)
        + ". Nothing was changed (models.config still routes there). Re-export it from its run "
        "(verified, then put back in place): " + "; ".join(fixes)
    )
