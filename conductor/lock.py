"""One process at a time per working directory: an advisory lock with its holder's identity.

The lock is `fcntl.flock` on `<workdir>/.recsys.lock`. The kernel releases it when the holder
dies, even by SIGKILL, so a stale lock (file left behind, holder gone) is taken over without
guessing from pids; the file's contents (pid, host, start time, command) only name the holder.
flock is reliable on local disks and on most network filesystems that Kubernetes volumes use
(NFSv4 maps it to byte-range locks); see docs/OPERATIONS.md.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from recsys.core.errors import WorkdirLockedError
from recsys.core.layout import WorkdirFile

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

    def __init__(self, root: Path, command: str = " ".join(sys.argv)) -> None:
        self.path = root / LOCK_FILE
        self.command = command
        self._fd: int | None = None

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

    def release(self) -> None:
        """Release the lock if this object took it."""
        if self._fd is None:
            return
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
