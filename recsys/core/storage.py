"""Where things live: local paths, or `s3://` and `gs://` URIs in object storage.

Clients are configured as every AWS and Google tool configures them: from the environment.
S3: `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (an S3-compatible server), `AWS_DEFAULT_REGION`
or `AWS_REGION`, credentials from the AWS default chain (`AWS_ACCESS_KEY_ID` and
`AWS_SECRET_ACCESS_KEY`, a profile, an instance role). GCS: `STORAGE_EMULATOR_HOST` (an
emulator; anonymous) or Google's application default credentials. The config's `storage.*`
endpoints override the environment (`configure`); credentials never come from the config.

Object stores have no atomic rename, so a folder is published as a *version*: every file
is uploaded, then a commit marker (`_COMMITTED`, listing each file's size and sha256) is
written last. A reader takes a version only when its marker exists, and only the files the
marker lists: a writer killed half-way leaves an uncommitted version that readers ignore and
the next publish replaces. Bytes move through pyarrow's file systems (random access for
Parquet footers and columns); listings (with each object's ETag or generation) and conditional
writes (the workdir lock) use boto3 and google-cloud-storage, which pyarrow does not expose.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import posixpath
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

from recsys.core.errors import ConfigError, StorageError
from recsys.core.layout import temp_name

SCHEMES = ("s3", "gs")
COMMIT_MARKER = "_COMMITTED"
# The environment variables each client reads, most specific first (boto3's own order).
S3_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
S3_REGION_ENV = ("AWS_DEFAULT_REGION", "AWS_REGION")
GCS_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_THREADS = 8
_CHUNK = 1 << 20


def is_uri(path: str | os.PathLike[str] | None) -> bool:
    """Whether `path` names object storage (`s3://...`, `gs://...`) rather than a local path."""
    return path is not None and str(path).split("://", 1)[0] in SCHEMES and "://" in str(path)


@dataclass(frozen=True)
class ObjectPath:
    """A parsed `scheme://bucket/key` URI (the key without leading or trailing slashes)."""

    scheme: str
    bucket: str
    key: str = ""

    @classmethod
    def parse(cls, uri: str) -> ObjectPath:
        """Parse a URI; ConfigError naming it when it has no bucket or an unknown scheme."""
        scheme, sep, rest = str(uri).partition("://")
        bucket, _, key = rest.partition("/")
        if not sep or scheme not in SCHEMES or not bucket:
            raise ConfigError(f"not an object storage URI: {uri!r} (expected s3://BUCKET/PATH "
                              "or gs://BUCKET/PATH)")  # fmt: skip
        parts = [p for p in key.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise ConfigError(f"{uri!r}: '.' and '..' have no meaning in object storage keys")
        return cls(scheme, bucket, "/".join(parts))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}".rstrip("/")

    def join(self, *parts: str) -> ObjectPath:
        """The URI of a path below this one (`/`-separated parts)."""
        key = posixpath.join(self.key, *parts) if parts else self.key
        return ObjectPath.parse(f"{self.scheme}://{self.bucket}/{key}")

    @property
    def fs_path(self) -> str:
        """The path pyarrow's file systems take: `bucket/key`."""
        return f"{self.bucket}/{self.key}".rstrip("/")

    @property
    def name(self) -> str:
        """The last path component (the bucket's name at the top)."""
        return posixpath.basename(self.key) or self.bucket


# -- clients from the environment --------------------------------------------------------------


def configure(
    s3_endpoint_url: str | None = None,
    s3_region: str | None = None,
    gcs_endpoint: str | None = None,
) -> None:
    """Apply the config's `storage.*` overrides for this process and the ones it starts.

    They are exported as the standard variables, so Beam's own clients, Dask workers,
    MLflow's S3 client and pyarrow all see the same endpoints.
    """
    for names, value in ((S3_ENDPOINT_ENV, s3_endpoint_url), (S3_REGION_ENV, s3_region)):
        if value:
            for name in names:
                os.environ[name] = value
    if gcs_endpoint:
        os.environ[GCS_EMULATOR_ENV] = gcs_endpoint


def _first(environ: Mapping[str, str], names: Iterable[str]) -> str | None:
    return next((environ[n] for n in names if environ.get(n)), None)


