"""Fault injection: SIGKILL in each stage, concurrent nightlies, a full disk, a corrupt shard.

Every nightly here is the real CLI in its own process against a real `mlflow server`. After a
kill, rerunning the same date must finish with the outputs of an uninterrupted run (same
counts, same metrics within tolerance), no duplicate MLflow run or model version, and no
half-written export visible at any moment.

The kill tests also run with the working directory in an S3 bucket (moto's server on
127.0.0.1), where there is no rename: a kill mid-upload must leave an uncommitted version
that no reader takes, and a rerun, here or on another machine, finishes from the bucket.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from recsys.core import mirror, storage
from recsys.core.layout import TEMP_PREFIXES
from tests.conftest import SMALL, SMALL_DATE, plain, use_store
from tests.mlflow_server import MlflowServer
from tests.object_stores import ObjectStore

pytestmark = pytest.mark.slow

DATE = SMALL_DATE
MODELS = ("query", "candidate", "retrieval")
# Resuming mid-epoch replays a different batch order; on SMALL's 150 users that moves a
# recall by a few hundredths at most.
METRIC_TOLERANCE = 0.08


def _config(root: Path, uri: str, name: str, **training: object) -> Path:
    # The plain model (conftest.PLAIN_MODEL): these tests check recovery, not the model.
    base = plain(SMALL)
    raw = {
        **base,
        "model_name": name,
        "training": {**base["training"], "epochs": 4, "checkpoint_every_steps": 4, **training},
        "tracking": {"uri": uri, "retries": 2, "backoff_seconds": 0.2},
        "gate": {"bootstrap_samples": 200},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@dataclass(frozen=True)
class Place:
    """A working directory: a local folder, or a bucket URI worked on through a local copy."""

    arg: str  # what --workdir says
    local: Path  # where the process works: the folder itself, or the bucket's local copy
    env: dict[str, str] = field(default_factory=dict)
    uri: str | None = None

    def elsewhere(self, cache: Path) -> Place:
        """The same bucket workdir as another machine (another local copy) sees it."""
        if self.uri is None:
            return self
        local = mirror.local_copy(self.uri, cache)
        return Place(self.arg, local, {**self.env, "RECSYS_CACHE_DIR": str(cache)}, self.uri)

    def view(self, where: Path) -> Path:
        """What a reader finds: the folder, or the bucket's committed state pulled to `where`."""
        if self.uri is None:
            return self.local
        mirror.Mirror(self.uri, where).pull()
        return where


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest) -> str:
    """Each kill test with a local working directory, then with one in an S3 bucket."""
    return str(request.param)


def _place(where: str, root: Path, request: pytest.FixtureRequest) -> Place:
    if where == "local":
        return Place(str(root / "work"), root / "work")
    store: ObjectStore = request.getfixturevalue("s3_store")
    use_store(store, request.getfixturevalue("monkeypatch"))  # this process reads it too
    uri = f"{store.new_bucket()}/work"
    cache = root / "machine-a"
    env = {**store.env, "RECSYS_CACHE_DIR": str(cache)}
    return Place(uri, mirror.local_copy(uri, cache), env, uri)


def _start(
    config: Path, work: Path | Place, *extra: str, fault: str | None = None
) -> subprocess.Popen:
    place = work if isinstance(work, Place) else Place(str(work), work)
    env = {k: v for k, v in os.environ.items() if k != "RECSYS_FAULT"} | place.env
    if fault:
        env["RECSYS_FAULT"] = fault
    command = [sys.executable, "-m", "conductor.cli", "nightly", "--config", str(config)]
    command += ["--workdir", place.arg, "--date", DATE, *extra]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _finish(proc: subprocess.Popen, expect: int = 0) -> tuple[str, str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}:\n{err[-4000:]}"
    return out, err


