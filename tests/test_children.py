"""Helper processes die with recsys, and scratch space stays under the working directory.

`recsys export` is killed (SIGKILL, as the OOM killer does) while its fresh-process reload
check and saved_model_cli run: both children must go with it, and their scratch folder must be
under the workdir (never the system temp folder), where the next command removes it.
"""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conductor import stages
from recsys.core.config import parse_config
from recsys.core.layout import Workdir
from tests.conftest import SMALL, SMALL_DATE, plain

pytestmark = pytest.mark.slow


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of the processes whose parent is `pid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _both_running(children: dict[int, str]) -> bool:
    """Whether the reload check and a saved_model_cli are both among `children`."""
    commands = children.values()
    return any("reload_check.py" in c for c in commands) and any(
        "saved_model_cli" in c for c in commands
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_a_killed_export_takes_its_children_and_leaves_scratch_only_under_the_workdir(
    tmp_path: Path,
) -> None:
    raw = plain({**SMALL, "training": {**SMALL["training"], "epochs": 1}})  # not about the model
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    config, workdir = parse_config(raw), Workdir(tmp_path / "work")
    date = dt.date.fromisoformat(SMALL_DATE)
    data_dir, _ = stages.preprocess(config, workdir, date)
    run_dir, _ = stages.train(config, workdir, date, data_dir)
    system_tmp = Path(tempfile.gettempdir())
    before = set(system_tmp.glob("recsys-verify-*"))
    args = ["export", "--verify", "--config", str(config_file), "--workdir", str(workdir.root),
            "--date", SMALL_DATE, "--run-id", run_dir.name]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "conductor.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 600
    children: dict[int, str] = {}
    # Until both children are seen at once: saved_model_cli runs beside the reload check, one
    # model at a time (bounded memory), so a snapshot between two models holds none of it.
    while not _both_running(children):
        assert proc.poll() is None, "export finished before both children were seen at once"
        assert time.monotonic() < deadline
        children = _children(proc.pid)
        assert sum("saved_model_cli" in c for c in children.values()) <= 1, children
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # the parent only: its children are not signalled
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [c for pid, c in children.items() if _alive(pid)]
    assert set(system_tmp.glob("recsys-verify-*")) == before
    scratch = list((workdir.root / "export").rglob(".tmp-recsys-verify-*"))
    assert scratch, "the reload check's scratch folder is under the workdir"
    done = subprocess.run([sys.executable, "-m", "conductor.cli", *args, "--no-verify"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any(path.exists() for path in scratch)  # removed by the next command
