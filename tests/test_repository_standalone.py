"""The repository stands alone: it never points at files outside it or at tracker numbers.

A reader of a clone has neither the folder beside the checkout nor the issue tracker: docs,
code, configs and benchmarks say what they mean in their own words (tests may still read the
data folder beside the checkout, docs/PROTOCOL.md and datasets/README.md say where data goes).
"""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OUTSIDE_OR_TRACKER = r"\.\./shared|\b(issue|session) [0-9]+\b"
CHECKED = (
    "*.md",
    "recsys/*",
    "beam_jobs/*",
    "serving_export/*",
    "conductor/*",
    "configs/*",
    "deploy/*",
    "benchmarks/*",
)
# Notes kept outside the repository, by name, anywhere in it (tests included).
OUTSIDE_NOTES = r"GOTCHAS|DESIGN\.md"

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(),
    reason="needs git and a git checkout of the repository (git grep reads its tracked files)",
)


def git_grep(pattern: str, paths: tuple[str, ...], root: Path, no_index: bool = False) -> str:
    """`git grep -nE pattern -- paths` in `root`: the matching lines ('' when none)."""
    command = ["git", "grep", *(["--no-index"] if no_index else []), "-nE", pattern, "--", *paths]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1), done.stderr  # 1: no match
    return done.stdout


def test_no_reference_outside_the_repository_or_to_tracker_numbers() -> None:
    """Docs, packages, configs, deploy files and benchmarks: none of these references."""
    assert git_grep(OUTSIDE_OR_TRACKER, CHECKED, REPO) == ""


def test_no_file_names_notes_kept_outside_the_repository() -> None:
    """Not in tests either: the pitfalls and the design are said where they apply."""
    assert git_grep(OUTSIDE_NOTES, (".", f":!{Path(__file__).relative_to(REPO)}"), REPO) == ""


def test_the_checks_find_what_they_forbid(tmp_path: Path) -> None:
    """Not vacuous: each kind of reference in a docs file or a module is found."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "X.md").write_text("See ../shared/data and issue 13.\n")
    (tmp_path / "recsys").mkdir()
    (tmp_path / "recsys" / "m.py").write_text("# measured in session 11 (GOTCHAS.md)\n")
    found = git_grep(OUTSIDE_OR_TRACKER, CHECKED, tmp_path, no_index=True)
    assert "docs/X.md:1:" in found and "recsys/m.py:1:" in found
    assert "recsys/m.py:1:" in git_grep(OUTSIDE_NOTES, (".",), tmp_path, no_index=True)
