"""recsys.core.storage and recsys.core.mirror against real S3 and GCS servers on 127.0.0.1.

Each test runs on both stores (moto's S3 server, fake-gcs-server): versions committed by a
marker written last, readers that ignore uncommitted versions, the local copy of a bucket
workdir, the bucket lock, endpoints from the standard environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conductor.lock import BucketLock, WorkdirLock
from recsys.core import mirror, storage
from recsys.core.errors import ConfigError, StorageError, WorkdirLockedError
from tests.object_stores import ObjectStore


def _folder(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


class Killed(Exception):
    """Stands for a process killed after some uploads."""


def test_uri_parsing_and_what_counts_as_remote() -> None:
    location = storage.ObjectPath.parse("s3://bucket/a//b/")
    assert (location.bucket, location.key, str(location)) == ("bucket", "a/b", "s3://bucket/a/b")
    assert str(location.join("c", "d.txt")) == "s3://bucket/a/b/c/d.txt"
    assert storage.is_uri("gs://b/x") and not storage.is_uri("/tmp/s3://x")
    assert not storage.is_uri("data/x") and not storage.is_uri(None)
    for bad in ("s3://", "ftp://b/x", "gs://b/../x"):
        with pytest.raises(ConfigError, match=r"object storage|'\.\.'"):
            storage.ObjectPath.parse(bad)


def test_a_version_is_visible_only_once_its_marker_is_written(
    store: ObjectStore, tmp_path: Path
) -> None:
    uri = f"{store.new_bucket()}/data/2026-01-05"
    folder = _folder(tmp_path / "v", {"a.txt": "A" * 100, "vocab/b.txt": "B", "_SUCCESS": "ok"})
    uploaded: list[str] = []

    def killed_after_two(name: str) -> None:
        uploaded.append(name)
        if len(uploaded) == 2:
            raise Killed

    with pytest.raises(Killed):
        storage.publish_version(folder, uri, on_upload=killed_after_two)
    assert len(storage.list_files(uri)) >= 2  # objects are there ...
    assert storage.committed(uri) is None  # ... but the version is not
    listing = storage.publish_version(folder, uri)
    assert storage.committed(uri) == listing
    assert set(listing) == {"a.txt", "vocab/b.txt", "_SUCCESS"}
    assert listing["a.txt"] == {"size": 100, "sha256": storage.sha256_file(folder / "a.txt")}


def test_changing_a_committed_version_uncommits_it_first(
    store: ObjectStore, tmp_path: Path
) -> None:
    uri = f"{store.new_bucket()}/runs/2026-01-05/r1"
    folder = _folder(tmp_path / "v", {"history.json": "[1]", "model/w.bin": "w1"})
    first = storage.publish_version(folder, uri)
    (folder / "history.json").write_text("[1, 2]")
    seen: list[object] = []
    storage.publish_version(
        folder, uri, previous=first, on_upload=lambda _: seen.append(storage.committed(uri))
    )
    assert seen == [None]  # while history.json changed, no reader could take the version
    assert storage.read_bytes(f"{uri}/history.json") == b"[1, 2]"
    # Adding a file only: the old marker stays valid during the upload (its files are intact).
    (folder / "metrics.json").write_text("{}")
    before = storage.committed(uri)
    seen.clear()
    storage.publish_version(
        folder, uri, previous=before, on_upload=lambda _: seen.append(storage.committed(uri))
    )
    assert seen == [before] and "metrics.json" in (storage.committed(uri) or {})


def test_the_mirror_round_trips_a_workdir_and_ignores_uncommitted_versions(
    store: ObjectStore, tmp_path: Path
) -> None:
    uri = f"{store.new_bucket()}/work"
    a = _folder(tmp_path / "a", {
        "data/2026-01-05/train-0.tfrecord.gz": "t" * 50, "data/2026-01-05/_SUCCESS": "",
        "export/query/1/saved_model.pb": "pb", "export/models.config": "labels 1",
        "champion.json": '{"v": "1"}', "runs/2026-01-05/.backup-x/ckpt": "local only",
        ".recsys.lock": "local only", "mlflow/mlflow.db": "local only",
        "data/.tmp-2026-01-06-ab12/x": "a killed writer's",
    })  # fmt: skip
    mirror.Mirror(uri, a).push()
    remote = storage.list_files(uri)
    assert not [n for n in remote if "backup" in n or "mlflow" in n or ".tmp-" in n]
    assert ".recsys.lock" not in remote
    assert "export/query/1/_COMMITTED" in remote and "data/2026-01-05/_COMMITTED" in remote

    b = tmp_path / "b"
    mirror.Mirror(uri, b).pull()
    assert (b / "data/2026-01-05/train-0.tfrecord.gz").read_text() == "t" * 50
    assert (b / "export/models.config").read_text() == "labels 1"

    # Same size, other content (a new champion): found by the object's version, not its size.
    (a / "champion.json").write_text('{"v": "2"}')
    (a / "export/query/2").mkdir()
    (a / "export/query/2/saved_model.pb").write_text("pb2")
    for leftover in (a / "export/query/1").iterdir():
        leftover.unlink()
    (a / "export/query/1").rmdir()  # pruned: removed from the bucket too
    mirror.Mirror(uri, a).push()
    # A version half-uploaded by a killed writer is not taken, and a local leftover is dropped.
    storage.write_bytes(f"{uri}/data/2026-01-06/train-0.tfrecord.gz", b"half")
    _folder(b, {"data/2026-01-07/x": "only here"})
    mirror.Mirror(uri, b).pull()
    assert (b / "champion.json").read_text() == '{"v": "2"}'
    assert sorted(p.name for p in (b / "export/query").iterdir()) == ["2"]
    assert not (b / "data/2026-01-06").exists() and not (b / "data/2026-01-07").exists()


def test_a_tampered_object_is_refused_on_pull(store: ObjectStore, tmp_path: Path) -> None:
    uri = f"{store.new_bucket()}/work"
    a = _folder(tmp_path / "a", {"embeddings/1/items.parquet": "vectors"})
    mirror.Mirror(uri, a).push()
    storage.write_bytes(f"{uri}/embeddings/1/items.parquet", b"VECTORS")
    with pytest.raises(StorageError, match="does not match its version's marker"):
        mirror.Mirror(uri, tmp_path / "b").pull()


def test_conditional_objects(store: ObjectStore) -> None:
    uri = f"{store.new_bucket()}/lock"
    first = storage.create_object(uri, b"one")
    assert first is not None and storage.create_object(uri, b"two") is None
    assert storage.read_object(uri) == (b"one", first)
    second = storage.replace_object(uri, b"three", first)
    assert second is not None and storage.replace_object(uri, b"stale", first) is None
    if store.scheme == "s3":  # fake-gcs-server ignores preconditions on DELETE (GCS does not)
        assert not storage.delete_object(uri, first)
    assert storage.delete_object(uri, second) and storage.read_object(uri) is None


def test_the_bucket_lock_excludes_other_processes(store: ObjectStore, tmp_path: Path) -> None:
    bucket = store.new_bucket()
    lock_uri = f"{bucket}/work/.recsys.lock"
    held = BucketLock(lock_uri, "recsys nightly")
    held.acquire()
    try:
        # Another machine (its own local copy): refused, naming the holder.
        child = subprocess.run(
            [sys.executable, "-c", (
                "from conductor.lock import BucketLock; import sys\n"
                f"BucketLock({lock_uri!r}, 'recsys train').acquire()"
            )],
            capture_output=True, text=True, timeout=120, env=os.environ.copy(),
        )  # fmt: skip
        assert child.returncode != 0
        assert f"in use by pid {os.getpid()}" in child.stderr
    finally:
        held.release()
    assert storage.read_object(lock_uri) is None  # released: the object is gone


def test_a_dead_or_expired_holder_is_taken_over(store: ObjectStore) -> None:
    lock_uri = f"{store.new_bucket()}/w/.recsys.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    holder = {"pid": int(dead.stdout), "host": os.uname().nodename, "expires": 4e9}
    storage.create_object(lock_uri, json.dumps(holder).encode())
    taker = BucketLock(lock_uri, "recsys nightly")
    taker.acquire()  # same host, pid gone: taken over at once
    taker.release()
    elsewhere = {"pid": 1, "host": "another-host", "expires": 4e9}
    storage.create_object(lock_uri, json.dumps(elsewhere).encode())
    with pytest.raises(WorkdirLockedError, match="another-host"):
        BucketLock(lock_uri, "recsys nightly").acquire()
    found = storage.read_object(lock_uri)
    assert found is not None
    expired = {**elsewhere, "expires": 1.0}  # its holder stopped renewing long ago
    assert storage.replace_object(lock_uri, json.dumps(expired).encode(), found[1])
    taker = BucketLock(lock_uri, "recsys nightly")
    taker.acquire()
    taker.release()


def test_workdir_lock_takes_the_local_copy_and_the_bucket(
    store: ObjectStore, tmp_path: Path
) -> None:
    remote = f"{store.new_bucket()}/work"
    with WorkdirLock(tmp_path, "recsys nightly", remote=remote):
        got = storage.read_object(f"{remote}/.recsys.lock")
        assert got is not None and json.loads(got[0])["pid"] == os.getpid()
    assert storage.read_object(f"{remote}/.recsys.lock") is None


def test_endpoints_come_from_the_environment_and_config_overrides_it(
    s3_store: ObjectStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.conftest import use_store

    use_store(s3_store, monkeypatch)
    bucket = s3_store.new_bucket()
    storage.write_bytes(f"{bucket}/x", b"1")  # AWS_ENDPOINT_URL reaches the server
    for name in storage.S3_ENDPOINT_ENV:
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    expected = r"object storage s3://.*AWS_ENDPOINT_URL"
    with pytest.raises(StorageError, match=expected), storage.storage_errors(bucket):
        storage.read_bytes(f"{bucket}/x")
    storage.configure(s3_endpoint_url=s3_store.endpoint)  # storage.s3_endpoint_url wins
    assert storage.read_bytes(f"{bucket}/x") == b"1"
    assert storage.client_settings()["s3_endpoint_url"] == s3_store.endpoint


def test_version_folders_of_the_layout() -> None:
    from recsys.core.layout import version_folder

    assert version_folder("data/2026-01-05/vocab/items.txt") == "data/2026-01-05"
    assert version_folder("runs/2026-01-05/r1/model/model.json") == "runs/2026-01-05/r1"
    assert version_folder("export/query/3/saved_model.pb") == "export/query/3"
    assert version_folder("embeddings/3/items.parquet") == "embeddings/3"
    assert version_folder("tune/2026-01-05/data-ab12/stats.json") == "tune/2026-01-05/data-ab12"
    assert version_folder("export/models.config") is None
    assert version_folder("export/.checksums/query/3.json") is None
    assert version_folder("runs/2026-01-05/.backup-abc/ckpt") is None
    assert mirror.is_local_only("runs/2026-01-05/.backup-abc/ckpt")
    assert mirror.is_local_only("mlflow/mlflow.db") and mirror.is_local_only(".recsys.lock")
