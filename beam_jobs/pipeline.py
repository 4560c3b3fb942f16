"""The preprocessing pipeline: raw interaction log -> validated, split TFRecords + vocab + stats.

    files -> ReadAndValidate [-> KnownItemsOnly] -> SplitAndWrite (shards)
                 |                  |                       |               |  (train counts)
                 |                  |                       |               \\-> BuildVocabularies
                 +------------------+-----------------------+---------------+-> WriteRejected
    item file -> ReadItems ------------------^ (unknown items)   and  --> item_features.parquet
    all of the above -> CountRows -> WriteStats

`run_preprocess` runs it into a temporary sibling of the output folder, checks the counts and
the rejection rate, and publishes the folder by renaming it (see docs/PREPROCESSING.md).
"""

import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner

from beam_jobs.inputs import InputFile, list_input_files
from beam_jobs.items import KnownItemsOnly, ReadItems, item_source
from beam_jobs.readers import ReadAndValidate, read_spec
from beam_jobs.sinks import REJECTED_DIR, WriteRejected
from beam_jobs.split import SplitAndWrite, SplitSettings
from beam_jobs.stats import (
    STATS_FILE,
    CountRows,
    MinMax,
    WriteStats,
    add_drift,
    check_reconciled,
)
from beam_jobs.vocab import BuildVocabularies
from recsys.config import RecsysConfig
from recsys.errors import DataError
from recsys.layout import atomic_dir, end_of_day_utc, mark_complete

log = logging.getLogger(__name__)

TOP_REASONS = 3


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
    read = (
        p
        | "InputFiles" >> beam.Create([f.path for f in files])
        | "Read" >> ReadAndValidate(read_spec(config.data), cutoff, config.data.timestamp_unit)
    )
    events = read.events
    rejected_parts = [read.rejected]
    side = item_source(config.data, [f.path for f in files])
    item_features = None
    if side is not None:
        item_features = p | "ReadItems" >> ReadItems(side)
        known = events | "KnownItems" >> KnownItemsOnly(item_features)
        events = known.events
        rejected_parts.append(known.rejected)
    item_counts = None
    if pp.min_item_count:
        # Distinct (user, time, item) first: duplicates must not lift an item over the minimum.
        item_counts = (
            events
            | "EventKeys" >> beam.Map(lambda e: (e[0], e[1][0], e[1][1]))
            | "Distinct" >> beam.Distinct()
            | "EventItem" >> beam.Map(lambda key: key[2])
            | "CountPerItem" >> beam.combiners.Count.PerElement()
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
    split = events | "SplitAndWrite" >> SplitAndWrite(settings, out, pp.num_shards, item_counts)
    rejected_parts.append(split.rejected)
    rejected = rejected_parts | "AllRejected" >> beam.Flatten()
    _ = rejected | "WriteRejected" >> WriteRejected(out)
    users, items = (split.users, split.items) | "Vocabularies" >> BuildVocabularies(
        out, pp.vocab_min_count, item_features
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


def pipeline_options(args: list[str]) -> tuple[PipelineOptions, Any]:
    """Options from the Beam command-line flags, and the runner to use (None: the flags' own).

    Without --runner, Beam 2.77's DirectRunner first tries Prism: it downloads the Prism binary
    from GitHub (offline: a failed lookup, then a fallback to the FnApiRunner; behind a firewall
    that drops packets: a wait for the timeout; online: a different runner fetched at run time).
    Using the FnApiRunner directly skips all that; it honours --direct_running_mode and
    --direct_num_workers just the same. An explicit --runner (DirectRunner included) is obeyed.
    """
    options = PipelineOptions(args)
    runner = None if options.view_as(StandardOptions).runner else FnApiRunner()
    return options, runner


def run_preprocess(
    config: RecsysConfig,
    input_path: str | Path,
    output_dir: Path,
    run_date: dt.date,
    beam_args: list[str] | None = None,
) -> dict[str, Any]:
    """Run the Beam job; publish output_dir atomically with _SUCCESS last; return the stats dict."""
    files = list_input_files(input_path, config.data.source, run_date)
    options, runner = pipeline_options([*config.preprocess.beam_args, *(beam_args or [])])
    _quiet_beam_logging()
    output_dir = Path(output_dir)
    failure: DataError | None = None
    with atomic_dir(output_dir) as tmp:
        with beam.Pipeline(runner=runner, options=options) as p:
            build_pipeline(p, config, files, tmp, run_date)
        stats = json.loads((tmp / STATS_FILE).read_text(encoding="utf-8"))
        check_reconciled(stats)
        stats = add_drift(stats, tmp, output_dir)
        failure = quality_failure(stats, config.preprocess.max_rejected_fraction, output_dir)
        if failure is None:
            mark_complete(tmp)
    if failure is not None:
        raise failure
    log.info(
        "preprocessed %d rows (%d rejected) from %d file(s) into %s",
        stats["input_rows"],
        stats["rejected"],
        len(files),
        output_dir,
    )
    return stats


def quality_failure(
    stats: dict[str, Any], max_rejected: float, output_dir: Path
) -> DataError | None:
    """The DataError to raise when too many rows were rejected or none accepted, else None."""
    rejected_dir = output_dir / REJECTED_DIR
    fraction = stats["rejected_fraction"]
    if fraction > max_rejected:
        top = sorted(stats["rejected_by_reason"].items(), key=lambda kv: (-kv[1], kv[0]))
        reasons = ", ".join(f"{reason}: {n}" for reason, n in top[:TOP_REASONS])
        return DataError(
            f"{stats['rejected']} of {stats['input_rows']} input rows rejected "
            f"({fraction:.2%}), above preprocess.max_rejected_fraction {max_rejected:.2%}; "
            f"top reasons: {reasons}; see {rejected_dir}/ (output kept without _SUCCESS)"
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
