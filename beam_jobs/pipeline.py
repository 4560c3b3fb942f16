"""The preprocessing pipeline: raw interaction log -> validated, split TFRecords + vocab + stats.

    files -> ReadAndValidate --(shard, Arrow batch)--> SplitAndWrite (one GroupByKey by shard)
                 |    ^ item ids (unknown items)                |  \\-(train counts per shard)
    item file -> ReadItems --------------------------------------+----> BuildVocabularies
    user file -> ReadUsers ---------------------------------------------^ (+ feature files)
                 +-- rejections --------------------------------+-> FillRaw -> WriteRejected
    all of the above -> CountRows -> WriteStats

`run_preprocess` runs it into a temporary sibling of the output folder, checks the counts and
the rejection rate, and publishes the folder by renaming it (see docs/PREPROCESSING.md).
"""

import contextlib
import datetime as dt
import json
import logging
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.typehints import no_annotations

from beam_jobs.inputs import InputFile, list_input_files
from beam_jobs.items import ReadItems, item_source
from beam_jobs.loopback import loopback_grpc_servers
from beam_jobs.progress import Tally, batch_rows, close_bars, shard_written
from beam_jobs.readers import (
    Bounds,
    ReadAndValidate,
    ReadSpec,
    check_header,
    parquet_raw,
    read_spec,
)
from beam_jobs.records import Rejection
from beam_jobs.runners import job_runner
from beam_jobs.sinks import REJECTED_DIR, WriteRejected
from beam_jobs.split import SECONDS_PER_DAY, SplitAndWrite, SplitSettings
from beam_jobs.stats import (
    STATS_FILE,
    CountRows,
    MinMax,
    WriteStats,
    add_drift,
    check_reconciled,
)
from beam_jobs.users import ReadUsers, feature_names, user_source
from beam_jobs.validation import MS_PER_SECOND, InvalidValue, parse_timestamp
from beam_jobs.vocab import BuildVocabularies
from recsys.core.config import PreprocessConfig, RecsysConfig
from recsys.core.errors import ConfigError, DataError
from recsys.core.layout import atomic_dir, end_of_day_utc, mark_complete

log = logging.getLogger(__name__)

TOP_REASONS = 3
SHUFFLE_DIR = "_shuffle"  # spilled shard batches (preprocess.shuffle: files), removed after
PIPELINE_SECONDS = "pipeline_seconds"  # in run_preprocess's result only, not in stats.json