def _kill_when(proc: subprocess.Popen, condition: Callable[[], bool], what: str) -> None:
    """SIGKILL `proc` as soon as `condition()` holds; fail if it finished first."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{err[-3000:]}")
        if condition():
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            assert proc.returncode == -signal.SIGKILL
            return
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


class ExportWatcher:
    """Samples export/ every few ms: every visible version folder must be a whole SavedModel."""

    def __init__(self, work: Path) -> None:
        self.work, self.problems = work, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for name in MODELS:
                base = self.work / "export" / name
                for version in base.glob("[0-9]*") if base.is_dir() else []:
                    if not (version / "saved_model.pb").is_file() and version.exists():
                        self.problems.append(f"{version} visible without saved_model.pb")
            time.sleep(0.005)

    def __enter__(self) -> ExportWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _outputs(work: Path) -> dict[str, object]:
    """What two runs of the same date must agree on."""
    stats = json.loads((work / "data" / DATE / "stats.json").read_text())
    runs = [p for p in (work / "runs" / DATE).iterdir() if not p.name.startswith(".")]
    assert len(runs) == 1, f"expected one run folder, found {runs}"
    metrics = json.loads((runs[0] / "metrics.json").read_text())["model"]
    versions = {n: sorted(p.name for p in (work / "export" / n).iterdir()) for n in MODELS}
    # Leftovers of an interrupted write (the checksums folder is hidden on purpose: TF Serving
    # must not take it for a model).
    hidden = [p for p in (work / "export").rglob(".*") if p.name.startswith(TEMP_PREFIXES)]
    return {"stats": stats, "metrics": metrics, "versions": versions, "hidden": hidden}


def _assert_like_reference(work: Path, reference: dict[str, object]) -> None:
    got = _outputs(work)
    for key in ("input_rows", "splits", "rejected", "users", "items"):
        assert got["stats"][key] == reference["stats"][key], key
    for metric, value in reference["metrics"].items():
        assert abs(got["metrics"][metric] - value) <= METRIC_TOLERANCE, metric
    assert got["versions"] == {n: ["1"] for n in MODELS}
    assert got["hidden"] == []


def _assert_one_run_and_version(server: MlflowServer, name: str) -> None:
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    versions = client.search_model_versions(f"name = '{name}'")
    assert [v.version for v in versions] == ["1"]
    assert client.get_registered_model(name).aliases.get("champion") == "1"


@pytest.fixture(scope="module")
def reference(server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted nightly: its workdir, outputs, and a rerun that must do nothing."""
    root = tmp_path_factory.mktemp("reference")
    config = _config(root, server.uri, "fault-ref")
    work = root / "work"
    with ExportWatcher(work) as watcher:
        _finish(_start(config, work))
    assert watcher.problems == []
    out, _ = _finish(_start(config, work))
    return {"work": work, "outputs": _outputs(work), "rerun_stdout": out}


def _seeded(root: Path, reference: dict) -> Path:
    """A fresh workdir holding the reference's preprocessed data (the preprocess stage done)."""
    work = root / "work"
    shutil.copytree(reference["work"] / "data", work / "data")
    shutil.copytree(reference["work"] / "raw", work / "raw")
    return work


def _seeded_place(where: str, root: Path, reference: dict, request: pytest.FixtureRequest) -> Place:
    """`_seeded` in a local folder or in a bucket (published there as a nightly would)."""
    place = _place(where, root, request)
    if place.uri is None:
        _seeded(root, reference)
        return place
    mirror.Mirror(place.uri, _seeded(root / "seed", reference)).push()
    return place


class BucketWatcher(ExportWatcher):
    """Samples the bucket: every committed export version must hold every file it lists."""

    def __init__(self, uri: str) -> None:
        super().__init__(Path("/nonexistent"))
        self.uri = uri

    def _watch(self) -> None:
        while not self._stop.is_set():
            for name in MODELS:
                base = f"{self.uri}/export/{name}"
                for version in {n.split("/")[0] for n in storage.list_files(base)}:
                    listed = storage.committed(f"{base}/{version}")
                    present = storage.list_files(f"{base}/{version}")
                    missing = [f for f, meta in (listed or {}).items()
                               if present.get(f) != meta["size"]]  # fmt: skip
                    if listed is not None and missing:
                        self.problems.append(f"{base}/{version} committed without {missing}")
            time.sleep(0.05)


def _watcher(place: Place) -> ExportWatcher:
    return ExportWatcher(place.local) if place.uri is None else BucketWatcher(place.uri)


def test_a_rerun_after_success_does_nothing(
    reference: dict, server: MlflowServer, tmp_path: Path
) -> None:
    assert "already done, nothing to do" in reference["rerun_stdout"]
    assert "preprocess skipped" in reference["rerun_stdout"]
    _assert_one_run_and_version(server, "fault-ref")
    summaries = list((reference["work"] / "runs" / DATE).glob("*/summary.md"))
    assert len(summaries) == 1 and "| publish | ran |" in summaries[0].read_text()
    client = MlflowClient(server.uri)
    run = client.search_runs([client.get_experiment_by_name("fault-ref").experiment_id])[0]
    # Downloaded beside the test, not into the reference workdir other tests copy.
    logged = Path(client.download_artifacts(run.info.run_id, "summary.md", str(tmp_path)))
    assert logged.read_text() == summaries[0].read_text()


