"""Exception types; the CLI turns each into one line and an exit code."""

from __future__ import annotations


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


class StageFailedError(RecsysError):
    """A stage failed for a reason that is not bad input or infrastructure (see the log)."""

    exit_code = 10
