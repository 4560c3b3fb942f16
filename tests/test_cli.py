"""CLI behaviour for user mistakes: one line on stderr, a specific exit code, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def recsys(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real `recsys` entry point in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "conductor.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def _one_line_error(proc: subprocess.CompletedProcess[str], code: int, match: str) -> None:
    assert proc.returncode == code, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("recsys: error:")]
    assert len(lines) == 1 and match in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_config_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("training:\n  epoch: 3\n")
    proc = recsys("train", "--config", str(cfg), "--workdir", str(tmp_path / "w"))
    _one_line_error(proc, 2, "training.epoch: unknown key")


def test_bad_date(tmp_path: Path) -> None:
    proc = recsys("train", "--date", "2026-13-01", "--workdir", str(tmp_path))
    _one_line_error(proc, 2, "--date must be YYYY-MM-DD")


@pytest.mark.parametrize("command", ["train", "evaluate", "export"])
def test_stage_before_its_input_exists(tmp_path: Path, command: str) -> None:
    proc = recsys(command, "--date", "2026-01-05", "--workdir", str(tmp_path))
    _one_line_error(proc, 4, "first")


def test_missing_input_file(tmp_path: Path) -> None:
    proc = recsys("preprocess", "--input", str(tmp_path / "nope.csv"), "--workdir", str(tmp_path))
    _one_line_error(proc, 3, "nope.csv")


def test_help_lists_every_stage() -> None:
    proc = recsys("--help")
    assert proc.returncode == 0
    for command in ("preprocess", "train", "evaluate", "export", "nightly"):
        assert command in proc.stdout
