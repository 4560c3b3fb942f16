"""Nightly operations without training: the lock, retention, progress, summary, dates, CLI codes."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from pydantic import ValidationError

from conductor.lock import LOCK_FILE, WorkdirLock
from conductor.nightly import (
    CHAMPION_FILE,
    NightlyResult,
    StageOutcome,
    apply_retention,
    backfill,
    write_summary,
)
from recsys.core.errors import ConfigError, WorkdirLockedError
from recsys.core.layout import (
    RunFile,
    Workdir,
    clean_temporaries,
    parse_date,
)
from recsys.core.records import (
    AlsRecord,
    AlsTrialRecord,
    ChampionRecord,
    MetricsRecord,
    PairedComparison,
    SampleSize,
    TrainMarker,
    read_marker,
    write_marker,
    write_record,
)

_HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from conductor.lock import WorkdirLock
    with WorkdirLock(Path(sys.argv[1]), command="holder-under-test"):
        print("held", flush=True)
        time.sleep(60)
    """
)


@pytest.fixture
def held_lock(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding tmp_path's lock (killed at teardown)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_held_lock_names_its_holder(tmp_path: Path, held_lock: subprocess.Popen[str]) -> None:
    with pytest.raises(WorkdirLockedError) as info:
        WorkdirLock(tmp_path).acquire()
    message = str(info.value)
    assert f"pid {held_lock.pid}" in message
    assert socket.gethostname() in message and "holder-under-test" in message
    assert info.value.exit_code == 8


def test_a_second_cli_command_exits_at_once_with_code_8(
    tmp_path: Path, held_lock: subprocess.Popen[str]
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "conductor.cli", "preprocess", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 8, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("recsys: error")]
    assert len(lines) == 1 and f"pid {held_lock.pid}" in lines[0]
    assert "Traceback" not in proc.stderr


def test_a_dead_holders_lock_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    proc.kill()  # SIGKILL: no cleanup ran, the lock file still names the dead holder
    proc.wait()
    assert f'"pid": {proc.pid}' in (tmp_path / LOCK_FILE).read_text()
    with caplog.at_level("WARNING"), WorkdirLock(tmp_path, command="new-holder"):
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["command"] == "new-holder"
    assert f"pid {proc.pid}" in caplog.text and "gone" in caplog.text


def test_the_lock_is_reentrant_within_a_process(tmp_path: Path) -> None:
    with WorkdirLock(tmp_path), WorkdirLock(tmp_path):  # backfill -> nightly
        pass
    with WorkdirLock(tmp_path):  # released: can be taken again
        pass


def _dated(root: Path, kind: str, date: str, *names: str) -> Path:
    folder = root / kind / date
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).mkdir()
    return folder


def test_retention_keeps_the_newest_days_and_the_champions(tmp_path: Path) -> None:
    dates = [f"2026-01-0{d}" for d in range(1, 6)]
    for date in dates:
        _dated(tmp_path, "data", date)
        _dated(tmp_path, "runs", date, "run-a", "run-b")
    champion = tmp_path / "runs" / dates[0] / "run-b"
    record = ChampionRecord(
        model_name="m",
        registered_version="1",
        run_dir=str(champion),
        data_dir=str(tmp_path / "data" / dates[0]),
    )
    write_record(tmp_path / CHAMPION_FILE, record)

    removed = apply_retention(Workdir(tmp_path), keep_days=2)

    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [dates[0], *dates[3:]]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [dates[0], *dates[3:]]
    assert [p.name for p in (tmp_path / "runs" / dates[0]).iterdir()] == ["run-b"]
    assert tmp_path / "runs" / dates[0] / "run-a" in removed
    assert not any(p.name.startswith("2026-01-0") and p.name in dates[3:] for p in removed)


def test_retention_never_touches_non_date_folders(tmp_path: Path) -> None:
    _dated(tmp_path, "runs", "2026-01-01")
    _dated(tmp_path, "runs", "notes")
    apply_retention(Workdir(tmp_path), keep_days=1)
    assert (tmp_path / "runs" / "notes").is_dir()


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def test_temporaries_of_killed_writers_are_removed(tmp_path: Path) -> None:
    dead = _dead_pid()
    leftovers = [
        tmp_path / "data" / f".tmp-2026-01-05-pid{dead}-0a1b2c3d",
        tmp_path / "export" / f".staging-3-pid{dead}-0a1b2c3d",
        tmp_path / "export" / "query" / f".old-2-pid{dead}-0a1b2c3d",
    ]
    kept = [tmp_path / "data" / "2026-01-05", tmp_path / "runs" / "2026-01-05" / ".backup-abc"]
    for path in leftovers + kept:
        path.mkdir(parents=True)
    assert sorted(clean_temporaries(tmp_path)) == sorted(leftovers)
    assert all(p.is_dir() for p in kept)


def test_default_date_is_yesterday_in_the_configured_zone() -> None:
    for zone in ("UTC", "Pacific/Kiritimati", "Pacific/Pago_Pago"):
        expected = (dt.datetime.now(ZoneInfo(zone)) - dt.timedelta(days=1)).date()
        assert parse_date(None, zone) == expected
    with pytest.raises(ConfigError, match="YYYY-MM-DD"):
        parse_date("05/01/2026")


def test_stage_markers_are_written_whole(tmp_path: Path) -> None:
    assert read_marker(tmp_path, "train") is None
    write_marker(tmp_path, "train", 1.5, {"best_epoch": 2, "examples_per_second": 10.0})
    marker = read_marker(tmp_path, "train")
    assert isinstance(marker, TrainMarker) and marker.seconds == 1.5 and marker.finished
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_SUCCESS.train"]


