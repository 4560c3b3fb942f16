"""stats.json: counts that reconcile every input row, and the run's data fingerprint.

`input_rows` is counted where rows leave the readers and the other counts where they leave the
pipeline, independently, so `input_rows == train + validation + test + rejected` is a real
check that no row was lost or doubled, not an identity.
"""

import datetime as dt
import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import apache_beam as beam
from apache_beam.typehints import no_annotations

from beam_jobs.inputs import InputFile
from recsys.schema import SPLITS

STATS_FILE = "stats.json"
INPUT_ROWS = "input_rows"
SPLIT_KEY = "split:"
REJECTED_KEY = "rejected:"


class ReconciliationError(RuntimeError):
    """The counts in stats.json do not add up: a bug in the pipeline, not in the data."""


TimeRange = tuple[int | None, int | None]


class MinMax(beam.CombineFn):
    """(min, max) of integers; (None, None) for no input."""

    def create_accumulator(self) -> TimeRange:
        return None, None

    def add_input(self, acc: TimeRange, value: int) -> TimeRange:
        low, high = acc
        return (
            value if low is None else min(low, value),
            value if high is None else max(high, value),
        )

    def merge_accumulators(self, accs: Iterable[TimeRange]) -> TimeRange:
        accs = list(accs)  # Beam may pass a one-shot iterator, and it is read twice
        lows = [low for low, _ in accs if low is not None]
        highs = [high for _, high in accs if high is not None]
        return min(lows, default=None), max(highs, default=None)

    def extract_output(self, acc: TimeRange) -> TimeRange:
        return acc


def _constant(key: str) -> Callable[[Any], str]:
    return lambda _: key


def _reason_key(record: dict[str, Any]) -> str:
    return REJECTED_KEY + record["reason"]


class CountRows(beam.PTransform):
    """Tally rows entering (readers' output) and leaving (splits, rejected) into one dict."""

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, pcolls: dict[str, beam.PCollection]) -> beam.PCollection:
        keyed = [
            pcolls["read_rows"] | "InputRows" >> beam.Map(_constant(INPUT_ROWS)),
            pcolls["read_rejected"] | "InputRejected" >> beam.Map(_constant(INPUT_ROWS)),
            pcolls["rejected"] | "RejectedReasons" >> beam.Map(_reason_key),
        ]
        keyed += [
            pcolls[split] | f"Split{split.title()}" >> beam.Map(_constant(SPLIT_KEY + split))
            for split in SPLITS
        ]
        return (
            keyed
            | "AllKeys" >> beam.Flatten()
            | "CountKeys" >> beam.combiners.Count.PerElement()
            | "ToDict" >> beam.combiners.ToDict()
        )


def assemble_stats(
    counts: dict[str, int],
    time_range: TimeRange,
    users: int,
    items: int,
    run_date: dt.date,
    files: list[InputFile],
) -> dict[str, Any]:
    """The stats.json document from the pipeline's tallies."""
    splits = {split: counts.get(SPLIT_KEY + split, 0) for split in SPLITS}
    by_reason = {
        key.removeprefix(REJECTED_KEY): n
        for key, n in sorted(counts.items())
        if key.startswith(REJECTED_KEY)
    }
    input_rows = counts.get(INPUT_ROWS, 0)
    rejected = sum(by_reason.values())
    stats: dict[str, Any] = {
        "run_date": run_date.isoformat(),
        "input_rows": input_rows,
        "accepted": sum(splits.values()),
        "rejected": rejected,
        "rejected_fraction": rejected / input_rows if input_rows else 0.0,
        "rejected_by_reason": by_reason,
        "splits": splits,
        "users": users,
        "items": items,
        "eval_users": splits["test"],
        "min_timestamp": time_range[0],
        "max_timestamp": time_range[1],
        "input_files": [{"path": f.path, "bytes": f.bytes} for f in files],
    }
    stats["fingerprint"] = fingerprint(stats)
    return stats


def fingerprint(stats: dict[str, Any]) -> str:
    """sha256 of the sorted input files (path, size) and the counts: same input, same value."""
    content = {k: v for k, v in stats.items() if k not in ("fingerprint", "input_files")}
    files = sorted((f["path"], f["bytes"]) for f in stats["input_files"])
    canonical = json.dumps({"files": files, "counts": content}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_reconciled(stats: dict[str, Any]) -> None:
    """Raise ReconciliationError unless input_rows == train + validation + test + rejected."""
    used = sum(stats["splits"].values()) + stats["rejected"]
    if stats["input_rows"] != used:
        raise ReconciliationError(
            f"stats do not reconcile: input_rows={stats['input_rows']} but splits "
            f"{stats['splits']} + rejected {stats['rejected']} = {used}; this is a bug in "
            "beam_jobs, please report it with the input that triggers it"
        )


def write_stats(_: Any, out_dir: str, **parts: Any) -> dict[str, Any]:
    """Assemble stats from the side inputs and write stats.json; returns the stats."""
    stats = assemble_stats(**parts)
    Path(out_dir, STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    return stats


class WriteStats(beam.PTransform):
    """Side-input tallies -> stats.json, written once after everything it counts."""

    def __init__(self, out_dir: str, run_date: dt.date, files: list[InputFile]) -> None:
        super().__init__()
        self._out = out_dir
        self._run_date = run_date
        self._files = files

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, parts: dict[str, beam.PCollection]) -> beam.PCollection:
        single = beam.pvalue.AsSingleton
        return (
            parts["counts"].pipeline
            | "Once" >> beam.Create([None])
            | "Write"
            >> beam.Map(
                write_stats,
                self._out,
                counts=single(parts["counts"]),
                time_range=single(parts["time_range"]),
                users=single(parts["users"]),
                items=single(parts["items"]),
                run_date=self._run_date,
                files=self._files,
            )
        )
