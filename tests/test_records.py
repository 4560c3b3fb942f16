"""Typed stage records: round trips, and a clear error for an old, foreign or damaged file."""

from __future__ import annotations

import datetime as dt
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from recsys.core import layout
from recsys.core.layout import RunFile, Workdir, mark_complete, new_run_id
from recsys.core.records import (
    FORMAT_VERSION,
    AlsRecord,
    AlsTrialRecord,
    ExportRecord,
    MetricsRecord,
    PairedComparison,
    RecordError,
    RunKeyRecord,
    SampleSize,
    StageRecord,
    StatsRecord,
    TrainRecord,
    read_record,
    read_train,
    write_record,
)

TRAIN = TrainRecord(
    data_dir="/w/data/2026-01-05",
    config_digest="abc",
    data_fingerprint="fp",
    examples_per_second=100.0,
    steady_examples_per_second=120.0,
    epoch_seconds=[1.5, 1.0],
    seconds=2.5,
    strategy="one_device",
    replicas=1,
    precision="float32",
    best_epoch=2,
    refit_epochs=None,
    refit_seconds=0.0,
    refit_splits=[],
    dense_log_settings={"model.encoder": "gru"},
    input="sequences",
    incremental_from=None,
    evaluated_model="model",
)
RECORDS = [
    TRAIN,
    MetricsRecord(
        protocol="leave-last-out",
        evaluated_model="model",
        model={"recall_at_10": 0.25, "ndcg_at_10": float("nan")},
        baselines={"popularity": {"recall_at_10": 0.1}},
        intervals={"model": {"recall_at_10": (0.2, 0.3)}},
        sample=SampleSize(users=10, of=10),
    ),
    ExportRecord(
        version=3,
        models={"retrieval": "/w/export/retrieval/3"},
        embeddings={"items": "/w/embeddings/3/items.parquet"},
        embeddings_manifest="/w/embeddings/3/manifest.json",
        ann=None,
        serving={"models_config": "/w/export/models.config"},
        verification={},
        seconds={"savedmodels": 1.0},
    ),
    RunKeyRecord(config_digest="abc", data_fingerprint=None),
    StatsRecord.model_validate(
        {
            "record": "stats",
            "format_version": FORMAT_VERSION,
            "run_date": "2026-01-05",
            "fingerprint": "fp",
            "input_lines": 5,
            "input_rows": 5,
            "accepted": 5,
            "rejected": 0,
            "duplicates": 0,
            "splits": {"train": 3, "validation": 1, "test": 1},
            "users": 1,
            "items": 4,
            "drift": None,  # the Beam job's other keys are kept
        }
    ),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.KIND)
def test_a_record_reads_back_as_written(record: StageRecord, tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    write_record(path, record)
    back = read_record(type(record), path)
    assert back.model_dump_json() == record.model_dump_json()
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]  # no temporary left


def test_metrics_with_als_read_back_and_without_it_have_no_key(tmp_path: Path) -> None:
    metrics = next(r for r in RECORDS if isinstance(r, MetricsRecord))
    comparison = PairedComparison(
        metric="recall_at_10", model=0.25, baseline=0.3, delta=-0.05, ci_low=-0.09,
        ci_high=-0.01, confidence=0.95, users=10,
    )  # fmt: skip
    trial = AlsTrialRecord(factors=64, regularization=1, alpha=10, validation=math.nan, seconds=1)
    als = AlsRecord(
        metric="recall_at_10", factors=64, regularization=1, alpha=10, iterations=15,
        validation=math.nan, trials=[trial], grid_size=12, budget_exhausted=True, max_seconds=1,
        seconds=2.5, comparison=comparison, notes=["no validation positions"],
    )  # fmt: skip
    with_als = metrics.model_copy(update={"als": als})
    write_record(tmp_path / "with.json", with_als)
    back = read_record(MetricsRecord, tmp_path / "with.json")
    assert back.model_dump_json() == with_als.model_dump_json()
    assert back.als is not None and math.isnan(back.als.validation)
    # Without ALS the file is the one written before the field existed (no `als` key), and
    # such a file reads as a run without ALS.
    write_record(tmp_path / "without.json", metrics)
    assert "als" not in json.loads((tmp_path / "without.json").read_text())
    assert read_record(MetricsRecord, tmp_path / "without.json").als is None