def build_pipeline(
    p: beam.Pipeline,
    config: RecsysConfig,
    files: list[InputFile],
    out_dir: Path,
    run_date: dt.date,
) -> None:
    """Add the whole preprocessing graph, writing into `out_dir`, to pipeline `p`."""
    out = str(out_dir)
    pp = config.preprocess
    cutoff = end_of_day_utc(run_date)
    paths = [f.path for f in files]
    spec = read_spec(config.data)
    divisor = MS_PER_SECOND if config.data.timestamp_unit == "ms" else 1
    bounds = Bounds(cutoff, timestamp_floor(pp, cutoff), divisor)
    side = item_source(config.data, paths)
    item_features = catalog = None
    if side is not None:
        item_features = p | "ReadItems" >> ReadItems(side)
        catalog = item_features | "CatalogIds" >> beam.Keys()
    spill = str(out_dir / SHUFFLE_DIR) if pp.shuffle == "files" else None
    read = (
        p
        | "InputFiles" >> beam.Create(paths)
        | "Read" >> ReadAndValidate(spec, bounds, paths, pp.num_shards, catalog, spill)
    )
    settings = SplitSettings(
        min_interactions=pp.min_user_interactions,
        history_length=pp.history_length,
        protocol=pp.split,
        cutoff=cutoff,
        eval_days=pp.eval_days,
        min_user_count=pp.min_user_count,
        min_item_count=pp.min_item_count,
    )
    split = read.batches | "SplitAndWrite" >> SplitAndWrite(
        settings, out, pp.num_shards, paths, spill
    )
    _ = read.batches | "ProgressRead" >> beam.ParDo(
        Tally("preprocess read", "rows", None, batch_rows)
    )
    _ = split.counts | "ProgressWrite" >> beam.ParDo(
        Tally("preprocess write", "shards", pp.num_shards, shard_written)
    )
    rejected = (
        (read.rejected, split.rejected)
        | "AllRejected" >> beam.Flatten()
        | "FillRaw" >> FillRaw(spec)
    )
    _ = rejected | "WriteRejected" >> WriteRejected(out, pp.num_shards)
    users_side = user_source(config.data, paths)
    user_features: beam.PCollection | None = None
    user_names: tuple[str, ...] = ()
    if users_side is not None:
        user_names = feature_names(users_side)
        user_features = p | "ReadUsers" >> ReadUsers(users_side, user_names)
    users, items = (split.users, split.items) | "Vocabularies" >> BuildVocabularies(
        out, pp.vocab_min_count, item_features, user_features, user_names
    )

    counts = {
        "read_tally": read.tally,
        "rejected": rejected,
        "split_counts": split.counts,
    } | "CountRows" >> CountRows()
    # Per file (min, max) of validated timestamps. Duplicates share their timestamp with the
    # row kept, so this is the range of accepted rows unless items/users were dropped as rare.
    time_range = read.time_range | "TimeRange" >> beam.CombineGlobally(MinMax())
    parts = {"counts": counts, "time_range": time_range, "users": users, "items": items}
    _ = parts | "WriteStats" >> WriteStats(out, run_date, files)


def timestamp_floor(pp: PreprocessConfig, cutoff: int) -> int:
    """The first accepted second: preprocess.min_timestamp and max_age_days (0: no bound)."""
    floor = 0
    if pp.min_timestamp is not None:
        try:
            floor = parse_timestamp(pp.min_timestamp)
        except InvalidValue:
            raise ConfigError(
                f"preprocess.min_timestamp {pp.min_timestamp!r} is not epoch seconds or an "
                "ISO-8601 date/time"
            ) from None
    if pp.max_age_days:
        floor = max(floor, cutoff - pp.max_age_days * SECONDS_PER_DAY)
    return floor


def _fill_raw(element: tuple[str, Iterable[Rejection]], spec: ReadSpec) -> Iterator[Rejection]:
    path, records = element
    records = list(records)
    raws = parquet_raw(path, spec, (r["row"] for r in records))
    for record in records:
        yield {**record, "raw": raws.get(record["row"], "")}


class _NeedsRaw(beam.PartitionFn):
    """Partition 1: rejections whose raw text is still to be read from the input file."""

    def partition_for(self, element: Any, num_partitions: int, *args: Any, **kwargs: Any) -> int:
        """1 when the rejection carries no raw text yet, else 0."""
        return int(element["raw"] is None)


class FillRaw(beam.PTransform):
    """Rejections -> the same, with the raw content of columnar rows read back from their file.

    Parquet rows carry no raw JSON through the shuffle (it would cost as much as the row):
    the few rejected after it (duplicates, rare, unknown items) get it here, per file.
    """

    def __init__(self, spec: ReadSpec) -> None:
        super().__init__()
        self._spec = spec

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, rejected: beam.PCollection) -> beam.PCollection:
        complete, partial = rejected | "NeedsRaw" >> beam.Partition(_NeedsRaw(), 2)
        filled = (
            partial
            | "ByFile" >> beam.Map(lambda record: (record["file"], record))
            | "GroupByFile" >> beam.GroupByKey()
            | "ReadBack" >> beam.FlatMap(_fill_raw, self._spec)
        )
        return (complete, filled) | "WithRaw" >> beam.Flatten()


