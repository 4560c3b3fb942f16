"""A real PostgreSQL server for tests: initdb + pg_ctl in a temp folder, on 127.0.0.1.

The binaries come from the OS package (`apt-get install postgresql`: .ci/run does it). As root
(CI, containers) PostgreSQL refuses to run, so the cluster is created and run as the
`postgres` system user the package adds. Without the binaries, `find_bin` says why and the
tests skip with that reason.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.mlflow_server import free_port

USER = "mlflow"
PASSWORD = "mlflow-test-password"
DATABASE = "mlflow"


@dataclass(frozen=True)
class PostgresServer:
    """A running cluster: the SQLAlchemy URI of its `mlflow` database, its port and folder."""

    uri: str
    port: int
    root: Path


def find_bin() -> tuple[Path | None, str]:
    """The folder of initdb/pg_ctl, or None and why (the skip reason)."""
    found = shutil.which("pg_ctl")
    candidates = [Path(found).parent] if found else []
    candidates += [Path(p).parent for p in sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))]
    for folder in candidates:
        if (folder / "initdb").is_file():
            if os.geteuid() == 0 and not _has_user("postgres"):
                return None, "running as root and there is no 'postgres' user to run PostgreSQL"
            return folder, ""
    return None, "PostgreSQL is not installed (apt-get install postgresql; .ci/run does it)"


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _run(args: list[str], *, as_postgres: bool, **kwargs: object) -> None:
    user = "postgres" if as_postgres else None
    subprocess.run(args, check=True, capture_output=True, timeout=120, user=user, **kwargs)  # type: ignore[call-overload]


@contextmanager
def postgres_server(bin_dir: Path) -> Iterator[PostgresServer]:
    """Start a fresh cluster (password auth, user and database `mlflow`), stop and delete it."""
    as_postgres = os.geteuid() == 0
    # Not under pytest's tmp folder: as root that is mode 0700, out of the postgres user's reach.
    root = Path(tempfile.mkdtemp(prefix="recsys-pg-"))
    data, sockets, pwfile = root / "data", root / "sockets", root / "pwfile"
    sockets.mkdir()
    pwfile.write_text(PASSWORD + "\n")
    if as_postgres:
        for path in (root, sockets, pwfile):
            shutil.chown(path, "postgres", "postgres")
    port = free_port()
    try:
        initdb = [str(bin_dir / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}"]
        _run([*initdb, "--auth=scram-sha-256", "-E", "UTF8", "--no-sync"], as_postgres=as_postgres)
        options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off"
        _run([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"),
              "-w", "-t", "60", "start"], as_postgres=as_postgres)  # fmt: skip
        _create_database(port, DATABASE)
        yield PostgresServer(_uri(port, DATABASE), port, root)
    finally:
        subprocess.run(
            [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
            capture_output=True, timeout=60, user="postgres" if as_postgres else None,
            check=False,
        )  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def postgres_or_skip() -> Iterator[PostgresServer]:
    """A fresh cluster, or the test skipped naming why PostgreSQL cannot run here."""
    bin_dir, reason = find_bin()
    if bin_dir is None:
        import pytest

        pytest.skip(reason)
    with postgres_server(bin_dir) as server:
        yield server


def _uri(port: int, database: str) -> str:
    # SQLAlchemy's plain postgresql:// now means psycopg 3; MLflow gets the pinned psycopg2.
    return f"postgresql+psycopg2://{USER}:{PASSWORD}@127.0.0.1:{port}/{database}"


def create_database(server: PostgresServer, name: str) -> str:
    """Another database on the cluster (e.g. the auth app's); its URI."""
    _create_database(server.port, name)
    return _uri(server.port, name)


def _create_database(port: int, name: str) -> None:
    import psycopg2

    deadline = time.monotonic() + 30
    while True:
        try:
            conn = psycopg2.connect(
                host="127.0.0.1", port=port, user=USER, password=PASSWORD, dbname="postgres"
            )
            break
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.autocommit = True
    with conn.cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {name}")
    conn.close()


def count(uri: str, query: str) -> int:
    """One integer from the database (e.g. rows in MLflow's `runs` table)."""
    import psycopg2

    conn = psycopg2.connect(uri.replace("postgresql+psycopg2://", "postgresql://"))
    try:
        with conn.cursor() as cursor:
            cursor.execute(query)
            return int(cursor.fetchone()[0])
    finally:
        conn.close()
