"""What recsys writes and deletes stays inside --workdir, under its lock, and is its own.

Through the real CLI: a folder of the working directory that links outside it is refused
before anything is written (exit 2, naming the link); the cleanup of interrupted writers
removes only recsys's own temporaries of processes that are gone; every command that writes
under the working directory waits for no one and exits 8 while another holds its lock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conductor import cli
from recsys.core.layout import clean_temporaries
from tests.conftest import SMALL, SMALL_DATE


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("recsys: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return path


@pytest.mark.parametrize("linked", ["export", "data", "runs/2026-01-05"])
def test_a_folder_linking_outside_the_workdir_is_refused_before_any_write(
    tmp_path: Path, config_file: Path, linked: str, capsys: pytest.CaptureFixture[str]
) -> None:
    work, outside = tmp_path / "work", tmp_path / "elsewhere"
    outside.mkdir()
    (work / linked).parent.mkdir(parents=True)
    (work / linked).symlink_to(outside, target_is_directory=True)
    args = ["--config", str(config_file), "--workdir", str(work), "--date", SMALL_DATE]
    code = cli.main(["nightly", *args])
    line = _error_line(capsys.readouterr().err)
    assert code == 2
    assert f"{work / linked} is a symbolic link to {outside}, outside the working directory" in line
    assert list(outside.iterdir()) == []  # nothing written (or deleted) through the link
    assert not (work / "mlflow").exists() and not (work / "raw").exists()


def test_a_link_that_stays_inside_the_workdir_is_fine(tmp_path: Path) -> None:
    from recsys.core.layout import Workdir

    work = tmp_path / "work"
    (work / "volumes" / "export").mkdir(parents=True)
    (work / "export").symlink_to(work / "volumes" / "export")
    Workdir(work).check_links()
    assert Workdir(work).export("query") == work / "export" / "query"


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def test_cleanup_removes_only_recsys_temporaries_of_processes_that_are_gone(
    tmp_path: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work, dead = tmp_path / "work", _dead_pid()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) as alive:
        try:
            ours = [work / "export" / f".staging-3-pid{dead}-0a1b2c3d",
                    work / "export" / "query" / f".old-2-pid{dead}-0a1b2c3d",
                    work / "data" / f".tmp-{SMALL_DATE}-pid{dead}-abcd_123"]  # fmt: skip
            theirs = [
                work / "export" / ".old-keep",  # an operator's own folders: look-alike names
                work / "export" / ".staging-mine",
                work / "data" / ".tmp-2026-01-05-0a1b2c3d",  # no pid: not a recsys name
                work / "export" / f".staging-4-pid{alive.pid}-0a1b2c3d",  # a live process's
            ]
            for path in ours + theirs:
                path.mkdir(parents=True)
            outside = tmp_path / "outside"
            outside.mkdir()
            (work / "runs" / SMALL_DATE).mkdir(parents=True)
            link = work / "runs" / SMALL_DATE / f".tmp-x-pid{dead}-0a1b2c3d"
            link.symlink_to(outside)  # never followed, never removed
            # Any writing command cleans up first; this one then stops: no data yet (exit 4).
            args = ["--config", str(config_file), "--workdir", str(work), "--date", SMALL_DATE]
            assert cli.main(["train", *args]) == 4
        finally:
            alive.kill()
    capsys.readouterr()
    assert [p for p in ours if p.exists()] == []
    assert [p for p in theirs if not p.exists()] == []
    assert link.is_symlink() and outside.is_dir()


def test_a_name_made_by_this_process_is_its_own_to_clean(tmp_path: Path) -> None:
    from recsys.core.layout import temp_name

    name = temp_name("staging", "7")
    assert name.startswith(f".staging-7-pid{os.getpid()}-")
    (tmp_path / "export" / name).mkdir(parents=True)
    assert clean_temporaries(tmp_path) == [tmp_path / "export" / name]


_HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from conductor.lock import WorkdirLock
    with WorkdirLock(Path(sys.argv[1]), command="holder-under-test"):
        print("held", flush=True)
        time.sleep(120)
    """
)


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Path]:
    """A working directory whose lock another process holds."""
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(work)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield work
    proc.kill()
    proc.wait()


def test_every_command_that_writes_under_the_workdir_waits_for_no_one(
    held: Path, tmp_path: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    users = tmp_path / "users.txt"
    users.write_text("u1\nu2\n")
    events = tmp_path / "events.csv"
    events.write_text("user_id,variant,timestamp,clicks\nu1,A,2026-01-01,1\nu2,B,2026-01-01,0\n")
    common = ["--config", str(config_file), "--workdir", str(held)]
    commands = {
        "compare": ["compare", "v1", "v2", "--no-log"],
        "ab assign": ["ab", "assign", "--experiment", "e", "--users", str(users), "--no-log"],
        "ab analyze": ["ab", "analyze", "--experiment", "e", "--events", str(events)],
        "embeddings export": ["embeddings", "export", "--version", "1", "--format", "npy"],
        "repair": ["repair"],
    }
    for name, args in commands.items():
        code = cli.main([*args, *common, *(["--no-log"] if name == "ab analyze" else [])])
        line = _error_line(capsys.readouterr().err)
        assert code == 8, (name, line)
        assert "holder-under-test" in line, name
    assert sorted(p.name for p in held.iterdir()) == [".recsys.lock"]  # nothing written
