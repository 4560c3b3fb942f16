"""`recsys tune --workers N`: trials in N processes at once on one Optuna study.

Optuna's RDB storage on SQLite is for one process: concurrent writers from several
processes get "database is locked". So the workers never open the database themselves. One
proxy process (Optuna's gRPC storage proxy, `run_grpc_proxy_server`, on 127.0.0.1) owns the
study's storage, SQLite or PostgreSQL alike, and the workers reach it with
`GrpcStorageProxy`: one storage for one worker or many, so a search started with one worker
resumes with four. Each worker is pinned to its share of the CPU cores (sched_setaffinity),
from which TensorFlow sizes its thread pools, and gets SIGKILL when the `recsys tune` that
started it dies (recsys.core.children). A worker's settings reach it on its standard input,
never on disk (the config may carry a tracking credential).

Run as `python -m recsys.tuning_parallel proxy` (the proxy; the workers are
`python -m recsys.tuning worker`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import optuna

from recsys.core.children import die_with_parent
from recsys.core.errors import (
    ConfigError,
    DataError,
    OutOfMemoryError,
    RecsysError,
    StageFailedError,
    StorageError,
    TrackingError,
)
from recsys.tuning_study import open_storage, trials_ended

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
_READY_SECONDS = 120.0
_POLL_SECONDS = 2.0
_PINNING = hasattr(os, "sched_setaffinity")  # Linux; elsewhere workers share every core
_ERRORS = (ConfigError, DataError, TrackingError, OutOfMemoryError, StorageError)


@dataclass
class WorkerExit:
    """How one worker process ended."""

    worker: int
    pid: int
    code: int  # negative: killed by that signal


def cores_for(worker: int, workers: int, cores: list[int]) -> set[int]:
    """The CPU cores worker `worker` (0-based) of `workers` may use: its share of `cores`."""
    if workers >= len(cores):
        return {cores[worker % len(cores)]}
    share = len(cores) // workers
    return set(cores[worker * share : (worker + 1) * share])


def run_workers(
    storage_url: str,
    study_name: str,
    specs: list[dict[str, Any]],
    progress: Callable[[int], None] | None = None,
) -> list[WorkerExit]:
    """Start the proxy and one `recsys.tuning worker` process per spec; wait for them all.

    `progress` is called with the study's ended-trial count whenever it changes.
    """
    port = _free_port()
    proxy = _start("recsys.tuning_parallel", "proxy", {"storage": storage_url, "port": port})
    try:
        storage = _wait_ready(proxy, port, study_name)
        cores = sorted(os.sched_getaffinity(0)) if _PINNING else list(range(os.cpu_count() or 1))
        workers = [
            _start("recsys.tuning", "worker", {**spec, "port": port},
                   cores_for(i, len(specs), cores))
            for i, spec in enumerate(specs)
        ]  # fmt: skip
        log.info("tuning workers started: pids %s, proxy on %s:%d", [w.pid for w in workers],
                 HOST, port)  # fmt: skip
        _wait(workers, storage, study_name, progress)
    finally:
        proxy.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proxy.wait(timeout=30)
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()
    return [WorkerExit(i, w.pid, w.returncode) for i, w in enumerate(workers)]


def _start(
    module: str, role: str, spec: dict[str, Any], cores: set[int] | None = None
) -> subprocess.Popen[bytes]:
    arm = die_with_parent()

    def setup() -> None:
        if arm is not None:
            arm()
        if cores and _PINNING:
            os.sched_setaffinity(0, cores)

    process = subprocess.Popen(
        [sys.executable, "-m", module, role], stdin=subprocess.PIPE, preexec_fn=setup
    )
    assert process.stdin is not None
    process.stdin.write(json.dumps(spec).encode())
    process.stdin.close()
    return process


def _wait_ready(
    proxy: subprocess.Popen[bytes], port: int, study_name: str
) -> optuna.storages.BaseStorage:
    """A client of the proxy once it answers; StageFailedError if it died or never did."""
    deadline = time.monotonic() + _READY_SECONDS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.GrpcStorageProxy(host=HOST, port=port)
    while True:
        try:
            storage.get_study_id_from_name(study_name)
            return storage
        except Exception as exc:  # grpc.RpcError until the server listens
            if proxy.poll() is not None or time.monotonic() > deadline:
                raise StageFailedError(
                    f"the tuning study's proxy on {HOST}:{port} did not start "
                    f"(exit code {proxy.poll()}; {type(exc).__name__}); see the log above"
                ) from None
            time.sleep(0.2)


def _wait(
    workers: list[subprocess.Popen[bytes]],
    storage: optuna.storages.BaseStorage,
    study_name: str,
    progress: Callable[[int], None] | None,
) -> None:
    seen = -1
    while any(w.poll() is None for w in workers):
        time.sleep(_POLL_SECONDS)
        if progress is None:
            continue
        with suppress(Exception):  # the count is informative; the workers do the work
            study = optuna.load_study(study_name=study_name, storage=storage)
            ended = trials_ended(study)
            if ended != seen:
                seen = ended
                progress(ended)


def worker_error(exits: list[WorkerExit]) -> RecsysError | None:
    """The error to end the search with when a worker failed (its own exit code's type)."""
    failed = [e for e in exits if e.code != 0]
    if not failed:
        return None
    first = failed[0]
    how = (
        f"was killed by signal {-first.code} (from outside: the OOM killer, a kill)"
        if first.code < 0
        else f"exited with code {first.code} (its error is in the log above)"
    )
    kind = next((c for c in _ERRORS if c.exit_code == first.code), StageFailedError)
    return kind(
        f"tuning worker {first.worker} (pid {first.pid}) {how}; {len(failed)} of {len(exits)} "
        "workers failed. The trials they were running are failed and queued again: rerun the "
        "same command to continue the study"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _proxy_main() -> int:
    spec = json.load(sys.stdin)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    storage = open_storage(spec["storage"])
    # SIGTERM (the search is over) ends the server: the default action kills the process.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.run_grpc_proxy_server(storage, host=HOST, port=int(spec["port"]))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["proxy"]:
        sys.exit("usage: python -m recsys.tuning_parallel proxy  (settings as JSON on stdin)")
    sys.exit(_proxy_main())
