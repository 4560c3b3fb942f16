"""Exception types; the CLI turns each into one line and an exit code."""

from __future__ import annotations

import errno
import os

# errno values that mean "the disk, not the program": reported as StorageError (exit 9).
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})
# ... and a working directory this user may not write.
ACCESS_ERRNOS = frozenset({errno.EACCES, errno.EPERM})


class RecsysError(Exception):
    """Base class of every error meant for the user (no traceback in the CLI)."""

    exit_code = 1


class ConfigError(RecsysError):
    """The configuration file or a command-line value is invalid."""

    exit_code = 2


class DataError(RecsysError):
    """Input data cannot be used (missing file, bad format, too many rejected rows)."""

    exit_code = 3


class EmbeddingsContractError(DataError):
    """Embedding files disagree with their manifest (dim, vocabulary hash, checksum, rows)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class StageNotReadyError(RecsysError):
    """A stage was asked to run before the stage it depends on finished."""

    exit_code = 4


class ExportVerificationError(RecsysError):
    """An exported SavedModel did not reproduce the in-memory model's outputs."""

    exit_code = 5


class TrackingError(RecsysError):
    """The MLflow tracking store could not be reached or written."""

    exit_code = 6


class OutOfMemoryError(RecsysError):
    """Training ran out of device memory; the message names the batch size to lower."""

    exit_code = 7


class WorkdirLockedError(RecsysError):
    """Another recsys process holds the working directory's lock."""

    exit_code = 8


class StorageError(RecsysError):
    """The working directory cannot be written (disk full, read-only, permissions)."""

    exit_code = 9


class ServedModelError(RecsysError):
    """A version that models.config routes TF Serving to is missing files or was altered."""

    exit_code = 11


class StateDriftError(RecsysError):
    """Records that must agree (registry aliases, models.config, champion.json, run states,
    served versions) do not, and `recsys repair` could not (or, with --check, did not) fix it."""

    exit_code = 12


class StageFailedError(RecsysError):
    """A stage failed for a reason that is not bad input or infrastructure (see the log)."""

    exit_code = 10


def storage_errno(exc: BaseException) -> int | None:
    """The storage errno behind `exc`: an OSError's own, or one TensorFlow names in its text.

    TensorFlow raises ResourceExhaustedError ("...; No space left on device") for a full
    disk, the type it also uses for out of memory: only the message tells them apart.
    """
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        return exc.errno
    text = str(exc)
    for code in sorted(STORAGE_ERRNOS):
        if text and (os.strerror(code) in text or errno.errorcode[code] in text.split()):
            return code
    return None


def access_errno(exc: BaseException) -> int | None:
    """EACCES/EPERM behind `exc`: an OSError's own, or TensorFlow's "Permission denied" text."""
    if isinstance(exc, OSError) and exc.errno in ACCESS_ERRNOS:
        return exc.errno
    return errno.EACCES if os.strerror(errno.EACCES) in str(exc) else None