def run_preprocess(
    config: RecsysConfig,
    input_path: str | Path,
    output_dir: Path,
    run_date: dt.date,
    beam_args: list[str] | None = None,
) -> dict[str, Any]:
    """Run the Beam job; publish output_dir atomically with _SUCCESS last; return the stats dict
    plus `pipeline_seconds`, the Beam pipeline's own wall time."""
    files = list_input_files(input_path, config.data.source, run_date)
    spec = read_spec(config.data)
    for f in files:
        check_header(f.path, spec)
    _quiet_beam_logging()
    output_dir = Path(output_dir)
    failure: DataError | None = None
    with atomic_dir(output_dir) as tmp:
        with job_runner(config.preprocess, beam_args or []) as (options, runner):
            # The local runner's worker servers stay on loopback; a remote runner's job server
            # may need to reach the submitting process, so its servers are left as Beam makes
            # them (the Dask runner opens none).
            local = (
                loopback_grpc_servers()
                if isinstance(runner, FnApiRunner)
                else contextlib.nullcontext()
            )
            start = time.perf_counter()
            try:
                with local, beam.Pipeline(runner=runner, options=options) as p:
                    build_pipeline(p, config, files, tmp, run_date)
            finally:
                close_bars()
            seconds = time.perf_counter() - start
        shutil.rmtree(tmp / SHUFFLE_DIR, ignore_errors=True)  # spilled batches, now written
        stats = json.loads((tmp / STATS_FILE).read_text(encoding="utf-8"))
        check_reconciled(stats)
        stats = add_drift(stats, tmp, output_dir)
        failure = quality_failure(stats, config.preprocess, output_dir)
        if failure is None:
            mark_complete(tmp)
    if failure is not None:
        raise failure
    log.info(
        "preprocessed %d rows (%d rejected) from %d file(s) into %s in %.1f s of Beam",
        stats["input_rows"],
        stats["rejected"],
        len(files),
        output_dir,
        seconds,
    )
    # The Beam job's own time (not input generation or listing): what rows/s reports divide.
    return {**stats, PIPELINE_SECONDS: seconds}


def quality_failure(
    stats: dict[str, Any], pp: PreprocessConfig, output_dir: Path
) -> DataError | None:
    """The DataError to raise when too many lines were rejected or duplicated, or none kept."""
    rejected_dir = output_dir / REJECTED_DIR
    fraction = stats["rejected_fraction"]
    if fraction > pp.max_rejected_fraction:
        top = sorted(stats["rejected_by_reason"].items(), key=lambda kv: (-kv[1], kv[0]))
        reasons = ", ".join(f"{reason}: {n}" for reason, n in top[:TOP_REASONS])
        return DataError(
            f"{stats['rejected']} of {stats['input_lines']} input lines rejected "
            f"({fraction:.2%}), above preprocess.max_rejected_fraction "
            f"{pp.max_rejected_fraction:.2%}; top reasons: {reasons}; see {rejected_dir}/ "
            "(output kept without _SUCCESS)"
        )
    if stats["duplicate_fraction"] > pp.max_duplicate_fraction:
        return DataError(
            f"{stats['duplicates']} of {stats['input_lines']} input lines are exact duplicates "
            f"({stats['duplicate_fraction']:.2%}), above preprocess.max_duplicate_fraction "
            f"{pp.max_duplicate_fraction:.2%}; each is listed (file, row) with reason "
            f"'duplicate' in {rejected_dir}/ (output kept without _SUCCESS)"
        )
    if stats["accepted"] == 0:
        return DataError(
            f"no usable interactions in {stats['input_rows']} input rows from "
            f"{len(stats['input_files'])} file(s); "
            f"see {rejected_dir}/ and {output_dir / STATS_FILE}"
        )
    return None


def _quiet_beam_logging() -> None:
    # Beam logs every stage at INFO; keep a level someone set on purpose (e.g. for debugging).
    beam_log = logging.getLogger("apache_beam")
    if beam_log.level == logging.NOTSET:
        beam_log.setLevel(logging.WARNING)
