"""stats.json: counts that reconcile every input line and row, and the run's data fingerprint.

`input_lines` is counted per physical line as the files are read, `input_rows` where rows
leave the readers, and the other counts where they leave the pipeline, independently, so
`input_lines == input_rows == train + validation + test + rejected + duplicates` is a real
check that no line was swallowed, lost or doubled, not an identity.
"""

import datetime as dt
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
from apache_beam.typehints import no_annotations

from beam_jobs import records as r
from beam_jobs.inputs import InputFile
from beam_jobs.vocab import ITEM_FEATURES_FILE, ITEMS_FILE, VOCAB_DIR
from recsys.core.errors import StageFailedError
from recsys.core.layout import DataFile
from recsys.core.records import FORMAT_VERSION, StatsRecord
from recsys.core.schema import SPLITS

STATS_FILE = DataFile.STATS
INPUT_ROWS = "input_rows"
INPUT_LINES = "input_lines"
LINES_KEY = "lines:"
LINE_KINDS = ("header", "blank", "continuation")
SPLIT_KEY = "split:"
SEQUENCES_KEY = "sequences"  # as in beam_jobs.split
SEQUENCE_POSITIONS_KEY = "sequence_positions"
SEQUENCE_LENGTH_KEY = "sequence_length:"
REJECTED_KEY = "rejected:"


# The stage that rejects each reason: rows surviving each stage are reported in stats.stages.
READ_REASONS = frozenset(
    {
        r.MISSING_COLUMN,
        r.WRONG_COLUMN_COUNT,
        r.MALFORMED_ROW,
        r.UNBALANCED_QUOTE,
        r.UNDECODABLE,
        r.UNREADABLE_FILE,
        r.EXCLUDED_EVENT_TYPE,
    }
)
VALIDATION_REASONS = frozenset(
    {
        r.MISSING_FIELD,
        r.BAD_ID,
        r.BAD_TIMESTAMP,
        r.BAD_WEIGHT,
        r.AFTER_RUN_DATE,
        r.BEFORE_MIN_TIMESTAMP,
        r.UNKNOWN_ITEM,
    }
)
TOP_SHARE = 0.01  # popularity concentration: share of train interactions of the top 1% of items


class ReconciliationError(StageFailedError):
    """The counts in stats.json do not add up: a bug in the pipeline, not in the data."""


TimeRange = tuple[int | None, int | None]


class MinMax(beam.CombineFn):
    """Overall (min, max) of (min, max) pairs, whose parts may be None; (None, None) for none."""

    def create_accumulator(self) -> TimeRange:
        return None, None

    def add_input(self, acc: TimeRange, value: TimeRange) -> TimeRange:
        return self.merge_accumulators([acc, value])

    def merge_accumulators(self, accs: Iterable[TimeRange]) -> TimeRange:
        accs = list(accs)  # Beam may pass a one-shot iterator, and it is read twice
        lows = [low for low, _ in accs if low is not None]
        highs = [high for _, high in accs if high is not None]
        return min(lows, default=None), max(highs, default=None)

    def extract_output(self, acc: TimeRange) -> TimeRange:
        return acc


def _reason_key(record: dict[str, Any]) -> str:
    return REJECTED_KEY + record["reason"]


