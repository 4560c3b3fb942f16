"""The preprocessing pipeline: raw interaction log -> validated, split TFRecords + vocab + stats.

    files -> ReadRawRows -> ValidateInteractions -> SplitPerUser -> WriteExamples (x3)
                 |                  |                    |      \\-> BuildVocabularies
                 +------------------+--------------------+-> WriteRejected
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
from beam_jobs.readers import ReadRawRows, read_spec
from beam_jobs.sinks import REJECTED_DIR, WriteExamples, WriteRejected
from beam_jobs.split import SplitPerUser
from beam_jobs.stats import STATS_FILE, CountRows, MinMax, WriteStats, check_reconciled
from beam_jobs.validation import ValidateInteractions
from beam_jobs.vocab import BuildVocabularies
from recsys.config import RecsysConfig
from recsys.errors import DataError
from recsys.layout import atomic_dir, end_of_day_utc, mark_complete
from recsys.schema import SPLITS

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
    read = (
        p
        | "InputFiles" >> beam.Create([f.path for f in files])
        | "Read" >> ReadRawRows(read_spec(config.data))
    )
    valid = read.rows | "Validate" >> ValidateInteractions(
        end_of_day_utc(run_date), config.data.timestamp_unit
    )
    split = valid.events | "SplitPerUser" >> SplitPerUser(config.preprocess.min_user_interactions)
    rejected = (read.rejected, valid.rejected, split.rejected) | "AllRejected" >> beam.Flatten()

    for name in SPLITS:
        _ = split[name] | f"Write{name.title()}" >> WriteExamples(
            f"{out}/{name}", config.preprocess.num_shards
        )
    _ = rejected | "WriteRejected" >> WriteRejected(out)
    users, items = split.train | "Vocabularies" >> BuildVocabularies(out)

    counts = {
        "read_rows": read.rows,
        "read_rejected": read.rejected,
        "rejected": rejected,
        **{name: split[name] for name in SPLITS},
    } | "CountRows" >> CountRows()
    # Duplicates share their timestamp with the row kept, so the range over validated events
    # equals the range over accepted ones, without waiting for the split.
    time_range = (
        valid.events
        | "Timestamps" >> beam.Map(lambda event: event[1][0])
        | "TimeRange" >> beam.CombineGlobally(MinMax())
    )
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
    files = list_input_files(input_path, config.data.source)
    options, runner = pipeline_options([*config.preprocess.beam_args, *(beam_args or [])])
    _quiet_beam_logging()
    output_dir = Path(output_dir)
    failure: DataError | None = None
    with atomic_dir(output_dir) as tmp:
        with beam.Pipeline(runner=runner, options=options) as p:
            build_pipeline(p, config, files, tmp, run_date)
        stats = json.loads((tmp / STATS_FILE).read_text(encoding="utf-8"))
        check_reconciled(stats)
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
