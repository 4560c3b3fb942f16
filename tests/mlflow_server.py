"""A real `mlflow server` for tests: SQLite (or a given) store, local artifacts, one worker.

Options for the production set-up (tests/test_tracking_postgres.py): a PostgreSQL backend,
`--serve-artifacts` (clients upload through the server) and the basic-auth app.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MlflowServer:
    """A running tracking server: its URI, where it stores things, and how long it took to start."""

    uri: str
    root: Path
    artifacts: Path
    log: Path
    startup_s: float


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mlflow_executable() -> str:
    """The `mlflow` CLI of the running interpreter's environment (else the one on PATH)."""
    sibling = Path(sys.executable).parent / "mlflow"
    found = str(sibling) if sibling.is_file() else shutil.which("mlflow")
    if found is None:
        raise FileNotFoundError(f"no mlflow executable next to {sys.executable} or on PATH")
    return found


@contextmanager
def mlflow_server(
    root: Path,
    *,
    timeout_s: float = 120.0,
    port: int | None = None,
    backend_uri: str | None = None,
    serve_artifacts: bool = False,
    artifacts_destination: str | None = None,
    app_name: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[MlflowServer]:
    """Start `mlflow server` under `root`, wait until /health answers, stop its process group.

    `port` pins the port (e.g. a server "coming back" where clients expect it); default: free.
    `backend_uri` replaces the SQLite store; `serve_artifacts` proxies artifacts (stored under
    `root/artifacts`, or at `artifacts_destination`, e.g. an s3:// bucket the server reaches
    through `env`); `app_name` (e.g. "basic-auth") and `env` are passed to the server.
    """
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    artifacts = root / "artifacts"
    log = root / "server.log"
    store = ["--artifacts-destination" if serve_artifacts else "--default-artifact-root",
             artifacts_destination or str(artifacts.resolve())]  # fmt: skip
    command = [
        mlflow_executable(), "server",
        "--backend-store-uri", backend_uri or f"sqlite:///{root.resolve() / 'mlflow.db'}",
        *store, *(["--serve-artifacts"] if serve_artifacts else []),
        *(["--app-name", app_name] if app_name else []),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, **_SERVER_ENV, **(env or {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    started = time.monotonic()
    with log.open("ab") as sink:
        # Own session: uvicorn (and huey, if job execution were on) are children that a plain
        # terminate() would orphan; killing the group stops them all.
        proc = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        uri = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, uri, log, timeout_s)
        yield MlflowServer(uri, root, artifacts, log, time.monotonic() - started)
    finally:
        stop_group(proc)


# Job execution adds a job runner and huey consumers (~15 processes); tests need none of them.
_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}


def _wait_healthy(proc: subprocess.Popen[bytes], uri: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"mlflow server exited with code {proc.returncode} before answering /health; "
                f"its log ({log}):\n{_tail(log)}"
            )
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet
        time.sleep(0.2)
    raise TimeoutError(
        f"mlflow server at {uri} did not answer /health within {timeout_s:.0f} s; "
        f"its log ({log}):\n{_tail(log)}"
    )


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started with start_new_session=True and all its children."""
    # The server is its session's leader, so its pid is the process group id.
    for sig, grace_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if _group_gone(proc, grace_s):
            return


def _group_gone(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader: a zombie still counts as a member of the group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
