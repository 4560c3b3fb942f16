"""No socket outside loopback while the Beam job runs, in every documented runner mode.

The job's process tree is polled while `recsys preprocess` runs (the stage that runs Beam;
the others open no listening socket with the local tracking store): each listening TCP socket
of its processes (their fds -> socket inodes -> /proc/net/tcp{,6}) must be bound to
127.0.0.1 or ::1. The multi-threading and multi-processing modes' worker servers used to
listen on [::].
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from beam_jobs.loopback import loopback_address
from tests.conftest import SMALL, SMALL_DATE

LISTEN = "0A"
# 127.0.0.1, ::1 and ::ffff:127.0.0.1, as /proc/net/tcp{,6} write them.
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}

MODES = {
    "default": [],
    "multi_threading": ["--direct_running_mode=multi_threading", "--direct_num_workers=2"],
    "multi_processing": ["--direct_running_mode=multi_processing", "--direct_num_workers=2"],
}


def _tree(pid: int) -> set[int]:
    """`pid` and its descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _listening(pids: set[int]) -> set[str]:
    """'address:port' (hex, as in /proc/net/tcp) of the listening sockets these processes own."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = fd.readlink().name
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                found.add(fields[1])
    return found


def test_wildcard_addresses_become_loopback() -> None:
    assert loopback_address("[::]:0") == "localhost:0"
    assert loopback_address("0.0.0.0:5000") == "localhost:5000"
    assert loopback_address("10.0.0.1:7") == "10.0.0.1:7"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_beam_job_listens_on_loopback_only(tmp_path: Path, mode: str) -> None:
    raw = {**SMALL, "preprocess": {"beam_args": MODES[mode]}}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    proc = subprocess.Popen(
        [sys.executable, "-m", "conductor.cli", "preprocess", "--config", str(config),
         "--workdir", str(tmp_path / "work"), "--date", SMALL_DATE],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: set[str] = set()
    while proc.poll() is None:
        seen |= _listening(_tree(proc.pid))
        time.sleep(0.02)
    assert proc.returncode == 0, proc.stderr.read()[-3000:] if proc.stderr else ""
    outside = sorted(a for a in seen if a.split(":")[0] not in LOOPBACK)
    assert outside == [], f"{mode}: listening outside loopback: {outside}"
    if mode == "multi_processing":
        assert seen, "the worker servers were not observed: the test would see nothing"