def test_the_other_keys_of_stats_are_kept(tmp_path: Path) -> None:
    write_record(tmp_path / "stats.json", RECORDS[-1])
    assert json.loads((tmp_path / "stats.json").read_text())["drift"] is None


def _write(path: Path, payload: dict[str, object]) -> Path:
    path.write_text(json.dumps(payload))
    return path


def test_a_file_from_before_records_names_the_field_and_the_command(tmp_path: Path) -> None:
    old = _write(tmp_path / "train.json", {"data_dir": "/w/data", "seconds": 2.0})
    with pytest.raises(RecordError, match=r"field 'record': missing.*rerun `recsys train`"):
        read_record(TrainRecord, old)


def test_a_record_of_another_kind_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    write_record(path, RECORDS[1])  # a metrics record where train.json belongs
    with pytest.raises(RecordError, match=r"'metrics', expected 'train'"):
        read_record(TrainRecord, path)


def test_a_newer_format_asks_for_an_upgrade(tmp_path: Path) -> None:
    payload = {**TRAIN.model_dump(mode="json"), "format_version": FORMAT_VERSION + 1}
    with pytest.raises(RecordError, match="upgrade recsys"):
        read_record(TrainRecord, _write(tmp_path / "train.json", payload))


def test_a_bad_field_is_named(tmp_path: Path) -> None:
    payload = {**TRAIN.model_dump(mode="json"), "replicas": 0}
    with pytest.raises(RecordError, match=r"train.json: field 'replicas'"):
        read_record(TrainRecord, _write(tmp_path / "train.json", payload))
    payload = {**TRAIN.model_dump(mode="json"), "input": "bags"}
    with pytest.raises(RecordError, match=r"field 'input'"):
        read_record(TrainRecord, _write(tmp_path / "train.json", payload))


def test_missing_and_unreadable_files_say_which_stage_writes_them(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match=r"train.json is missing: run `recsys train` first"):
        read_train(tmp_path)
    (tmp_path / "train.json").write_text("{not json")
    with pytest.raises(RecordError, match="unreadable train record"):
        read_train(tmp_path)


def test_the_cli_reports_an_old_record_in_one_line(tmp_path: Path) -> None:
    """A run folder whose train.json an older release wrote: exit 4, one line, no traceback."""
    date = dt.date(2026, 1, 5)
    run_dir = Workdir(tmp_path).run(date, new_run_id("0a1b2c3d"))
    run_dir.mkdir(parents=True)
    _write(run_dir / RunFile.TRAIN, {"data_dir": str(tmp_path / "data"), "seconds": 1.0})
    mark_complete(run_dir)
    args = ["evaluate", "--workdir", str(tmp_path), "--date", date.isoformat()]
    proc = subprocess.run(
        [sys.executable, "-m", "conductor.cli", *args, "--run-id", run_dir.name],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 4, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("recsys: error:")]
    assert len(errors) == 1 and "field 'record': missing" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_stage_is_declared_once_in_order() -> None:
    """The nightly, resume and missing_outputs iterate the one declaration."""
    assert tuple(layout.STAGE_SPECS) == layout.STAGES
    assert layout.STAGES == ("preprocess", "train", "evaluate", "export", "publish")
    preprocess = layout.STAGE_SPECS["preprocess"]
    assert layout.DataFile.SEQUENCE_SHARDS in preprocess.writes
    assert layout.DataFile.USER_FEATURES in preprocess.optional
    assert RunFile.EVAL_MODEL in layout.STAGE_SPECS["train"].optional


def test_shard_outputs_count_as_present_by_glob(tmp_path: Path) -> None:
    for name in layout.STAGE_SPECS["preprocess"].writes:
        target = tmp_path / str(name).replace("*", "-00000-of-00001")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("x")
    assert layout.missing_outputs("preprocess", tmp_path) == []
    (tmp_path / "sequences--00000-of-00001.tfrecord.gz").unlink()
    assert layout.missing_outputs("preprocess", tmp_path) == ["sequences-*.tfrecord.gz"]