def client_settings(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The endpoints and region in force (no credentials): what the log may show."""
    env = os.environ if environ is None else environ
    return {
        "s3_endpoint_url": _first(env, S3_ENDPOINT_ENV),
        "s3_region": _first(env, S3_REGION_ENV),
        "gcs_endpoint": env.get(GCS_EMULATOR_ENV) or None,
    }


def filesystem(scheme: str) -> Any:
    """The pyarrow file system for `s3` or `gs`, configured from the environment."""
    settings = client_settings()
    if scheme == "s3":
        return _s3(settings["s3_endpoint_url"], settings["s3_region"])
    if scheme == "gs":
        return _gcs(settings["gcs_endpoint"])
    raise ConfigError(f"unknown object storage scheme {scheme!r} (s3 or gs)")


@lru_cache(maxsize=8)
def _s3(endpoint: str | None, region: str | None) -> Any:
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(endpoint_override=endpoint, region=region)


@lru_cache(maxsize=8)
def _gcs(emulator: str | None) -> Any:
    import pyarrow.fs as pafs

    if not emulator:
        return pafs.GcsFileSystem()
    scheme, _, host = emulator.rpartition("://")
    # An emulator takes no credentials, as google-cloud-storage treats STORAGE_EMULATOR_HOST.
    return pafs.GcsFileSystem(endpoint_override=host, scheme=scheme or "http", anonymous=True)


def _fs(uri: str) -> tuple[Any, str]:
    location = ObjectPath.parse(uri)
    return filesystem(location.scheme), location.fs_path


# -- plain reads and writes, local or remote --------------------------------------------------


def open_input(path: str | os.PathLike[str]) -> BinaryIO:
    """A buffered, seekable binary file for reading (FileNotFoundError when missing)."""
    if not is_uri(path):
        return open(path, "rb")
    return io.BufferedReader(open_random_access(str(path)), buffer_size=_CHUNK)


def open_random_access(uri: str) -> Any:
    """A pyarrow random-access file of an object (Parquet reads its footer, then columns)."""
    fs, key = _fs(uri)
    return fs.open_input_file(key)


def sibling(path: str | os.PathLike[str], name: str) -> str:
    """The path of `name` in the same folder as `path` (a local path or a URI)."""
    if is_uri(path):
        return f"{str(path).rsplit('/', 1)[0]}/{name}"
    return str(Path(path).parent / name)


def file_size(path: str | os.PathLike[str]) -> int | None:
    """Bytes of a file, or None when there is no file at `path`."""
    if not is_uri(path):
        local = Path(path)
        return local.stat().st_size if local.is_file() else None
    found = stamp(str(path))
    return None if found is None else found[0]


def is_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a folder (for a URI: a prefix with at least one object below it)."""
    if not is_uri(path):
        return Path(path).is_dir()
    return bool(list_files(str(path), limit=1))


def list_files(uri: str, recursive: bool = True, limit: int | None = None) -> dict[str, int]:
    """Relative path (`/`-separated) -> size of every object below the prefix `uri`."""
    return {name: size for name, (size, _) in list_stamps(uri, recursive, limit).items()}


def list_stamps(
    uri: str, recursive: bool = True, limit: int | None = None
) -> dict[str, tuple[int, str]]:
    """Relative path -> (size, version token) of every object below the prefix `uri`.

    The token (S3's ETag, GCS's generation) changes whenever an object is rewritten, even
    within the same second and at the same size, which modification times do not show.
    """
    location = ObjectPath.parse(uri)
    prefix = f"{location.key}/" if location.key else ""
    found: dict[str, tuple[int, str]] = {}
    for name, size, token in _list_objects(location, prefix, "" if recursive else "/"):
        found[name[len(prefix) :]] = (size, token)
        if limit is not None and len(found) >= limit:
            break
    return found


def _list_objects(
    location: ObjectPath, prefix: str, delimiter: str
) -> Iterator[tuple[str, int, str]]:
    if location.scheme == "s3":
        pages = (
            _boto3_client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=location.bucket, Prefix=prefix, Delimiter=delimiter)
        )
        for page in pages:
            for item in page.get("Contents", []):
                # pyarrow marks emulated directories with empty `name/` objects: not files.
                if not item["Key"].endswith("/"):
                    yield item["Key"], int(item["Size"]), str(item["ETag"])
        return
    blobs = _gcs_client(client_settings()["gcs_endpoint"]).list_blobs(
        location.bucket, prefix=prefix, delimiter=delimiter or None
    )
    for blob in blobs:
        if not blob.name.endswith("/"):
            yield blob.name, int(blob.size), str(blob.generation)


def stamp(uri: str) -> tuple[int, str] | None:
    """(size, version token) of one object, or None when it does not exist."""
    location = ObjectPath.parse(uri)
    if location.scheme == "s3":
        client = _boto3_client()
        try:
            head = client.head_object(Bucket=location.bucket, Key=location.key)
        except client.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return int(head["ContentLength"]), str(head["ETag"])
    blob = _gcs_bucket(location.bucket).get_blob(location.key)
    return None if blob is None else (int(blob.size), str(blob.generation))


def read_bytes(uri: str) -> bytes | None:
    """The content of one object, or None when it does not exist."""
    fs, key = _fs(uri)
    try:
        with fs.open_input_stream(key) as fh:
            return bytes(fh.read())
    except FileNotFoundError:
        return None


