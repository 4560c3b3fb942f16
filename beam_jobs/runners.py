"""Which Beam runner runs the job, from `preprocess.runner` (docs/PREPROCESSING.md "Runners").

`direct` runs in this process (Beam's FnApiRunner) unless `beam_args` name a --runner;
`dask` submits to a dask.distributed scheduler (`preprocess.runner_address`), or, without an
address, to a local cluster of one worker process per core on 127.0.0.1 that lives as long
as the job; `dataflow`, `flink` and `spark` set Beam's own flags (their project, image and
master come from `runner_address` and `beam_args`).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
from collections.abc import Iterator
from typing import Any

from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner

from recsys.core.config import PreprocessConfig
from recsys.core.errors import ConfigError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Flags that name the remote runner's cluster, for `preprocess.runner_address`.
ADDRESS_FLAG = {
    "dask": "--dask_client_address",
    "flink": "--flink_master",
    "spark": "--spark_master_url",
}
RUNNER_FLAG = {"dataflow": "DataflowRunner", "flink": "FlinkRunner", "spark": "SparkRunner"}


def pipeline_options(args: list[str]) -> tuple[PipelineOptions, Any]:
    """Options from the Beam command-line flags, and the runner to use (None: the flags' own).

    Without --runner, Beam 2.77's DirectRunner first tries Prism: it downloads the Prism binary
    from GitHub (offline: a failed lookup, then a fallback to the FnApiRunner; behind a firewall
    that drops packets: a wait for the timeout; online: a different runner fetched at run time).
    Using the FnApiRunner directly skips all that; it honours --direct_running_mode and
    --direct_num_workers just the same. An explicit --runner (DirectRunner included) is obeyed.
    """
    options = PipelineOptions(args)
    check_known_options(options)
    runner = None if options.view_as(StandardOptions).runner else FnApiRunner()
    return options, runner


def check_known_options(options: PipelineOptions) -> None:
    """ConfigError naming the first option no Beam options class knows (e.g. `--runer`).

    Beam itself only logs "Discarding unparseable args" and runs on with its defaults, so a
    misspelt `--runner` would quietly run the job locally.
    """
    known = options.get_all_options()
    given = options.get_all_options(retain_unknown_options=True)
    unknown = [name for name in given if name not in known]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f" (did you mean --{close[0]}?)" if close else ""
        raise ConfigError(
            f"preprocess.beam_args: unknown Beam option --{name}{hint}; Beam would ignore it "
            "and run with its defaults. Fix or remove it in the config"
        )


@contextlib.contextmanager
def job_runner(
    pp: PreprocessConfig, extra_args: list[str]
) -> Iterator[tuple[PipelineOptions, Any]]:
    """(options, runner) for `preprocess.runner`; a local Dask cluster lives until the exit."""
    args = [*pp.beam_args, *extra_args]
    if pp.runner == "direct":
        yield pipeline_options(args)
        return
    if pp.runner != "dask":
        flags = [f"--runner={RUNNER_FLAG[pp.runner]}"]
        if pp.runner_address:
            flags.append(f"{ADDRESS_FLAG[pp.runner]}={pp.runner_address}")
        yield PipelineOptions([*flags, *args]), None
        return
    from beam_jobs.dask_runner import MendedDaskRunner  # dask is imported only when used

    with _dask_scheduler(pp.runner_address) as address:
        flags = [f"--dask_client_address={address}"]
        if not any(a.startswith(("--dask_npartitions", "--dask_partition_size")) for a in args):
            # One input file per dask partition: files are read in parallel (Beam's default
            # puts up to 128 elements of a Create in one partition).
            flags.append("--dask_partition_size=1")
        yield PipelineOptions([*flags, *args]), MendedDaskRunner()


@contextlib.contextmanager
def _dask_scheduler(address: str | None) -> Iterator[str]:
    """The scheduler's address: the configured one, or a local cluster's for the block."""
    if address:
        yield address
        return
    yield from _local_cluster()


def _local_cluster() -> Iterator[str]:
    from dask.system import CPU_COUNT  # cores this process may use (affinity, cgroup quota)
    from distributed import LocalCluster

    workers = CPU_COUNT
    # Every server (scheduler, nannies, workers and their HTTP endpoints) on the loopback
    # interface, on free ports (the scheduler's HTTP server would otherwise take 8787).
    with LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        host=LOOPBACK,
        dashboard_address=f"{LOOPBACK}:0",
        worker_dashboard_address=f"{LOOPBACK}:0",
    ) as cluster:
        log.info(
            "local Dask cluster: %d worker processes at %s", workers, cluster.scheduler_address
        )
        yield cluster.scheduler_address
