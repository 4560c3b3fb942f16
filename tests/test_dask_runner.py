"""The preprocessing job on a real dask.distributed cluster (docs/PREPROCESSING.md "Runners").

The cluster is a `dask scheduler` and two `dask worker` processes started here on 127.0.0.1;
the job's outputs must be byte-identical to the in-process runner's. Also: the stock Beam
DaskRunner's gaps that beam_jobs.dask_runner mends (the test that tells when it can go).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import apache_beam as beam
import psutil
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.dask.dask_runner import DaskRunner

from beam_jobs.dask_runner import MendedDaskRunner
from beam_jobs.pipeline import run_preprocess
from beam_jobs.runners import job_runner
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.errors import ConfigError
from recsys.core.layout import SEQUENCES, SUCCESS
from recsys.synthetic import write_csv
from tests.conftest import use_store
from tests.object_stores import ObjectStore
from tests.test_storage_beam import output_files

REPO = Path(__file__).resolve().parent.parent
RUN_DATE = dt.date(2026, 1, 5)
SYNTHETIC = {"num_users": 150, "num_items": 80, "mean_interactions_per_user": 12, "days": 5,
             "start_date": "2026-01-01", "item_features": False}  # fmt: skip
BAD_ROWS = [
    "u1,,1767225600,1",  # missing_field
    "u1,i3,yesterday,3",  # bad_timestamp
    "u1,i4,1767225600,lots",  # bad_weight
    "u2,i1,1767225600,1,extra",  # wrong_column_count
    "u3,i1,1999999999,1",  # after_run_date
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[RecsysConfig, Path]:
    """A synthetic log with bad rows, duplicates, unknown items, an item and a user file."""
    raw = tmp_path_factory.mktemp("raw")
    config = parse_config({"data": {"synthetic": SYNTHETIC}})
    log = write_csv(config.data.synthetic, raw / "interactions.csv")
    lines = log.read_text().splitlines()
    log.write_text("\n".join([*lines, *lines[1:40], *BAD_ROWS]) + "\n")  # 39 duplicates
    items = sorted({line.split(",")[1] for line in lines[1:]})
    (raw / "items.csv").write_text(  # the catalog lacks two items: their rows are unknown_item
        "item_id,title,genres\n" + "".join(f"{i},Item {i},g{len(i) % 3}\n" for i in items[2:])
    )
    users = sorted({line.split(",")[0] for line in lines[1:]})
    (raw / "users.csv").write_text(
        "user_id,segment\n" + "".join(f"{u},s{len(u) % 4}\n" for u in users[::2])
    )
    config = parse_config({
        "data": {"source": "csv", "path": str(log),
                 "items": {"path": str(raw / "items.csv")},
                 "users": {"path": str(raw / "users.csv")}},
        "preprocess": {"num_shards": 3, "max_rejected_fraction": 1.0},
    })  # fmt: skip
    return config, log


@pytest.fixture(scope="module")
def direct(tmp_path_factory: pytest.TempPathFactory, inputs: tuple) -> tuple[Path, dict]:
    """The reference: the in-process runner's output folder and stats."""
    config, log = inputs
    out = tmp_path_factory.mktemp("direct") / "data" / RUN_DATE.isoformat()
    return out, _untimed(run_preprocess(config, log, out, RUN_DATE))


def _untimed(stats: dict) -> dict:
    """The job's stats without its wall time (pipeline_seconds differs from run to run)."""
    return {k: v for k, v in stats.items() if k != "pipeline_seconds"}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return {**env, **(extra or {})}


def _wait_for(path: Path, seconds: float = 60) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.is_file() and path.stat().st_size:
            return json.loads(path.read_text())
        time.sleep(0.2)
    raise TimeoutError(f"{path} not written in {seconds} s")


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, s3_store: ObjectStore
) -> Iterator[tuple[str, list[int]]]:
    """A dask scheduler and two single-threaded worker processes on 127.0.0.1: (address, pids).

    The workers' environment points at the test S3 server, as a deployment's would at its
    object store: workers read input from the bucket with their own credentials.
    """
    folder = tmp_path_factory.mktemp("dask")
    info = folder / "scheduler.json"
    # --no-dashboard alone still leaves an HTTP server on every interface (0.0.0.0).
    common = ["--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0"]
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", *common, "--port", "0",
         "--scheduler-file", str(info)],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    procs = [scheduler]
    try:
        address = _wait_for(info)["address"]
        for _ in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "distributed.cli.dask_worker",
                        address,
                        *common,
                        "--nthreads",
                        "1",
                        "--nworkers",
                        "1",
                    ],
                    env=_env(s3_store.env),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        _wait_for_workers(address, 2)
        yield address, [p.pid for p in procs]
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_for_workers(address: str, n: int) -> None:
    from distributed import Client

    with Client(address, timeout=60) as client:
        client.wait_for_workers(n, timeout=60)


