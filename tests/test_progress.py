"""Progress bars (recsys.core.progress, tqdm): plain lines in logs, a bar on a terminal, and a
progress line from every long `recsys` command (stderr captured)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import yaml

from conductor import cli
from recsys.core.progress import bar, shown
from tests.conftest import SMALL, SMALL_DATE

# A plain progress line: UTC timestamp, label, counts.
LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (?P<label>[a-z ]+): [\d,]+")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_are_bounded_and_end_with_the_total() -> None:
    stream = io.StringIO()
    progress = bar("train", 100, "steps", stream=stream, interval=3600, quarter_s=0, show=True)
    for _ in range(100):
        progress.update()
    progress.set_postfix_str("3 epochs", refresh=False)
    progress.close()
    lines = stream.getvalue().splitlines()
    # An hour's interval: a line per quarter (none before: no ETA from the first, tracing,
    # steps), the last one the final line; no carriage returns in a log.
    assert len(lines) == 4, lines
    assert "train: 25/100 steps (25%)" in lines[0] and "ETA" in lines[0]
    assert "\r" not in stream.getvalue()
    assert all(LINE.match(line) for line in lines)
    assert lines[-1].split(" ", 1)[1].startswith("train: 100/100 steps (100%)")
    assert lines[-1].endswith("; 3 epochs")


def test_a_fast_stage_writes_its_final_line_alone() -> None:
    stream = io.StringIO()
    with bar("evaluate", 1650, "users", stream=stream, show=True) as progress:
        for _ in range(4):
            progress.update(512 if progress.n + 512 <= 1650 else 1650 - progress.n)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "evaluate: 1,650/1,650 users (100%)" in lines[0], lines


def test_plain_lines_come_at_the_interval_with_an_eta() -> None:
    stream = io.StringIO()
    progress = bar("read", 10_000, "rows", stream=stream, interval=0, show=True)
    progress.update(100)
    progress.update(100)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3, lines  # two updates past the interval, then the final line
    assert "read: 100/10,000 rows (1%), ETA " in lines[0]
    assert lines[-1].split(" ", 1)[1].startswith("read: 200/10,000 rows (2%)")


def test_a_terminal_gets_tqdm_s_redrawn_bar() -> None:
    stream = _Terminal()
    progress = bar("evaluate", None, "users", stream=stream, show=True)
    progress.update(10)
    progress.close()
    text = stream.getvalue()
    assert "\r" in text and "evaluate: 10users" in text
    assert text.count("\n") == 1


def test_library_bars_are_silent_unless_shown() -> None:
    stream = io.StringIO()
    with bar("quiet", 3, "items", stream=stream) as silent:
        silent.update(3)
    assert stream.getvalue() == ""
    with shown(), bar("loud", 3, "items", stream=stream) as loud:
        loud.update(3)
    assert "loud: 3/3 items (100%)" in stream.getvalue()


def _labels(err: str) -> set[str]:
    return {m["label"] for line in err.splitlines() if (m := LINE.match(line))}


@pytest.mark.slow
def test_each_long_command_prints_progress_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """preprocess (per Beam stage), train, evaluate, export and tune each write progress."""
    raw = {
        **SMALL,
        "training": {**SMALL["training"], "epochs": 1},
        "export": {**SMALL["export"], "verify": False},
        "tune": {"trials": 1, "space": {"training.learning_rate": {"low": 0.001, "high": 0.1}}},
    }
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(raw))
    common = ["--config", str(config), "--workdir", str(tmp_path / "work"), "--date", SMALL_DATE]
    expected = {
        "preprocess": {"preprocess read", "preprocess write"},
        "train": {"train"},
        "evaluate": {"evaluate", "evaluate popularity"},
        "export": {"export"},
        "tune": {"tune", "train"},
    }
    for command, labels in expected.items():
        code = cli.main([command, *common])
        err = capsys.readouterr().err
        assert code == 0, err[-3000:]
        assert labels <= _labels(err), (command, err[-3000:])