def test_killed_during_preprocessing(
    reference: dict,
    server: MlflowServer,
    tmp_path: Path,
    where: str,
    request: pytest.FixtureRequest,
) -> None:
    config = _config(tmp_path, server.uri, f"fault-pre-{where}")
    place = _place(where, tmp_path, request)
    if place.uri is None:
        proc = _start(config, place)
        data = place.local / "data"
        _kill_when(
            proc, lambda: data.is_dir() and any(data.glob(".tmp-*/*")), "Beam wrote its first file"
        )
        assert not (data / DATE).exists()  # nothing published: the output is all or nothing
    else:
        # Killed after the first file of data/<date> reached the bucket, before its marker.
        _finish(_start(config, place, fault="storage:uploaded:data:kill"), expect=-signal.SIGKILL)
        assert storage.list_files(f"{place.uri}/data/{DATE}")
        assert storage.committed(f"{place.uri}/data/{DATE}") is None
        assert not (place.view(tmp_path / "reader") / "data" / DATE).exists()
    _finish(_start(config, place))
    _assert_like_reference(place.view(tmp_path / "after"), reference["outputs"])
    _assert_one_run_and_version(server, f"fault-pre-{where}")


def test_killed_during_training_resumes(
    reference: dict,
    server: MlflowServer,
    tmp_path: Path,
    where: str,
    request: pytest.FixtureRequest,
) -> None:
    config = _config(tmp_path, server.uri, f"fault-train-{where}")
    place = _seeded_place(where, tmp_path, reference, request)
    proc = _start(config, place)
    runs = place.local / "runs" / DATE
    _kill_when(proc, lambda: any(runs.glob(".backup-*/**/checkpoint")), "a training checkpoint")
    run = next(p for p in runs.iterdir() if not p.name.startswith("."))
    assert not (run / "_SUCCESS.train").exists()
    # The checkpoint stays on this machine (a bucket workdir keeps it out of the bucket).
    _, err = _finish(_start(config, place))
    assert "stage 1/5 preprocess: already done" in err
    view = place.view(tmp_path / "after")
    _assert_like_reference(view, reference["outputs"])
    _assert_one_run_and_version(server, f"fault-train-{where}")
    # (In a bucket the unfinished run folder was never published: the rerun names a new one,
    # and resumes from the checkpoint kept on this machine all the same.)
    finished = next(p for p in (view / "runs" / DATE).iterdir() if not p.name.startswith("."))
    history = json.loads((finished / "history.json").read_text())
    assert len(history["loss"]) == 4  # every epoch recorded, before and after the kill


def test_killed_during_export_never_shows_half_an_export(
    reference: dict,
    server: MlflowServer,
    tmp_path: Path,
    where: str,
    request: pytest.FixtureRequest,
) -> None:
    config = _config(tmp_path, server.uri, f"fault-export-{where}")
    place = _seeded_place(where, tmp_path, reference, request)
    with _watcher(place) as watcher:
        if place.uri is None:
            proc = _start(config, place)
            staging = place.local / "export"
            _kill_when(proc, lambda: any(staging.glob(".staging-*/*")), "export staging")
        else:  # killed after the first SavedModel file reached the bucket
            proc = _start(config, place, fault="storage:uploaded:export:kill")
            _finish(proc, expect=-signal.SIGKILL)
            assert not place.view(tmp_path / "reader").joinpath("export", "query").exists()
        _finish(_start(config, place))
    assert watcher.problems == []
    _assert_like_reference(place.view(tmp_path / "after"), reference["outputs"])
    _assert_one_run_and_version(server, f"fault-export-{where}")


def test_killed_after_publishing_one_model_reuses_its_version(
    reference: dict, server: MlflowServer, tmp_path: Path
) -> None:
    config, work = _config(tmp_path, server.uri, "fault-half"), _seeded(tmp_path, reference)
    _finish(_start(config, work, fault="export:released-one:kill"), expect=-signal.SIGKILL)
    published = [n for n in MODELS if (work / "export" / n / "1").is_dir()]
    assert len(published) == 1
    _finish(_start(config, work))
    _assert_like_reference(work, reference["outputs"])  # version 1 everywhere, no version 2


def test_killed_between_export_and_mlflow(
    reference: dict,
    server: MlflowServer,
    tmp_path: Path,
    where: str,
    request: pytest.FixtureRequest,
) -> None:
    name = f"fault-mlflow-{where}"
    config, place = (
        _config(tmp_path, server.uri, name),
        _seeded_place(where, tmp_path, reference, request),
    )
    _finish(_start(config, place, fault="publish:before:kill"), expect=-signal.SIGKILL)
    client = MlflowClient(server.uri)
    # Training logged its epochs to the night's run as they ended; nothing was published.
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert "recsys.logged" not in run.data.tags and "loss" in run.data.metrics
    assert client.search_registered_models(f"name = '{name}'") == []
    # A bucket workdir's rerun on another machine: it continues from what the bucket holds.
    _, err = _finish(_start(config, place.elsewhere(tmp_path / "machine-b")))
    assert "stage 4/5 export: already done" in err
    _assert_like_reference(place.view(tmp_path / "after"), reference["outputs"])
    _assert_one_run_and_version(server, name)