def _data_files(out: Path) -> dict[str, bytes]:
    """Every file's bytes but _SUCCESS (its content is the time it was written)."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != SUCCESS
    }


def _listening(pids: list[int]) -> set[str]:
    """Addresses that these processes and their children listen on."""
    procs = [psutil.Process(pid) for pid in pids]
    procs += [child for proc in procs for child in proc.children(recursive=True)]
    return {
        conn.laddr.ip
        for proc in procs
        for conn in proc.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    }


@pytest.mark.slow
def test_dask_cluster_reading_the_bucket_matches_the_direct_runner_on_local_files(
    tmp_path: Path,
    inputs: tuple,
    direct: tuple,
    cluster: tuple,
    s3_store: ObjectStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The log, item and user files in S3, read by the cluster's workers (not this process)."""
    from recsys.core import storage

    use_store(s3_store, monkeypatch)
    config, log = inputs
    uri = f"{s3_store.new_bucket()}/raw"
    for path in log.parent.iterdir():
        storage.write_bytes(f"{uri}/{path.name}", path.read_bytes())
    data = config.data.model_copy(update={
        "path": f"{uri}/{log.name}",
        "items": config.data.items.model_copy(update={"path": f"{uri}/items.csv"}),
        "users": config.data.users.model_copy(update={"path": f"{uri}/users.csv"}),
    })  # fmt: skip
    preprocess = config.preprocess.model_copy(
        update={"runner": "dask", "runner_address": cluster[0]}
    )
    remote = config.model_copy(update={"data": data, "preprocess": preprocess})
    out = tmp_path / "data" / RUN_DATE.isoformat()
    stats = _untimed(run_preprocess(remote, f"{uri}/{log.name}", out, RUN_DATE))
    reference_dir, reference = direct
    assert stats["rejected_by_reason"] == reference["rejected_by_reason"]
    assert stats["splits"] == reference["splits"]
    assert output_files(out, uri) == output_files(reference_dir, str(log.parent))


@pytest.mark.slow
def test_job_on_a_dask_cluster_is_byte_identical_to_the_direct_runner(
    tmp_path: Path, inputs: tuple, direct: tuple, cluster: tuple
) -> None:
    config, log = inputs
    address, pids = cluster
    dask_config = config.model_copy(
        update={
            "preprocess": config.preprocess.model_copy(
                update={"runner": "dask", "runner_address": address}
            )
        }
    )
    out = tmp_path / "data" / RUN_DATE.isoformat()
    stats = _untimed(run_preprocess(dask_config, log, out, RUN_DATE))
    reference_dir, reference = direct
    assert stats == reference
    reasons = reference["rejected_by_reason"]
    assert {"unknown_item", "bad_timestamp", "missing_field"} <= set(reasons)
    assert 0 < reference["duplicates"] <= 39  # the valid ones of the 39 repeats, counted apart
    files = _data_files(out)
    assert files == _data_files(reference_dir)
    names = set(files)
    assert {f"train-{i:05d}-of-00003.tfrecord.gz" for i in range(3)} <= names
    assert {f"{SEQUENCES}-{i:05d}-of-00003.tfrecord.gz" for i in range(3)} <= names
    assert {f"rejected/rejected-{i:05d}-of-00003.jsonl" for i in range(3)} <= names
    assert {"vocab/users.txt", "item_features.parquet", "user_features.parquet"} <= names
    assert (
        sum(files[f"rejected/rejected-{i:05d}-of-00003.jsonl"].count(b"\n") for i in range(3))
        == reference["rejected"] + reference["duplicates"]
    )  # fmt: skip (both traceable)
    # The scheduler, nannies and workers listen on the loopback interface only.
    assert _listening(pids) == {"127.0.0.1"}


