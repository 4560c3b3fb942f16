"""One process at a time per working directory: an advisory lock with its holder's identity.

The lock is `fcntl.flock` on `<workdir>/.recsys.lock`. The kernel releases it when the holder
dies, even by SIGKILL, so a stale lock (file left behind, holder gone) is taken over without
guessing from pids; the file's contents (pid, host, start time, command) only name the holder.
flock is reliable on local disks and on most network filesystems that Kubernetes volumes use
(NFSv4 maps it to byte-range locks); see docs/OPERATIONS.md.

A working directory in a bucket is locked twice: its local copy by flock as above, and the
bucket by a lock object `<uri>/.recsys.lock` created only if absent (S3 If-None-Match, GCS
generation 0), so processes on different machines exclude each other too. The holder renews
the object's lease while it runs; a holder that died is taken over when its lease has expired,
or at once when it was a process on this host that no longer exists. Takeover and renewal are
conditional on the object's version (If-Match, generation), so two takers cannot both win.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from recsys.core import storage
from recsys.core.errors import WorkdirLockedError
from recsys.core.layout import WorkdirFile, process_alive

log = logging.getLogger(__name__)

LOCK_FILE = WorkdirFile.LOCK


def holder_info(command: str) -> dict[str, Any]:
    """Who is taking the lock: pid, host, start time (UTC) and the command."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command,
    }


def describe(holder: dict[str, Any]) -> str:
    """A holder as one readable phrase."""
    if not holder:
        return "an unknown process"
    return (
        f"pid {holder.get('pid')} on {holder.get('host')} "
        f"(`{holder.get('command')}`, started {holder.get('started')})"
    )


class WorkdirLock:
    """Exclusive lock on a working directory; a context manager, re-entrant per process."""

    _held: dict[Path, int] = {}

    def __init__(
        self, root: Path, command: str = " ".join(sys.argv), remote: str | None = None
    ) -> None:
        self.path = root / LOCK_FILE
        self.command = command
        self._fd: int | None = None
        self._bucket = BucketLock(f"{remote}/{LOCK_FILE}", command) if remote else None

    def acquire(self) -> None:
        """Take the lock or raise WorkdirLockedError naming the holder."""
        if self.path in WorkdirLock._held:
            return  # this process already holds it (backfill -> nightly)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            # The holder writes its record just after taking the lock: give it a moment.
            deadline = time.monotonic() + 2.0
            while not holder and time.monotonic() < deadline:
                time.sleep(0.05)
                holder = _read_holder(fd)
            os.close(fd)
            raise WorkdirLockedError(
                f"{self.path.parent} is in use by {describe(holder)}; "
                "wait for it to finish (a dead holder's lock is released automatically)"
            ) from None
        previous = _read_holder(fd)
        if previous and not _same_process(previous):
            log.warning("taking over the lock left by %s, which is gone", describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder_info(self.command)) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        WorkdirLock._held[self.path] = fd
        if self._bucket is not None:
            try:
                self._bucket.acquire()
            except BaseException:
                self.release()
                raise

    def release(self) -> None:
        """Release the lock if this object took it."""
        if self._fd is None:
            return
        if self._bucket is not None:
            self._bucket.release()
        WorkdirLock._held.pop(self.path, None)
        # Emptied while still locked (no one else can write it now): a record found by the
        # next holder then always means a holder that died without releasing.
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        return json.loads(raw) if raw else {}
    except (OSError, ValueError):
        return {}


def _same_process(holder: dict[str, Any]) -> bool:
    return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


LEASE_SECONDS = 120.0  # a bucket lock whose holder stopped renewing it for this long is stale


class BucketLock:
    """The lock object of a working directory in a bucket, renewed while held (see above)."""

    def __init__(self, uri: str, command: str, lease_seconds: float = LEASE_SECONDS) -> None:
        self.uri = uri
        self.command = command
        self.lease_seconds = lease_seconds
        self._token: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _record(self) -> bytes:
        expires = time.time() + self.lease_seconds
        return (json.dumps({**holder_info(self.command), "expires": expires}) + "\n").encode()

    def acquire(self) -> None:
        """Create the lock object, or take over a dead holder's; else WorkdirLockedError."""
        with storage.storage_errors(self.uri):
            token = storage.create_object(self.uri, self._record())
            if token is None:
                token = self._take_over()
        self._token = token
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, name="recsys-lock", daemon=True)
        self._renewer.start()

    def _take_over(self) -> str:
        found = storage.read_object(self.uri)
        if found is None:  # released in between: try once more from the start
            token = storage.create_object(self.uri, self._record())
            if token is not None:
                return token
            found = storage.read_object(self.uri) or (b"", "")
        data, version = found
        holder = _parse(data)
        if not _is_stale(holder):
            raise WorkdirLockedError(
                f"{self.uri.rsplit('/', 1)[0]} is in use by {describe(holder)}; wait for it "
                f"to finish (a dead holder's lock is taken over once its "
                f"{self.lease_seconds:.0f} s lease has expired)"
            )
        token = storage.replace_object(self.uri, self._record(), version)
        if token is None:
            raise WorkdirLockedError(
                f"{self.uri.rsplit('/', 1)[0]}: another process took over the stale lock of "
                f"{describe(holder)} first; rerun later"
            )
        log.warning("taking over the bucket lock left by %s, which is gone", describe(holder))
        return token

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_seconds / 4):
            try:
                token = storage.replace_object(self.uri, self._record(), self._token or "")
            except Exception as exc:  # a transient error: the next renewal tries again
                log.warning("could not renew the bucket lock %s: %s", self.uri, exc)
                continue
            if token is None:
                log.error("the bucket lock %s was taken by another process", self.uri)
                return
            self._token = token

    def release(self) -> None:
        """Stop renewing and delete the lock object (only if it is still ours)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self._token is not None:
            try:
                storage.delete_object(self.uri, self._token)
            except Exception as exc:  # the lease runs out on its own
                log.warning("could not delete the bucket lock %s: %s", self.uri, exc)
            self._token = None


def _parse(data: bytes) -> dict[str, Any]:
    try:
        holder = json.loads(data.decode("utf-8", "replace"))
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _is_stale(holder: dict[str, Any]) -> bool:
    """An expired lease, or a holder on this host whose process is gone."""
    if not holder or float(holder.get("expires", 0)) < time.time():
        return True
    if holder.get("host") != socket.gethostname():
        return False
    try:
        pid = int(holder.get("pid", 0))
    except (TypeError, ValueError):
        return False
    if pid <= 0 or not process_alive(pid):
        return pid > 0
    return _same_process(holder)  # our own pid: a lock this process forgot to release
