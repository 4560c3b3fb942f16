"""What models.config routes TF Serving to is checked against the checksums recorded at publish.

Two exported versions (champion 1, challenger 2), then files deleted from the published
folders, as an operator's slip or a failing disk would: `recsys export --verify` fails loudly
(exit 11) naming each broken version and the command that re-exports it, and that command
repairs it.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conductor import stages
from recsys.core.config import RecsysConfig
from recsys.core.errors import ServedModelError
from recsys.core.layout import Workdir
from serving_export.integrity import check_routed, check_serving, record_path, routed_versions
from serving_export.serving_config import set_version_labels
from tests.conftest import SMALL_DATE, plain_prepared

DATE = dt.date.fromisoformat(SMALL_DATE)


@pytest.fixture(scope="module")
def prepared(prepared: tuple[RecsysConfig, Workdir, Path]) -> tuple[RecsysConfig, Workdir, Path]:
    """SMALL's data with the plain model (conftest.PLAIN_MODEL): these tests check the served
    versions' integrity checks, not the model."""
    return plain_prepared(prepared)


@pytest.fixture(scope="module")
def two_versions(prepared: tuple[RecsysConfig, Workdir, Path]) -> tuple[RecsysConfig, Workdir]:
    """Two runs exported as versions 1 (champion) and 2 (challenger)."""
    config, workdir, data_dir = prepared
    training = config.training.model_copy(update={"epochs": 1})
    config = config.model_copy(update={"training": training})
    for _ in range(2):
        run_dir, _ = stages.train(config, workdir, DATE, data_dir)
        stages.export(config, workdir, DATE, run_dir.name, verify=False)
    set_version_labels(workdir.root / "export", {"champion": 1, "challenger": 2})
    return config, workdir


@pytest.fixture
def copy(two_versions: tuple[RecsysConfig, Workdir], tmp_path: Path) -> Workdir:
    """A copy of the two-version workdir this test may break."""
    _, workdir = two_versions
    shutil.copytree(workdir.root, tmp_path / "work", symlinks=True)
    return Workdir(tmp_path / "work")


def _break(workdir: Workdir) -> None:
    """The issue's case: a champion file and a challenger file deleted after publishing."""
    (workdir.export("query") / "1" / "saved_model.pb").unlink()
    for data in (workdir.export("retrieval") / "2" / "variables").glob("variables.data-*"):
        data.unlink()


def _run_of(workdir: Workdir, version: int) -> Path:
    for path in workdir.root.glob("runs/*/*/export_version.json"):
        if json.loads(path.read_text())["version"] == version:
            return path.parent
    raise AssertionError(f"no run reserved version {version}")


def test_checksums_are_recorded_at_publish_and_routed_versions_read(copy: Workdir) -> None:
    export = copy.root / "export"
    for name in ("query", "candidate", "retrieval"):
        for version in (1, 2):
            record = json.loads(record_path(export, name, version).read_text())
            assert "saved_model.pb" in record["files"]
    assert routed_versions(export)["query"] == {1: ("champion",), 2: ("challenger",)}
    assert check_routed(export) == []
    check_serving(copy.root)


def test_a_changed_file_is_found(copy: Workdir) -> None:
    index = copy.export("candidate") / "2" / "variables" / "variables.index"
    index.write_bytes(index.read_bytes()[:-1] + b"\0")
    (broken,) = check_routed(copy.root / "export")
    assert (broken.model, broken.version, broken.labels) == ("candidate", 2, ("challenger",))
    assert "variables/variables.index changed" in broken.problems[0]


def test_broken_routed_versions_are_a_loud_failure(copy: Workdir) -> None:
    _break(copy)
    with pytest.raises(ServedModelError) as info:
        check_serving(copy.root)
    message = str(info.value)
    assert ServedModelError.exit_code == 11
    assert "query/1 (champion): saved_model.pb missing" in message
    assert "retrieval/2 (challenger): variables/variables.data-00000-of-00001 missing" in message
    for version in (1, 2):
        run = _run_of(copy, version)
        assert f"recsys export --date {SMALL_DATE} --run-id {run.name}" in message


@pytest.mark.slow
def test_export_verify_fails_with_exit_11_and_the_named_command_repairs(
    copy: Workdir, two_versions: tuple[RecsysConfig, Workdir], tmp_path: Path
) -> None:
    config, _ = two_versions
    _break(copy)
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    champion_run = _run_of(copy, 1)
    # The command the message names for the champion: it re-exports version 1 (verified) in
    # place; the broken challenger still fails the check.
    proc = subprocess.run(
        [sys.executable, "-m", "conductor.cli", "export", "--verify", "--config", str(config_file),
         "--workdir", str(copy.root), "--date", SMALL_DATE, "--run-id", champion_run.name],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 11, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("recsys: error:")]
    assert "retrieval/2 (challenger)" in line and "query/1" not in line
    assert (copy.export("query") / "1" / "saved_model.pb").is_file()
    stages.export(config, copy, DATE, _run_of(copy, 2).name, verify=False)
    assert check_routed(copy.root / "export") == []
