"""Failures named right: each bad config, argument or volume is one line with its own exit code.

The CLI runs in its own process, as an operator runs it: exit code, a single `recsys: error:`
line naming the value, and no traceback.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conductor import stages
from recsys.core.config import parse_config
from recsys.core.errors import ConfigError, DataError, StorageError
from recsys.core.layout import Workdir
from recsys.training.memory import check_memory
from tests.conftest import SMALL, SMALL_DATE


def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit code, stderr) of `recsys ARGS` in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-m", "conductor.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stderr


def _one_error_line(stderr: str) -> str:
    """The CLI's error line; fails on a traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("recsys: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


CONFIG_CASES = {
    "non-utf8": (b"model_name: caf\xe9\n", r"not UTF-8 \(byte 0xe9 at offset 15\)"),
    "deep": (
        ("a: " + "[" * 50_000 + "]" * 50_000 + "\n").encode(),
        "nested deeper than Python's recursion limit",
    ),
    "num_shards": (b"preprocess: {num_shards: 1000000000}\n", r"num_shards.*got 1000000000"),
    "num_shards_float": (b"preprocess: {num_shards: 1.0e+9}\n", r"num_shards.*got 1000000000"),
    "num_users": (
        b"data: {synthetic: {num_users: 1000000000000}}\n",
        r"num_users.*got 1000000000000",
    ),
    "embedding_dim": (b"model: {embedding_dim: 10000000}\n", r"embedding_dim.*got 10000000"),
    "batch_size": (b"training: {batch_size: 1000000000}\n", r"batch_size.*got 1000000000"),
    "beam_args": (
        b"preprocess: {beam_args: ['--runer=DataflowRunner']}\n",
        r"unknown Beam option --runer \(did you mean --runner\?\)",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_values_exit_2_naming_the_value(tmp_path: Path, case: str) -> None:
    content, pattern = CONFIG_CASES[case]
    config = tmp_path / "bad.yaml"
    config.write_bytes(content)
    code, err = _cli("nightly", "--config", str(config), "--workdir", str(tmp_path / "w"),
                     "--date", SMALL_DATE)  # fmt: skip
    assert code == 2, err[-3000:]
    assert re.search(pattern, _one_error_line(err)), err[-2000:]


@pytest.mark.parametrize(
    ("date", "pattern"),
    [("9999-12-31", "outside 1970-01-01..2199-12-31"), ("20261129", "must be YYYY-MM-DD")],
)
def test_dates_outside_the_one_form_or_range_exit_2(
    tmp_path: Path, date: str, pattern: str
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    code, err = _cli("nightly", "--config", str(config), "--workdir", str(tmp_path / "w"),
                     "--date", date)  # fmt: skip
    assert code == 2 and pattern in _one_error_line(err)
    assert not (tmp_path / "w" / "data").exists()  # nothing was started


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[list[Path]]:
    """Folders this process cannot write: an existing one, and one it would have to create.

    chmod binds every user but root; root is refused by sysfs, which allows no new files.
    """
    if os.geteuid() == 0:
        yield [Path("/sys/kernel"), Path("/sys/recsys-work/w")]
        return
    work = tmp_path / "work"
    work.mkdir(mode=0o555)
    try:
        yield [work, work / "sub"]
    finally:
        work.chmod(0o755)


def test_a_workdir_that_cannot_be_written_exits_9_in_one_line(
    tmp_path: Path, unwritable: list[Path]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    for where in unwritable:
        code, err = _cli("nightly", "--config", str(config), "--workdir", str(where),
                         "--date", SMALL_DATE)  # fmt: skip
        line = _one_error_line(err)
        assert code == 9, err[-3000:]
        assert f"--workdir {where} cannot be written (" in line and "rerun" in line


def test_a_read_only_workdir_is_a_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read-only mount needs privileges a test does not have: its errno is given instead.
    def read_only(*_: object, **__: object) -> None:
        raise OSError(30, "Read-only file system", str(tmp_path / ".write-probe-x"))

    assert stages.check_workdir(str(tmp_path), writable=True).root == tmp_path.resolve()
    monkeypatch.setattr(stages.tempfile, "TemporaryFile", read_only)
    with pytest.raises(StorageError, match="Read-only file system"):
        stages.check_workdir(str(tmp_path), writable=True)


def test_memory_is_estimated_before_training_allocates() -> None:
    config = parse_config({**SMALL, "model": {"embedding_dim": 4096, "oov_buckets": 1_000_000}})
    with pytest.raises(ConfigError) as info:
        check_memory(config, users=1000, items=1000, examples=10_000, limit=8 << 30)
    message = str(info.value)
    assert "embedding tables" in message and "optimizer slots" in message
    assert "logits block" in message and "model.embedding_dim (4096)" in message
    big_batch = parse_config({**SMALL, "training": {"batch_size": 1 << 20}})
    with pytest.raises(ConfigError, match=r"training.batch_size \(1048576\)"):
        check_memory(big_batch, users=100, items=100, examples=1 << 22, limit=4 << 30)
    parts = check_memory(parse_config(SMALL), users=150, items=80, examples=1500)
    assert sum(parts.values()) < 64 << 20


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """SMALL preprocessed once (the real Beam job) and its config file."""
    root = tmp_path_factory.mktemp("named")
    config = root / "c.yaml"
    config.write_text(yaml.safe_dump({**SMALL, "training": {**SMALL["training"], "epochs": 1}}))
    work = root / "work"
    stages.preprocess(parse_config(yaml.safe_load(config.read_text())), Workdir(work),
                      dt.date.fromisoformat(SMALL_DATE))  # fmt: skip
    return config, work


@pytest.mark.slow
def test_memory_check_runs_before_training_allocates(
    trained_workdir: tuple, tmp_path: Path
) -> None:
    config, work = trained_workdir
    raw = yaml.safe_load(config.read_text())
    # ~270 GB of tables and Adam slots: above any machine this runs on.
    raw["model"] = {"embedding_dim": 8192, "oov_buckets": 1_000_000}
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(raw))
    code, err = _cli("train", "--config", str(big), "--workdir", str(work), "--date", SMALL_DATE)
    line = _one_error_line(err)
    assert code == 2 and "training would need about" in line and "embedding_dim (8192)" in line
    assert not (work / "runs" / SMALL_DATE).exists() or not any(
        p for p in (work / "runs" / SMALL_DATE).iterdir() if not p.name.startswith(".")
    )


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_exits_9_not_7(trained_workdir: tuple) -> None:
    config, work = trained_workdir
    fault = {"RECSYS_FAULT": "train:checkpoint:tf-enospc"}
    code, err = _cli("train", "--config", str(config), "--workdir", str(work),
                     "--date", SMALL_DATE, env=fault)  # fmt: skip
    line = _one_error_line(err)
    assert code == 9, err[-3000:]
    assert "No space left on device" in line and "rerun the same command" in line
    assert "out of memory" not in line
    # A failed training leaves no empty run folder behind (its checkpoints stay in .backup-*).
    runs = work / "runs" / SMALL_DATE
    assert [p.name for p in runs.iterdir() if not p.name.startswith(".")] == []


@pytest.mark.slow
def test_an_empty_shard_is_bad_input_exit_3(trained_workdir: tuple, tmp_path: Path) -> None:
    config, work = trained_workdir
    damaged = tmp_path / "work"
    shutil.copytree(work, damaged)
    shard = next((damaged / "data" / SMALL_DATE).glob("sequences-*.tfrecord.gz"))
    shard.write_bytes(b"")
    code, err = _cli("train", "--config", str(config), "--workdir", str(damaged),
                     "--date", SMALL_DATE)  # fmt: skip
    line = _one_error_line(err)
    assert code == 3 and f"shard {shard} is empty (0 bytes)" in line
    assert "--rerun-from preprocess" in line
    assert not (damaged / "runs" / SMALL_DATE).exists() or not [
        p for p in (damaged / "runs" / SMALL_DATE).iterdir() if not p.name.startswith(".")
    ]


def test_an_empty_shard_is_a_data_error(tmp_path: Path) -> None:
    from recsys.data_io import split_files

    (tmp_path / "train-00000-of-00001.tfrecord.gz").write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        split_files(tmp_path, "train")


def _in_private_mounts(command: list[str], tmpfs: Path, size: str) -> list[str]:
    """`command` in its own mount namespace with a `size` tmpfs on `tmpfs` (a real full disk).

    Needs root, or unprivileged user namespaces (then root inside one): skipped otherwise.
    """
    userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    mount = 'mount -t tmpfs -o "size=$1" tmpfs "$2" && shift 2 && exec "$@"'
    wrapped = ["unshare", *userns, "--mount", "--propagation", "private", "sh", "-c", mount,
               "sh", size, str(tmpfs), *command]  # fmt: skip
    if shutil.which("unshare") is None:
        pytest.skip("no private tmpfs mount here: util-linux's unshare is not installed")
    probe = subprocess.run([*wrapped[: -len(command)], "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private tmpfs mount here (unshare/mount: {probe.stderr.strip()[:200]})")
    return wrapped


@pytest.mark.slow
def test_a_real_full_disk_at_a_checkpoint_says_no_space_left(
    trained_workdir: tuple, tmp_path: Path
) -> None:
    config, work = trained_workdir
    full = tmp_path / "work"
    shutil.copytree(work / "data", full / "data")
    (full / "runs").mkdir()
    # runs/ on a 24 KB file system: the first checkpoint (SaveV2) does not fit.
    train = [sys.executable, "-m", "conductor.cli", "train", "--config", str(config),
             "--workdir", str(full), "--date", SMALL_DATE]  # fmt: skip
    proc = subprocess.run(_in_private_mounts(train, full / "runs", "24k"), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    line = _one_error_line(proc.stderr)
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert "No space left on device writing a checkpoint" in line
    assert "rerun the same command" in line and "out of memory" not in line


@pytest.mark.slow
def test_an_export_folder_without_write_permission_exits_9_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    raw = {**SMALL, "training": {**SMALL["training"], "epochs": 1}}
    config.write_text(yaml.safe_dump({**raw, "export": {**SMALL["export"], "verify": False}}))
    work = tmp_path / "work"
    (work / "export").mkdir(parents=True)
    (work / "export").chmod(0o555)
    # Root ignores file modes: in a user namespace of its own it is an ordinary user.
    userns = ["unshare", "--user"] if os.geteuid() == 0 else []
    try:
        proc = subprocess.run(
            [*userns, sys.executable, "-m", "conductor.cli", "nightly", "--config", str(config),
             "--workdir", str(work), "--date", SMALL_DATE],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        (work / "export").chmod(0o755)
    line = _one_error_line(proc.stderr)
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert "stage export: Permission denied" in line and "make it writable" in line
