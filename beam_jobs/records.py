"""Per-row shapes (raw rows, validated events, rejections) and the rejection reasons.

Interactions cross the pipeline as Arrow record batches (beam_jobs.columnar); the per-row
shapes here are what the text readers and `validate` produce for one row, and what the
reference split (`beam_jobs.split.split_user`) takes. Rejections stay one dict per row: they
are few, and each becomes one JSON line. Plain tuples and dicts, not NamedTuples: Beam encodes
them with its fast primitive coder, where a NamedTuple would pay for RowCoder.
"""

import json
from typing import Any

# (file, row, (user, item, timestamp, weight), raw): values as read, not yet validated.
# `weight` is None when the input has no weight column; `raw` is the row as found in the file:
# its text, or for columnar files (column names, values), turned into JSON only if the row is
# rejected (a json.dumps per accepted row cost ~8% of the whole job).
Raw = str | tuple[tuple[str, ...], tuple[Any, ...]]
RawRow = tuple[str, int, tuple[Any, Any, Any, Any], Raw]

# A validated interaction waiting for its user's other interactions, keyed by user id.
# The value's field order is the sort order the split protocol needs:
# (timestamp, item) first, then (file, row) to keep the first of exact duplicates.
Event = tuple[str, tuple[int, str, str, int, float, Raw]]

# One row of a split: (user_id, item_id, timestamp seconds, weight, history item ids).
Interaction = tuple[str, str, int, float, tuple[str, ...]]

# {"file", "row", "field", "reason", "raw"}: why one input row was not used.
Rejection = dict[str, Any]

# Rejection reasons (the `reason` values in rejected/*.jsonl and stats.rejected_by_reason).
MISSING_FIELD = "missing_field"
MISSING_COLUMN = "missing_column"
WRONG_COLUMN_COUNT = "wrong_column_count"
MALFORMED_ROW = "malformed_row"
UNBALANCED_QUOTE = "unbalanced_quote"
UNDECODABLE = "undecodable"
UNREADABLE_FILE = "unreadable_file"
BAD_ID = "bad_id"
BAD_TIMESTAMP = "bad_timestamp"
BAD_WEIGHT = "bad_weight"
AFTER_RUN_DATE = "after_run_date"
BEFORE_MIN_TIMESTAMP = "before_min_timestamp"
DUPLICATE = "duplicate"
UNKNOWN_ITEM = "unknown_item"
EXCLUDED_EVENT_TYPE = "excluded_event_type"
RARE_USER = "rare_user"
RARE_ITEM = "rare_item"


def rejection(file: str, row: int, field: str | None, reason: str, raw: Raw | None) -> Rejection:
    """One rejected-row record, in the key order it is written; `raw` as text.

    `raw` None: a columnar file's row whose values were not kept; the pipeline reads them
    back from the file before the record is written (beam_jobs.pipeline.FillRaw).
    """
    text = None if raw is None else raw_text(raw)
    return {"file": file, "row": row, "field": field, "reason": reason, "raw": text}


def raw_text(raw: Raw) -> str:
    """A row's raw content as text: as found, or a columnar row's values as one JSON object."""
    return raw if isinstance(raw, str) else raw_json(dict(zip(*raw, strict=True)))


def raw_json(record: dict[str, Any]) -> str:
    """A row read from a columnar file as one JSON line (its raw content for rejections)."""
    return json.dumps(record, ensure_ascii=False, default=str)