def test_a_marker_of_another_release_makes_the_stage_run_again(tmp_path: Path) -> None:
    """An untyped marker (as earlier releases wrote them) is not trusted: not finished."""
    (tmp_path / "_SUCCESS.train").write_text('{"seconds": 1.5, "finished": "2026-01-05"}')
    assert read_marker(tmp_path, "train") is None
    with pytest.raises(ValidationError, match="best_epoch"):
        write_marker(tmp_path, "train", 1.0, {"examples_per_second": 1.0})


def _summarised(tmp_path: Path, metrics: MetricsRecord) -> str:
    """summary.md of a night whose markers and metrics.json are written by hand."""
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    run.mkdir()
    preprocessed = {"digest": "d", "fingerprint": "f", "pipeline_seconds": 2.0}
    counts = {"input_rows": 1000, "rejected": 3, "splits": {"train": 900}}
    write_marker(data, "preprocess", 3.0, {**preprocessed, **counts})
    write_marker(run, "evaluate", 1.0, {"metrics": {"recall_at_10": 0.25}})
    write_record(run / RunFile.METRICS, metrics)
    write_marker(run, "export", 1.0, {"version": 4, "verified": True})
    published = {
        "summary": "gate: KEEP: no gain",
        "registered_version": "4",
        "mlflow_run_id": "abc",
    }
    gate = {"champion_version": "3", "decision": "keep", "promoted": False, "notes": []}
    write_marker(run, "publish", 1.0, {**published, **gate, "checks": []})
    outcomes = [StageOutcome("preprocess", "skipped", 3.0), StageOutcome("train", "ran", 12.5)]
    return write_summary(NightlyResult(dt.date(2026, 1, 5), data, run, outcomes)).read_text()


METRICS = MetricsRecord(
    protocol="leave-last-out",
    evaluated_model="model",
    model={"recall_at_10": 0.25},
    baselines={"popularity": {"recall_at_10": 0.125}},
    intervals={},
    sample=SampleSize(users=8, of=8),
)


def test_summary_lists_stages_counts_metrics_and_decision(tmp_path: Path) -> None:
    text = _summarised(tmp_path, METRICS)
    assert text.startswith("# recsys nightly 2026-01-05")
    assert "| preprocess | skipped | 3.0 |" in text and "| train | ran | 12.5 |" in text
    assert "Input rows 1000, rejected 3; train 900" in text
    assert "| recall_at_10 | 0.2500 | 0.1250 |" in text  # beside the baseline (metrics.json)
    assert "gate: KEEP: no gain" in text and "Export version 4" in text
    assert "ALS" not in text  # evaluated without the classic baseline


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (0.0476, "- ALS beat the model on ndcg_at_10: 0.0504 vs 0.0476 (-5.6%; model - ALS "),
        (0.0530, "- The model beat ALS on ndcg_at_10: 0.0530 vs 0.0504 (+5.2%; model - ALS "),
    ],
)
def test_summary_says_plainly_whether_als_beat_the_model(
    tmp_path: Path, model: float, expected: str
) -> None:
    comparison = PairedComparison(
        metric="ndcg_at_10", model=model, baseline=0.0504, delta=model - 0.0504,
        ci_low=model - 0.0524, ci_high=model - 0.0484, confidence=0.95, users=943,
    )  # fmt: skip
    trial = AlsTrialRecord(factors=64, regularization=10, alpha=1, validation=0.05, seconds=0.5)
    als = AlsRecord(
        metric="ndcg_at_10", factors=64, regularization=10, alpha=1, iterations=15,
        validation=0.05, trials=[trial], grid_size=12, budget_exhausted=True, max_seconds=1,
        seconds=1.5, comparison=comparison,
    )  # fmt: skip
    baselines = {**METRICS.baselines, "als": {"recall_at_10": 0.2}}
    text = _summarised(tmp_path, METRICS.model_copy(update={"als": als, "baselines": baselines}))
    assert "| recall_at_10 | 0.2500 | 0.1250 | 0.2000 |" in text
    line = next(ln for ln in text.splitlines() if "ALS" in ln and "beat" in ln)
    assert line.startswith(expected) and line.endswith(" over 943 users)")
    assert ", 95% CI [" in line
    assert (
        "- ALS setting (chosen on validation): factors 64, regularization 10, alpha 1; "
        "validation ndcg_at_10 0.0500; 1 of 12 settings tried, stopped by max_seconds; 1.5 s"
    ) in text


def test_backfill_refuses_an_inverted_range(tmp_path: Path) -> None:
    from recsys.core.config import parse_config

    with pytest.raises(ConfigError, match="before --start"):
        backfill(parse_config({}), Workdir(tmp_path), dt.date(2026, 1, 5), dt.date(2026, 1, 4))


def test_a_holder_still_writing_its_record_is_named(tmp_path: Path) -> None:
    import fcntl
    import threading
    import time

    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # locked, record not written yet: the race two starts hit

    def write_record() -> None:
        time.sleep(0.3)
        os.pwrite(fd, json.dumps({"pid": 4242, "host": "h", "command": "c"}).encode(), 0)

    writer = threading.Thread(target=write_record)
    writer.start()
    try:
        with pytest.raises(WorkdirLockedError, match="pid 4242 on h"):
            WorkdirLock(tmp_path).acquire()
    finally:
        writer.join()
        os.close(fd)
