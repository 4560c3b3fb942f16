"""The tracking store is checked before a night starts: one line, exit 6, no password.

A store that cannot be used (its database driver is not installed, a wrong password on a real
PostgreSQL) stops `recsys nightly` before the first stage, and `recsys sync` with one line,
instead of four stages of work followed by a traceback.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import yaml

from conductor import cli
from recsys.core.config import parse_config
from recsys.core.layout import RunFile, Workdir
from tests.conftest import SMALL, SMALL_DATE
from tests.postgres_server import PASSWORD, PostgresServer
from tests.test_tracking_registry import PER_USER, fake_run

WRONG = "wrong-pw-4567"


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("recsys: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def _config(tmp_path: Path, uri: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "tracking": {"uri": uri, "retries": 2,
                                                          "backoff_seconds": 0.1}}))  # fmt: skip
    return path


def _nightly(config: Path, work: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit code, stderr) of `recsys nightly` on SMALL's date."""
    code = cli.main(["nightly", "--config", str(config), "--workdir", str(work),
                     "--date", SMALL_DATE])  # fmt: skip
    return code, capsys.readouterr().err


def test_a_missing_database_driver_stops_the_night_before_its_first_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # SQLAlchemy's plain postgresql:// means psycopg 3, which is not installed (psycopg2 is).
    config = _config(tmp_path, f"postgresql://mlflow:{WRONG}@127.0.0.1:9/mlflow")
    work = tmp_path / "work"
    code, err = _nightly(config, work, capsys)
    line = _error_line(err)
    assert code == 6
    assert "No module named 'psycopg'" in line and "postgresql+psycopg2://" in line
    assert "Nothing was started" in line
    assert WRONG not in err
    assert not (work / "data").exists() and not (work / "raw").exists()


def test_a_wrong_password_stops_the_night_before_its_first_stage(
    postgres: PostgresServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, postgres.uri.replace(PASSWORD, WRONG))
    work = tmp_path / "work"
    code, err = _nightly(config, work, capsys)
    line = _error_line(err)
    assert code == 6
    assert "password authentication failed" in line and f"127.0.0.1:{postgres.port}" in line
    assert WRONG not in err and PASSWORD not in err
    assert not (work / "data").exists()


def test_sync_with_a_wrong_password_is_one_line_and_keeps_the_pending_run(
    postgres: PostgresServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, postgres.uri.replace(PASSWORD, WRONG))
    workdir = Workdir(tmp_path / "work")
    date = dt.date.fromisoformat(SMALL_DATE)
    run_dir = fake_run(workdir, parse_config(yaml.safe_load(config.read_text())), date, PER_USER)
    (run_dir / RunFile.PENDING).write_text("{}")
    code = cli.main(["sync", "--config", str(config), "--workdir", str(workdir.root),
                     "--date", SMALL_DATE])  # fmt: skip
    err = capsys.readouterr().err
    line = _error_line(err)
    assert code == 6 and "password authentication failed" in line
    assert f"recsys sync --date {SMALL_DATE}" in line
    assert WRONG not in err and PASSWORD not in err
    marker = (run_dir / RunFile.PENDING).read_text()
    assert "password authentication failed" in marker and WRONG not in marker