def test_two_nightlies_at_once_exactly_one_runs(
    reference: dict,
    server: MlflowServer,
    tmp_path: Path,
    where: str,
    request: pytest.FixtureRequest,
) -> None:
    name = f"fault-twice-{where}"
    config, place = (
        _config(tmp_path, server.uri, name),
        _seeded_place(where, tmp_path, reference, request),
    )
    # In a bucket: two machines (two local copies), so only the bucket's lock object can stop one.
    procs = [_start(config, place), _start(config, place.elsewhere(tmp_path / "machine-b"))]
    results = [(p, *p.communicate(timeout=600)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 8], [err[-2000:] for _, _, err in results]
    loser = next(err for p, _, err in results if p.returncode == 8)
    winner = next(p for p, _, _ in results if p.returncode == 0)
    assert f"in use by pid {winner.pid}" in loser and "Traceback" not in loser
    _assert_one_run_and_version(server, name)


def test_disk_full_during_export_keeps_serving_the_previous_version(
    reference: dict, server: MlflowServer, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    shutil.copytree(reference["work"], work, ignore=shutil.ignore_patterns(".recsys.lock"))
    # Same model, one more epoch: a new run whose export would be version 2.
    config = _config(tmp_path, server.uri, "fault-ref", epochs=5)
    _, err = _finish(_start(config, work, fault="export:staged:enospc"), expect=9)
    errors = [line for line in err.splitlines() if line.startswith("recsys: error")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "export" in errors[0]
    versions = {n: sorted(p.name for p in (work / "export" / n).iterdir()) for n in MODELS}
    assert versions == {n: ["1"] for n in MODELS}  # version 1 still served, nothing half-made
    client = MlflowClient(server.uri)
    assert client.get_registered_model("fault-ref").aliases["champion"] == "1"


def test_a_corrupt_shard_is_named(reference: dict, server: MlflowServer, tmp_path: Path) -> None:
    config, work = _config(tmp_path, server.uri, "fault-corrupt"), _seeded(tmp_path, reference)
    shard = sorted((work / "data" / DATE).glob("sequences-*"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = b"\xff" * 64
    shard.write_bytes(bytes(raw))
    _, err = _finish(_start(config, work), expect=3)
    errors = [line for line in err.splitlines() if line.startswith("recsys: error")]
    assert len(errors) == 1 and f"corrupt TFRecord shard {shard}" in errors[0], err[-2000:]


def _backfill_command(config: Path, work: Path) -> list[str]:
    command = [sys.executable, "-m", "conductor.cli", "backfill", "--config", str(config)]
    return [*command, "--workdir", str(work), "--start", "2026-01-04", "--end", DATE]


def test_backfill_runs_the_dates_in_order_then_skips_them(
    server: MlflowServer, tmp_path: Path
) -> None:
    config = _config(tmp_path, server.uri, "fault-backfill", epochs=2)
    raw = yaml.safe_load(config.read_text())
    # SMALL's log runs to DATE: on the day before, its last day counts as future rows.
    raw["preprocess"] = {"max_rejected_fraction": 0.5}
    config.write_text(yaml.safe_dump(raw))
    work = tmp_path / "work"
    first = subprocess.run(_backfill_command(config, work), capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.index("data/2026-01-04") < first.stdout.index(f"data/{DATE}")
    assert "already done" not in first.stdout
    again = subprocess.run(_backfill_command(config, work), capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    for date in ("2026-01-04", DATE):
        assert f"nightly {date}: already done, nothing to do" in again.stdout
    versions = MlflowClient(server.uri).search_model_versions("name = 'fault-backfill'")
    assert sorted(v.version for v in versions) == ["1", "2"]


def test_backfill_stops_at_the_first_failure(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({**SMALL, "data": {"source": "csv", "path": "missing.csv"}}))
    proc = subprocess.run(
        _backfill_command(config, tmp_path / "work"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("recsys: error")]
    assert len(errors) == 1 and "backfill stopped at 2026-01-04" in errors[0]
    assert "missing.csv" in errors[0]
    assert not (tmp_path / "work" / "data" / DATE).exists()