@pytest.mark.slow
def test_dask_without_an_address_runs_and_stops_a_local_cluster(
    tmp_path: Path, inputs: tuple, direct: tuple
) -> None:
    config, log = inputs
    local = config.model_copy(
        update={"preprocess": config.preprocess.model_copy(update={"runner": "dask"})}
    )
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "data" / RUN_DATE.isoformat()
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:  # what this process and its children listen on, during the job
        while not done.wait(0.3):
            with contextlib.suppress(psutil.Error):
                seen.update(_listening([os.getpid()]))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        stats = _untimed(run_preprocess(local, log, out, RUN_DATE))
    finally:
        done.set()
        watcher.join()
    assert stats == direct[1]
    assert seen == {"127.0.0.1"}  # the local cluster's servers were seen, on loopback only
    assert _data_files(out) == _data_files(direct[0])
    # The cluster's processes are gone; Python's multiprocessing resource tracker (started
    # with the first spawned child, it lives as long as this interpreter) may stay.
    left = [
        " ".join(p.cmdline())
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
    assert not [c for c in left if "resource_tracker" not in c], left


class _Split(beam.DoFn):
    """Evens to the main output, odds tagged; one extra main output at bundle end."""

    def process(self, x: int) -> Iterator[object]:
        if x % 2:
            yield beam.pvalue.TaggedOutput("odd", x)
        else:
            yield x

    def finish_bundle(self) -> Iterator[object]:
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.windowed_value import WindowedValue

        yield WindowedValue(100, 0, (GlobalWindow(),))


def _write(folder: Path, name: str) -> Callable[[list[int], int], list[str]]:
    def write(values: list[int], offset: int) -> list[str]:
        (folder / name).write_text(json.dumps(sorted(v + offset for v in values)))
        return [name]

    return write


def _gaps_pipeline(runner: beam.runners.PipelineRunner, address: str, folder: Path) -> None:
    """Tagged outputs, output at bundle end, a keyword side input and two sinks."""
    p = beam.Pipeline(runner=runner, options=PipelineOptions([f"--dask_client_address={address}"]))
    parts = p | beam.Create(range(6)) | beam.ParDo(_Split()).with_outputs("odd", main="even")
    offset = beam.pvalue.AsSingleton(p | "Offset" >> beam.Create([1000]))
    _ = (
        parts.even
        | "E" >> beam.combiners.ToList()
        | "WE" >> beam.FlatMap(_write(folder, "even"), offset=offset)
    )
    _ = parts.odd | "O" >> beam.combiners.ToList() | "WO" >> beam.FlatMap(_write(folder, "odd"), 0)
    result = p.run()
    try:
        result.wait_until_finish()
    finally:
        result.client.close()


def _written(folder: Path, name: str) -> list[int] | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


@pytest.mark.slow
def test_mended_runner_keeps_outputs_apart_and_runs_every_sink(
    tmp_path: Path, cluster: tuple
) -> None:
    _gaps_pipeline(MendedDaskRunner(), cluster[0], tmp_path)
    assert _written(tmp_path, "even") == [1000, 1002, 1004, 1100]
    assert _written(tmp_path, "odd") == [1, 3, 5]


@pytest.mark.slow
def test_stock_dask_runner_still_has_the_gaps(tmp_path: Path, cluster: tuple) -> None:
    """When this fails, Beam's DaskRunner was fixed: drop beam_jobs/dask_runner.py."""
    _gaps_pipeline(DaskRunner(), cluster[0], tmp_path)
    # Only the last sink ran, and it got the main output and the tagged one mixed.
    assert _written(tmp_path, "even") is None
    assert _written(tmp_path, "odd") == [0, 1, 2, 3, 4, 5]


def test_runner_flags_and_their_conflicts() -> None:
    def options(preprocess: dict) -> dict:
        pp = parse_config({"preprocess": preprocess}).preprocess
        with job_runner(pp, []) as (opts, _):
            return opts.get_all_options(drop_default=True)

    flink = options({"runner": "flink", "runner_address": "flink-jobmanager:8081"})
    assert (flink["runner"], flink["flink_master"]) == ("FlinkRunner", "flink-jobmanager:8081")
    spark = options({"runner": "spark", "runner_address": "spark://host:7077"})
    assert (spark["runner"], spark["spark_master_url"]) == ("SparkRunner", "spark://host:7077")
    dataflow = options({"runner": "dataflow", "beam_args": ["--project=p", "--region=r"]})
    assert (dataflow["runner"], dataflow["project"]) == ("DataflowRunner", "p")
    with pytest.raises(ConfigError, match="runner_address is for dask, flink or spark"):
        parse_config({"preprocess": {"runner_address": "tcp://h:8786"}})
    with pytest.raises(ConfigError, match="set the runner in one place"):
        parse_config({"preprocess": {"runner": "dask", "beam_args": ["--runner=DirectRunner"]}})