def write_bytes(uri: str, data: bytes) -> None:
    """Write one object (a single PUT: readers see the old content or the new, whole)."""
    fs, key = _fs(uri)
    with fs.open_output_stream(key) as fh:
        fh.write(data)


def delete_files(uri: str, names: Iterable[str]) -> None:
    """Delete objects below `uri` (relative paths); missing ones are fine."""
    fs, key = _fs(uri)
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            fs.delete_file(f"{key}/{name}")


# -- versions: a folder committed by a marker written last --------------------------------------


def sha256_file(path: Path) -> str:
    """The hex sha256 of a local file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


Listing = dict[str, dict[str, Any]]  # relative path -> {"size": int, "sha256": str}


def local_listing(folder: Path, digest: Callable[[Path], str] = sha256_file) -> Listing:
    """The marker listing of a local folder's files (`digest` may serve cached hashes)."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    return {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": digest(p)}
        for p in files
    }


def committed(uri: str) -> Listing | None:
    """The files of the version at `uri` as its marker lists them; None if uncommitted."""
    raw = read_bytes(f"{uri}/{COMMIT_MARKER}")
    if raw is None:
        return None
    try:
        return dict(json.loads(raw)["files"])
    except (ValueError, KeyError, TypeError):
        return None  # a marker that is not ours: the version counts as uncommitted


def publish_version(
    folder: Path,
    uri: str,
    listing: Listing | None = None,
    previous: Listing | None = None,
    on_upload: Callable[[str], None] | None = None,
) -> Listing:
    """Publish a local folder as the version at `uri`: upload, then the marker, last.

    `previous` is what the version's marker lists now (None: not committed). Files listed
    there with the same content are not uploaded again. When a listed file changes or goes,
    the marker is removed first, so no reader ever combines old and new files.
    `on_upload(name)` runs after each file (fault injection in tests).
    """
    listing = local_listing(folder) if listing is None else listing
    previous = previous or {}
    changed = [n for n, meta in listing.items() if previous.get(n) != meta]
    if previous and (set(previous) - set(listing) or any(n in previous for n in changed)):
        uncommit(uri)
    remote = list_files(uri)
    _upload(folder, uri, [n for n in changed if n != COMMIT_MARKER], on_upload)
    delete_files(uri, [n for n in remote if n not in listing and n != COMMIT_MARKER])
    marker = {"files": listing, "format": 1}
    write_bytes(f"{uri}/{COMMIT_MARKER}", json.dumps(marker, sort_keys=True).encode())
    return listing


def uncommit(uri: str) -> None:
    """Remove a version's marker: from now on readers ignore it."""
    delete_files(uri, [COMMIT_MARKER])


def remove_version(uri: str) -> None:
    """Delete a version: the marker first (it disappears for readers at once), then its files."""
    uncommit(uri)
    fs, key = _fs(uri)
    fs.delete_dir_contents(key, missing_dir_ok=True)


def fetch_version(uri: str, folder: Path, listing: Listing, have: Listing | None = None) -> None:
    """Make a local folder hold exactly the listed files of a committed version.

    `have` lists what the folder holds already (files with the listed content are kept).
    """
    have = have or {}
    folder.mkdir(parents=True, exist_ok=True)
    wanted = [name for name, meta in listing.items() if have.get(name) != meta]
    _download(uri, folder, wanted, listing)
    for name in set(have) - set(listing):
        (folder / name).unlink(missing_ok=True)


def _upload(
    folder: Path, uri: str, names: list[str], on_upload: Callable[[str], None] | None
) -> None:
    fs, key = _fs(uri)

    def put(name: str) -> None:
        with open(folder / name, "rb") as src, fs.open_output_stream(f"{key}/{name}") as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
        if on_upload is not None:
            on_upload(name)

    _parallel(put, names)


def _download(uri: str, folder: Path, names: list[str], listing: Listing) -> None:
    fs, key = _fs(uri)

    def get(name: str) -> None:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(temp_name("tmp", target.name))
        with fs.open_input_stream(f"{key}/{name}") as src, open(tmp, "wb") as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
        expected = listing[name]
        if tmp.stat().st_size != expected["size"] or sha256_file(tmp) != expected["sha256"]:
            tmp.unlink()
            raise StorageError(
                f"{uri}/{name} does not match its version's marker (size or sha256): the "
                "object was changed after it was committed; republish the version"
            )
        os.replace(tmp, target)

    _parallel(get, names)


def _parallel(task: Callable[[str], None], names: list[str]) -> None:
    if len(names) <= 1:
        for name in names:
            task(name)
        return
    with ThreadPoolExecutor(min(_THREADS, len(names))) as pool:
        for _ in pool.map(task, names):
            pass


