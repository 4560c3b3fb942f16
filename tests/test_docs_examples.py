"""Every code example in the Markdown files runs, in one sandbox after one tiny nightly.

Fenced blocks are found with markdown-it (a CommonMark parser). By the info string:

- `python`: executed in the sandbox, each block on its own (fresh globals).
- `bash`, `sh`, `shell`: every command must be `recsys ...` (or `.venv/bin/recsys ...`),
  run in-process through the CLI's entry point (`conductor.cli.main`) in the sandbox, and
  exit 0.
- `not-run` after the language (e.g. "```bash not-run") marks an example that needs what a
  test machine lacks: a cloud, a TF Serving or MLflow server, your own data, minutes of
  training. It is not run, but its `recsys` commands must still parse with the CLI's own
  parser, and a python block must compile and its imports resolve.
- `yaml`: parsed; a block whose top-level keys are all config sections must be a valid config.
- anything else (text, json, other languages, no language): shown, not checked.

The sandbox is a folder with `recsys-work/` holding one tiny nightly of date SANDBOX_DATE (the
shipped default config with a small synthetic log), `configs/default.yaml` set to that tiny
config, and links to the repository's other folders, so an example's relative paths resolve as
they would from a checkout after `make run` (with `--date 2026-01-05`).
"""

from __future__ import annotations

import ast
import contextlib
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from markdown_it import MarkdownIt

from conductor import cli
from recsys.ab.simulate import event_log
from recsys.core.config import RecsysConfig, parse_config
from tests.conftest import SMALL, SMALL_DATE

REPO = Path(__file__).resolve().parent.parent
SANDBOX_DATE = SMALL_DATE  # the examples' date: the last day of SMALL's synthetic log
_OTHER_DOCS = (
    "README.md",
    "CHANGELOG.md",
    "datasets/README.md",
    "mlflow/README.md",
    "deploy/README.md",
    "benchmarks/results/README.md",
)
DOCS = sorted({*(REPO / "docs").glob("*.md"), *(REPO / p for p in _OTHER_DOCS)})
SHELLS = {"bash", "sh", "shell"}
RECSYS = {"recsys", ".venv/bin/recsys"}


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, whether it runs, its text."""

    path: Path
    line: int
    language: str
    run: bool
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """The file's fenced code blocks, in order."""
    blocks = []
    for token in MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8")):
        if token.type != "fence":
            continue
        words = token.info.split()
        language = words[0].lower() if words else ""
        line = token.map[0] + 1 if token.map else 0
        blocks.append(Block(path, line, language, "not-run" not in words[1:], token.content))
    return blocks


BLOCKS = [block for path in DOCS for block in fenced_blocks(path)]
PYTHON = [b for b in BLOCKS if b.language in ("python", "py")]
SHELL = [b for b in BLOCKS if b.language in SHELLS]
YAML = [b for b in BLOCKS if b.language in ("yaml", "yml")]


def commands(block: Block) -> list[list[str]]:
    """The block's command lines as argv lists (continuations joined, comments dropped)."""
    text = block.code.replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            found.append(argv)
    return found


def recsys_commands(block: Block) -> list[list[str]]:
    """The argv (without the program) of each `recsys` command of a block, run or not."""
    found = []
    for line in block.code.replace("\\\n", " ").splitlines():
        try:
            argv = shlex.split(line, comments=True)
        except ValueError:  # shell syntax shlex does not read (a not-run block's loop, ...)
            continue
        if argv and argv[0] in RECSYS:
            found.append(argv[1:])
    return found


@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[None]:
    """Run the block from `path`, as a reader would from the repository root.

    The environment is put back afterwards: `mlflow.set_tracking_uri` in an example also
    writes MLFLOW_TRACKING_URI, which recsys reads before its workdir's own store, so the
    next test's runs would go to the sandbox's.
    """
    before, environment = Path.cwd(), dict(os.environ)
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)
        os.environ.clear()
        os.environ.update(environment)


def tiny_default_config() -> dict[str, object]:
    """configs/default.yaml with SMALL's log and training size: the same names, seconds to run."""
    raw = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    data = raw.setdefault("data", {})
    data["synthetic"] = {**data.get("synthetic", {}), **SMALL["data"]["synthetic"]}
    raw["training"] = {**raw.get("training", {}), **SMALL["training"]}
    raw["export"] = {**raw.get("export", {}), "verify": False}
    return raw