class CountRows(beam.PTransform):
    """Tally rows entering (readers' per-file tallies) and leaving (split counts, rejected)."""

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, pcolls: dict[str, beam.PCollection]) -> beam.PCollection:
        reasons = pcolls["rejected"] | "RejectedReasons" >> beam.Map(_reason_key)
        counted = reasons | "CountReasons" >> beam.combiners.Count.PerElement()
        # Input rows are tallied per file by the reader, split rows per shard by the writer.
        return (
            (counted, pcolls["read_tally"], pcolls["split_counts"])
            | "AllTallies" >> beam.Flatten()
            | "SumPerKey" >> beam.CombinePerKey(sum)
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
    # Duplicates are dead-lettered like rejections but are not bad data: counted apart.
    duplicates = by_reason.pop(r.DUPLICATE, 0)
    input_rows = counts.get(INPUT_ROWS, 0)
    input_lines = counts.get(INPUT_LINES, 0)
    rejected = sum(by_reason.values())
    after_read = input_rows - sum(n for k, n in by_reason.items() if k in READ_REASONS)
    after_validation = after_read - sum(n for k, n in by_reason.items() if k in VALIDATION_REASONS)
    stats: dict[str, Any] = {
        "record": StatsRecord.KIND,
        "format_version": FORMAT_VERSION,
        "run_date": run_date.isoformat(),
        "input_lines": input_lines,
        "lines": {kind: counts.get(LINES_KEY + kind, 0) for kind in LINE_KINDS},
        "input_rows": input_rows,
        "accepted": sum(splits.values()),
        "rejected": rejected,
        "rejected_fraction": rejected / input_lines if input_lines else 0.0,
        "rejected_by_reason": by_reason,
        "duplicates": duplicates,
        "duplicate_fraction": duplicates / input_lines if input_lines else 0.0,
        "stages": {
            "read": input_rows,
            "parsed": after_read,
            "validated": after_validation,
            "unique": after_validation - duplicates,
            "accepted": sum(splits.values()),
        },
        "splits": splits,
        "sequences": {
            "users": counts.get(SEQUENCES_KEY, 0),
            "positions": counts.get(SEQUENCE_POSITIONS_KEY, 0),
            "users_by_length": _length_buckets(counts),
        },
        "users": users,
        "items": items,
        "eval_users": splits["test"],
        "min_timestamp": time_range[0],
        "max_timestamp": time_range[1],
        "input_files": [{"path": f.path, "bytes": f.bytes} for f in files],
    }
    stats["fingerprint"] = fingerprint(stats)
    return stats


def _length_buckets(counts: dict[str, int]) -> dict[str, int]:
    """Users per sequence-length bucket ("1", "2-3", "4-7", ...), shortest first."""
    buckets = {
        key.removeprefix(SEQUENCE_LENGTH_KEY): n
        for key, n in counts.items()
        if key.startswith(SEQUENCE_LENGTH_KEY)
    }
    return dict(sorted(buckets.items(), key=lambda kv: int(kv[0].split("-")[0])))


def fingerprint(stats: dict[str, Any]) -> str:
    """sha256 of the sorted input files (path, size) and the counts: same input, same value."""
    # Of the data, not of the file's format: a new format version keeps the fingerprint.
    skip = ("fingerprint", "input_files", "record", "format_version")
    content = {k: v for k, v in stats.items() if k not in skip}
    files = sorted((f["path"], f["bytes"]) for f in stats["input_files"])
    canonical = json.dumps({"files": files, "counts": content}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_reconciled(stats: dict[str, Any]) -> None:
    """Raise ReconciliationError unless every data line and every row read is accounted for.

    input_lines (physical lines, counted as read) == accepted + rejected + duplicates,
    input_rows (rows leaving the readers) == train + validation + test + rejected + duplicates,
    and the sequence records hold every accepted row once (positions counted as written).
    """
    used = sum(stats["splits"].values()) + stats["rejected"] + stats["duplicates"]
    for key in (INPUT_LINES, INPUT_ROWS):
        if stats[key] != used:
            raise ReconciliationError(
                f"stats do not reconcile: {key}={stats[key]} but accepted "
                f"{stats['accepted']} (splits {stats['splits']}) + rejected "
                f"{stats['rejected']} + duplicates {stats['duplicates']} = {used}: "
                f"{abs(stats[key] - used)} line(s) not accounted for; nothing was published. "
                "This is a bug in beam_jobs: please report it with the input that triggers it"
            )
    sequences = stats["sequences"]
    if sequences["positions"] != stats["accepted"] or sequences["users"] != sum(
        sequences["users_by_length"].values()
    ):
        raise ReconciliationError(
            f"stats do not reconcile: the sequence records hold {sequences['positions']} "
            f"positions of {sequences['users']} users (by length: "
            f"{sequences['users_by_length']}) but {stats['accepted']} rows were accepted; "
            "nothing was published. This is a bug in beam_jobs: please report it with the "
            "input that triggers it"
        )


def write_stats(_: Any, out_dir: str, **parts: Any) -> dict[str, Any]:
    """Assemble stats from the side inputs and write stats.json; returns the stats."""
    stats = assemble_stats(**parts)
    _write(Path(out_dir), stats)
    return stats


def _write(out_dir: Path, stats: dict[str, Any]) -> None:
    """stats.json, checked against its record type first (a bug here fails this run, not the
    stage that reads it)."""
    StatsRecord.model_validate(stats)
    (out_dir / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")


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


def popularity(counts: np.ndarray) -> dict[str, float]:
    """Gini coefficient of item train counts and the top 1% of items' share of interactions."""
    counts = np.sort(np.asarray(counts, dtype=np.float64))
    total = counts.sum()
    if len(counts) == 0 or total == 0:
        return {"gini": 0.0, "top_1pct_share": 0.0}
    n = len(counts)
    # Gini from the sorted values: 1 - 2 * (area under the Lorenz curve).
    gini = float((2 * np.arange(1, n + 1) - n - 1) @ counts / (n * total))
    top = max(1, int(np.ceil(n * TOP_SHARE)))
    return {"gini": round(gini, 6), "top_1pct_share": round(float(counts[-top:].sum() / total), 6)}


def previous_run(output_dir: Path, run_date: str) -> Path | None:
    """The latest sibling data folder of an earlier date with a stats.json, or None."""
    earlier = []
    for sibling in output_dir.parent.glob("*"):
        try:
            day = dt.date.fromisoformat(sibling.name)
        except ValueError:
            continue
        if day.isoformat() < run_date and (sibling / STATS_FILE).is_file():
            earlier.append(sibling)
    return max(earlier, default=None)


def _ratio(now: float, before: float) -> float | None:
    return round(now / before - 1, 6) if before else None


def add_drift(stats: dict[str, Any], out_dir: Path, output_dir: Path) -> dict[str, Any]:
    """Add popularity figures and drift against the previous run's stats; rewrite stats.json."""
    features = out_dir / ITEM_FEATURES_FILE
    counts = pq.read_table(features, columns=["train_count"])["train_count"].to_numpy()
    stats["popularity"] = popularity(counts)
    stats["drift"] = None
    before_dir = previous_run(Path(output_dir), stats["run_date"])
    if before_dir is not None:
        before = json.loads((before_dir / STATS_FILE).read_text(encoding="utf-8"))
        items_now = _vocab(out_dir)
        items_before = _vocab(before_dir)
        new_items = len(items_now - items_before) / len(items_now) if items_now else 0.0
        stats["drift"] = {
            "previous_run_date": before.get("run_date"),
            "users_change": _ratio(stats["users"], before.get("users", 0)),
            "items_change": _ratio(stats["items"], before.get("items", 0)),
            "interactions_change": _ratio(stats["accepted"], before.get("accepted", 0)),
            "new_items_share": round(new_items, 6),
            "gini_change": round(
                stats["popularity"]["gini"] - before.get("popularity", {}).get("gini", 0.0), 6
            )
            if "popularity" in before
            else None,
        }
    _write(out_dir, stats)
    return stats


def _vocab(data_dir: Path) -> set[str]:
    path = data_dir / VOCAB_DIR / ITEMS_FILE
    return set(path.read_text(encoding="utf-8").split("\n")) - {""} if path.is_file() else set()
