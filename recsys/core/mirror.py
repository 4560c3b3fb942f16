"""A working directory in a bucket, worked on through a local copy.

TensorFlow 2.21 cannot read or write `s3://` at all (tensorflow-io, which could, stops at
TF 2.16), and a SavedModel cannot be renamed into place in a bucket. So every stage runs on
a local copy of the working directory (`<cache>/workdirs/<scheme>/<bucket>/<path>`):

- `pull` makes the copy equal to the bucket's *committed* state: every version folder whose
  commit marker exists (recsys.core.storage), exactly the files its marker lists, and the
  plain files beside them. Uncommitted versions (a writer killed mid-upload) are ignored and
  local leftovers that the bucket lacks are removed; unchanged files are not downloaded again.
- `push` publishes what changed: each changed version folder is uploaded with its marker
  last, then the plain files (so `models.config` is written after the versions it names),
  then versions and files that are gone locally are deleted remotely (marker first).

Version folders are the units the layout publishes whole (docs/ARCHITECTURE.md):
`data/<date>`, `runs/<date>/<run>`, `export/<model>/<version>`, `embeddings/<version>`,
`tune/<date>/data-<digest>`. Any new file inside one of them (the sequence shards of
`data/<date>`, say) is carried without code here. Never synced: the lock file, the local
SQLite stores of MLflow and of `recsys tune`, training checkpoints (`.backup-*`) and the
temporaries of atomic writers (pid-named: a pull removes those that a dead process left).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recsys.core import storage
from recsys.core.faults import fault_point
from recsys.core.layout import (
    TEMP_PREFIXES,
    Workdir,
    WorkdirFile,
    left_by_dead_process,
    temp_name,
    version_folder,
)

log = logging.getLogger(__name__)

CACHE_ENV = "RECSYS_CACHE_DIR"
STATE_FILE = ".recsys-mirror.json"  # local only: the hashes of files as last synced
_LOCAL_ONLY = frozenset({str(WorkdirFile.LOCK), "mlflow", STATE_FILE})
_BACKUP_PREFIX = ".backup-"
_STUDY_STORE = f"tune/{WorkdirFile.STUDY_STORE}"
Stamp = tuple[int, str]  # an object's (size, version token: ETag or generation)


def cache_dir(configured: str | None = None) -> Path:
    """Where local copies live: storage.cache_dir, else $RECSYS_CACHE_DIR, else ~/.cache/recsys."""
    chosen = configured or os.environ.get(CACHE_ENV) or "~/.cache/recsys"
    return Path(chosen).expanduser().resolve()


def local_copy(uri: str, cache: Path, writable: bool = True) -> Path:
    """The folder that holds the local copy of the working directory at `uri`.

    Read-only commands get a copy of their own (`views/`): their pull, which takes no lock,
    must never touch the copy a writer on this machine is working in.
    """
    location = storage.ObjectPath.parse(uri)
    kind = "workdirs" if writable else "views"
    return cache / kind / location.scheme / location.bucket / location.key


def is_local_only(relative: str) -> bool:
    """Files that stay on this machine: the lock, the SQLite stores of MLflow and of tuning
    (a database is not a file to copy while it is open), checkpoints, temporaries."""
    parts = relative.split("/")
    if parts[0] in _LOCAL_ONLY or any(p.startswith(TEMP_PREFIXES) for p in parts):
        return True
    if relative.startswith(_STUDY_STORE):  # with its -journal / -wal files
        return True
    return any(p.startswith(_BACKUP_PREFIX) for p in parts)


class Mirror:
    """The local copy `local` of the working directory at `uri` (hold the workdir lock)."""

    def __init__(self, uri: str, local: Path) -> None:
        self.uri = str(storage.ObjectPath.parse(uri))
        self.local = Path(local)
        self._state: dict[str, dict[str, Any]] = self._load_state()

    # -- pull ----------------------------------------------------------------------------------

    def pull(self) -> None:
        """Make the local copy hold exactly the bucket's committed versions and plain files."""
        with storage.storage_errors(self.uri):
            self._pull()

    def push(self) -> None:
        """Publish what changed locally: versions (marker last), plain files, then deletions."""
        with storage.storage_errors(self.uri):
            self._push()

    def _pull(self) -> None:
        start = time.perf_counter()
        remote_versions, remote_plain = self._remote()
        committed: dict[str, storage.Listing] = {}
        for version in remote_versions:
            listing = storage.committed(self._uri(version))
            if listing is not None:
                committed[version] = listing
        local_versions, local_plain = self._scan_local()
        for version, listing in committed.items():
            have = self._listing(version, local_versions.get(version, []))
            storage.fetch_version(self._uri(version), self.local / version, listing, have)
        for version in set(local_versions) - set(committed):
            shutil.rmtree(self.local / version, ignore_errors=True)
        fetched = self._pull_plain(remote_plain, local_plain)
        ignored = sorted(set(remote_versions) - set(committed))
        if ignored:
            log.info("storage: ignored %d uncommitted version(s) in %s: %s", len(ignored),
                     self.uri, ", ".join(ignored[:5]))  # fmt: skip
        self._save_state()
        log.info(
            "storage: %s -> %s: %d version(s), %d file(s) fetched in %.1f s",
            self.uri, self.local, len(committed), fetched, time.perf_counter() - start,
        )  # fmt: skip

    def _pull_plain(self, remote: dict[str, Stamp], local: list[str]) -> int:
        fetched = 0
        for name, remote_stamp in remote.items():
            target = self.local / name
            if target.is_file() and self._synced(name, remote_stamp):
                continue
            data = storage.read_bytes(self._uri(name))
            if data is None:
                continue  # deleted since the listing
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(temp_name("tmp", target.name))
            tmp.write_bytes(data)
            os.replace(tmp, target)
            self._sha(target)
            self._state[name]["remote"] = list(remote_stamp)
            fetched += 1
        for name in set(local) - set(remote):
            (self.local / name).unlink(missing_ok=True)
        return fetched

    # -- push ----------------------------------------------------------------------------------

    def _push(self) -> None:
        start = time.perf_counter()
        remote_versions, remote_plain = self._remote()
        local_versions, local_plain = self._scan_local()
        published = 0
        for version in sorted(local_versions):
            listing = self._listing(version, local_versions[version])
            previous = storage.committed(self._uri(version)) if version in remote_versions else None
            if previous == listing:
                continue
            storage.publish_version(
                self.local / version, self._uri(version), listing, previous, _fault(version)
            )
            published += 1
        for name in local_plain:
            if remote_plain.get(name) is not None and self._synced(name, remote_plain[name]):
                continue
            storage.write_bytes(self._uri(name), (self.local / name).read_bytes())
            self._sha(self.local / name)
            self._state[name]["remote"] = list(storage.stamp(self._uri(name)) or ())
        for version in set(remote_versions) - set(local_versions):
            storage.remove_version(self._uri(version))
        storage.delete_files(self.uri, sorted(set(remote_plain) - set(local_plain)))
        self._save_state()
        log.info(
            "storage: %s -> %s: %d version(s) published in %.1f s",
            self.local, self.uri, published, time.perf_counter() - start,
        )  # fmt: skip

    # -- listings ------------------------------------------------------------------------------

    def _uri(self, relative: str) -> str:
        return f"{self.uri}/{relative}"

    def _remote(self) -> tuple[dict[str, list[str]], dict[str, Stamp]]:
        """(version -> its object names, plain file -> (size, token)) in the bucket."""
        versions: dict[str, list[str]] = {}
        plain: dict[str, Stamp] = {}
        for name, size in storage.list_stamps(self.uri).items():
            if is_local_only(name):
                continue
            version = version_folder(name)
            if version is None:
                plain[name] = size
            else:
                versions.setdefault(version, []).append(name[len(version) + 1 :])
        return versions, plain

    def _scan_local(self) -> tuple[dict[str, list[str]], list[str]]:
        """(version -> its files, plain files) in the local copy."""
        versions: dict[str, list[str]] = {}
        plain: list[str] = []
        if not self.local.is_dir():
            return versions, plain
        for path in sorted(self.local.rglob("*")):
            name = path.relative_to(self.local).as_posix()
            if left_by_dead_process(path, files=True) and path.is_file():
                path.unlink()  # a download or state file that a killed pull left
                continue
            if not path.is_file() or is_local_only(name):
                continue
            version = version_folder(name)
            if version is None:
                plain.append(name)
            else:
                versions.setdefault(version, []).append(name[len(version) + 1 :])
        return versions, plain

    def _listing(self, version: str, names: list[str]) -> storage.Listing:
        listing = {}
        for name in names:
            path = self.local / version / name
            listing[name] = {"size": path.stat().st_size, "sha256": self._sha(path)}
        return listing

    def _sha(self, path: Path) -> str:
        """sha256 of a local file, from the state while its size and mtime are unchanged."""
        name = path.relative_to(self.local).as_posix()
        stat = path.stat()
        cached = self._state.get(name)
        if cached and (cached["size"], cached["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns):
            return str(cached["sha256"])
        digest = storage.sha256_file(path)
        # A changed local file is no longer known to match anything in the bucket.
        self._state[name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                             "sha256": digest, "remote": None}  # fmt: skip
        return digest

    def _synced(self, name: str, remote: Stamp) -> bool:
        """Whether a plain file is unchanged on both sides since it was last pushed or pulled."""
        self._sha(self.local / name)
        return bool(self._state[name]["remote"] == list(remote))

    def _load_state(self) -> dict[str, dict[str, Any]]:
        try:
            return dict(json.loads((self.local / STATE_FILE).read_text())["files"])
        except (OSError, ValueError, KeyError):
            return {}

    def _save_state(self) -> None:
        self._state = {k: v for k, v in self._state.items() if (self.local / k).is_file()}
        self.local.mkdir(parents=True, exist_ok=True)
        tmp = self.local / temp_name("tmp", STATE_FILE)
        tmp.write_text(json.dumps({"files": self._state}))
        os.replace(tmp, self.local / STATE_FILE)


def _fault(version: str) -> Callable[[str], None]:
    """Fault point `storage:uploaded:<data|runs|export|...>` after each file of a version."""
    point = f"storage:uploaded:{version.split('/')[0]}"

    def uploaded(name: str) -> None:
        fault_point(point)

    return uploaded


def pull(workdir: Workdir) -> None:
    """Refresh a bucket workdir's local copy from the bucket (nothing for a local workdir)."""
    if workdir.remote is not None:
        Mirror(workdir.remote, workdir.root).pull()


def push(workdir: Workdir) -> None:
    """Publish a bucket workdir's local changes (nothing for a local workdir)."""
    if workdir.remote is not None:
        Mirror(workdir.remote, workdir.root).push()