# -- conditional objects (the workdir lock) ------------------------------------------------------


def create_object(uri: str, data: bytes) -> str | None:
    """Create an object only if none exists (If-None-Match, generation 0): its version token,
    or None when one exists already."""
    location = ObjectPath.parse(uri)
    if location.scheme == "s3":
        return _s3_put(location, data, IfNoneMatch="*")
    return _gcs_put(location, data, 0)


def read_object(uri: str) -> tuple[bytes, str] | None:
    """An object's content and its version token (ETag / generation); None if absent."""
    location = ObjectPath.parse(uri)
    if location.scheme == "s3":
        client = _boto3_client()
        try:
            got = client.get_object(Bucket=location.bucket, Key=location.key)
        except client.exceptions.NoSuchKey:
            return None
        return got["Body"].read(), str(got["ETag"])
    from google.api_core.exceptions import NotFound

    blob = _gcs_bucket(location.bucket).blob(location.key)
    try:
        data = blob.download_as_bytes()
    except NotFound:
        return None
    return data, str(blob.generation)


def replace_object(uri: str, data: bytes, token: str) -> str | None:
    """Overwrite an object only if it is still at version `token`: the new token, or None."""
    location = ObjectPath.parse(uri)
    if location.scheme == "s3":
        return _s3_put(location, data, IfMatch=token)
    return _gcs_put(location, data, int(token or 0) or -1)


def delete_object(uri: str, token: str) -> bool:
    """Delete an object only if it is still at version `token`; False if it changed or went."""
    location = ObjectPath.parse(uri)
    if location.scheme == "s3":
        from botocore.exceptions import ClientError

        try:
            _boto3_client().delete_object(Bucket=location.bucket, Key=location.key, IfMatch=token)
        except ClientError as exc:
            if _s3_code(exc) in _S3_REFUSED:
                return False
            raise
        return True
    from google.api_core.exceptions import NotFound, PreconditionFailed

    try:
        _gcs_bucket(location.bucket).blob(location.key).delete(if_generation_match=int(token))
    except (PreconditionFailed, NotFound):
        return False
    return True


# The answers of a conditional S3 request whose condition did not hold.
_S3_REFUSED = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404"})


def _s3_code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code"))


def _s3_put(location: ObjectPath, data: bytes, **condition: str) -> str | None:
    from botocore.exceptions import ClientError

    try:
        put = _boto3_client().put_object(
            Bucket=location.bucket, Key=location.key, Body=data, **condition
        )
    except ClientError as exc:
        if _s3_code(exc) in _S3_REFUSED:
            return None
        raise
    return str(put["ETag"])


def _gcs_put(location: ObjectPath, data: bytes, generation: int) -> str | None:
    from google.api_core.exceptions import NotFound, PreconditionFailed

    blob = _gcs_bucket(location.bucket).blob(location.key)
    try:
        blob.upload_from_string(data, if_generation_match=generation)
    except (PreconditionFailed, NotFound):
        return None
    return str(blob.generation)


@contextlib.contextmanager
def storage_errors(uri: str) -> Iterator[None]:
    """Turn a client's failure to reach or use object storage into a one-line StorageError."""
    try:
        yield
    except (ConfigError, StorageError):
        raise
    except Exception as exc:
        if not _is_client_error(exc):
            raise
        reason = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise StorageError(
            f"object storage {uri}: {type(exc).__name__}: {reason}. Check the endpoint "
            "(AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST or storage.*), the credentials in the "
            "environment and that the bucket exists, then rerun the same command"
        ) from None


def _is_client_error(exc: BaseException) -> bool:
    # pyarrow reports S3/GCS failures as OSError without an errno; a local disk's errors
    # (ENOSPC on the local copy) keep theirs and are reported as such by the caller.
    if isinstance(exc, OSError):
        return exc.errno is None
    module = type(exc).__module__
    return module.startswith(("botocore", "boto3", "google.", "urllib3", "requests"))


def _boto3_client() -> Any:
    settings = client_settings()
    return _boto3(settings["s3_endpoint_url"], settings["s3_region"])


@lru_cache(maxsize=8)
def _boto3(endpoint: str | None, region: str | None) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name=region)


def _gcs_bucket(name: str) -> Any:
    return _gcs_client(client_settings()["gcs_endpoint"]).bucket(name)


@lru_cache(maxsize=8)
def _gcs_client(emulator: str | None) -> Any:
    from google.cloud import storage

    if emulator:
        # google-cloud-storage reads STORAGE_EMULATOR_HOST itself; it needs no credentials.
        from google.auth.credentials import AnonymousCredentials

        anonymous = AnonymousCredentials()  # type: ignore[no-untyped-call]
        return storage.Client(project="recsys", credentials=anonymous)
    return storage.Client()