def _ab_logs(root: Path) -> None:
    """The A/B examples' inputs: a user list and exposure logs made by the A/B simulator."""
    (root / "users.txt").write_text("".join(f"u{i}\n" for i in range(20)))
    rng = np.random.default_rng(0)
    log = event_log(rng, users=2000, days=14, start="2026-01-06", lift=0.1, experiment="homepage")
    log.to_parquet(root / "exposures.parquet")
    log.to_csv(root / "exposures.csv", index=False)
    (root / "exposures").mkdir()
    half = len(log) // 2
    log.iloc[:half].to_parquet(root / "exposures" / "part-0.parquet")
    log.iloc[half:].to_parquet(root / "exposures" / "part-1.parquet")
    log[log["timestamp"] < "2026-01-06"].to_parquet(root / "pre.parquet")
    event_log(rng, users=2000, days=28, experiment="traffic").to_parquet(
        root / "last-month.parquet"
    )


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkout-like folder after `recsys nightly --date SANDBOX_DATE` with the tiny config."""
    root = tmp_path_factory.mktemp("docs-sandbox")
    for name in (".venv", "benchmarks", "datasets", "deploy", "docs", "mlflow"):
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)
    (root / "configs").mkdir()
    for shipped in (REPO / "configs").glob("*.yaml"):
        (root / "configs" / shipped.name).symlink_to(shipped)
    (root / "configs" / "default.yaml").unlink()
    (root / "configs" / "default.yaml").write_text(yaml.safe_dump(tiny_default_config()))
    _ab_logs(root)
    with working_directory(root):
        code = cli.main(["nightly", "--config", "configs/default.yaml", "--date", SANDBOX_DATE])
    assert code == 0, "the sandbox's nightly failed (see the log above)"
    return root


def test_the_examples_are_found() -> None:
    """The reader is not vacuous: there are runnable examples of each kind."""
    assert sum(b.run for b in PYTHON) >= 5 and sum(b.run for b in SHELL) >= 3
    assert any("recsys.api" in b.code or "from recsys import api" in b.code for b in PYTHON)


def test_the_reader_sees_language_and_marker(tmp_path: Path) -> None:
    """Info strings decide: a `not-run` block is kept, with run False; commands are argv."""
    doc = tmp_path / "x.md"
    doc.write_text(
        "```bash not-run\nrecsys train --config c.yaml \\\n    --date 2026-01-05  # go\n```\n"
        "```python\nprint(1)\n```\n"
    )
    shell, python = fenced_blocks(doc)
    assert (shell.language, shell.run, python.language, python.run) == (
        "bash",
        False,
        "python",
        True,
    )
    assert recsys_commands(shell) == [["train", "--config", "c.yaml", "--date", "2026-01-05"]]


@pytest.mark.parametrize("block", [b for b in SHELL if b.run], ids=lambda b: b.where)
def test_runnable_shell_examples_are_recsys_commands(block: Block) -> None:
    """A shell block that runs holds recsys commands only; anything else is marked not-run."""
    for argv in commands(block):
        assert argv[0] in RECSYS, f"{block.where}: {argv[0]!r} is not run here: mark it not-run"


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_every_recsys_command_parses(block: Block) -> None:
    """Every documented `recsys` command line is valid for the CLI (flags, choices)."""
    parser = cli._parser()
    for argv in recsys_commands(block):
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{block.where}: `recsys {shlex.join(argv)}` does not parse")


@pytest.mark.parametrize("block", [b for b in PYTHON if not b.run], ids=lambda b: b.where)
def test_python_examples_not_run_compile_and_import(block: Block) -> None:
    """A python example that is not run still compiles, and what it imports exists."""
    tree = ast.parse(block.code, filename=block.where)
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    exec(compile(ast.Module(imports, []), block.where, "exec"), {})


@pytest.mark.parametrize("block", YAML, ids=lambda b: b.where)
def test_yaml_examples_parse_and_config_ones_validate(block: Block) -> None:
    """A YAML example is YAML; one made of config sections is a config recsys accepts."""
    loaded = yaml.safe_load(block.code)
    if isinstance(loaded, dict) and loaded and set(loaded) <= set(RecsysConfig.model_fields):
        parse_config(loaded, source=block.where)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in PYTHON if b.run], ids=lambda b: b.where)
def test_python_examples_run(block: Block, sandbox: Path) -> None:
    """The example runs as written, from the sandbox (one shared tiny nightly)."""
    with working_directory(sandbox):
        exec(compile(block.code, block.where, "exec"), {"__name__": "__docs_example__"})


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in SHELL if b.run], ids=lambda b: b.where)
def test_shell_examples_run(block: Block, sandbox: Path) -> None:
    """Each `recsys` command of the example exits 0 from the sandbox."""
    with working_directory(sandbox):
        for argv in commands(block):
            assert cli.main(argv[1:]) == 0, f"{block.where}: `{shlex.join(argv)}` failed"
