"""The exposure/outcome log of an A/B test, read and aggregated per user (the unit of analysis).

Default schema (no definition file needed): `user_id`, `variant`, `timestamp` and any numeric
outcome columns (clicks, impressions, watch_seconds, ...), one row per exposure or per
user-day, as Parquet or CSV. Each user's outcomes are summed; a user seen in more than one
variant is dropped (and counted). Rows before the experiment's start are its pre-period (CUPED).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from recsys.ab.assignment import HOLDOUT
from recsys.core.errors import DataError

KEYS = ("user_id", "variant", "timestamp")
PRE = "pre_"
REASON = "reason"
# A ratio metric's numerator cannot exceed its denominator (recsys.ab.analysis.RATIO_METRICS).
PARTS = (("clicks", "impressions"),)
# Integer timestamps by magnitude: below 1e11 seconds (year 5138), below 1e14 milliseconds...
_MAGNITUDES = ((1e11, "s"), (1e14, "ms"), (1e17, "us"))
_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}


@dataclass
class UserTable:
    """Per-user sums: one row per user, `variant`, each outcome and its `pre_` pre-period sum."""

    users: pd.DataFrame
    outcomes: list[str]
    days: list[dt.date]
    daily: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    # Impossible rows that were dropped, with a `reason` column (written as rejected.csv).
    rejected: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def has_pre_period(self) -> bool:
        """Whether any user has pre-period data (CUPED applies)."""
        return any(self.users[PRE + c].abs().sum() > 0 for c in self.outcomes)

    def looks(self) -> Iterator[tuple[dt.date, pd.DataFrame]]:
        """Each day and the per-user sums up to it (users seen by then; pre-period kept).

        Running sums: each day's rows are read once, so the cost is rows + days x users.
        """
        pre = self.users[["variant", *(PRE + c for c in self.outcomes)]]
        running: pd.DataFrame | None = None
        for day, part in self.daily.groupby("day", sort=True):
            sums = part.set_index("user_id")[self.outcomes].astype(np.float64)
            running = sums if running is None else running.add(sums, fill_value=0.0)
            yield day, pre.join(running, how="inner")


def read_log(path: Path) -> pd.DataFrame:
    """A Parquet or CSV log with the key columns checked (DataError naming file, row, field)."""
    if not path.exists():
        raise DataError(f"events file {path} does not exist")
    try:
        if path.is_dir() or path.suffix.lower() in (".parquet", ".pq"):
            frame = pd.read_parquet(path)
        elif path.suffix.lower() in (".csv", ".gz", ".txt"):
            # Ids are text: `007` stays `007` (the assignment hashes the text).
            frame = pd.read_csv(path, dtype={"user_id": str, "variant": str})
        else:
            raise DataError(f"events file {path}: use .parquet or .csv")
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise DataError(f"cannot read events file {path}: {exc}") from None
    return frame


def outcome_columns(frame: pd.DataFrame, path: Path) -> list[str]:
    """The numeric outcome columns of a log without variants (user_id, timestamp checked)."""
    outcomes = _check(frame, path, needs_variant=False)
    if not outcomes:
        raise DataError(f"{path}: no numeric outcome column besides {list(KEYS)}")
    return outcomes


def _check(frame: pd.DataFrame, path: Path, needs_variant: bool) -> list[str]:
    keys = [k for k in KEYS if needs_variant or k != "variant"]
    missing = [k for k in keys if k not in frame.columns]
    if missing:
        raise DataError(
            f"{path}: missing column(s) {missing}; the default schema is {list(KEYS)} plus "
            f"numeric outcome columns (found {list(frame.columns)})"
        )
    outcomes = [
        c for c in frame.columns
        if c not in KEYS and pd.api.types.is_numeric_dtype(frame[c])
        and not pd.api.types.is_bool_dtype(frame[c])
    ]  # fmt: skip
    for column in outcomes:
        bad = ~np.isfinite(frame[column].to_numpy(dtype=np.float64))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise DataError(
                f"{path}: row {row} (0-based data row), field {column!r}: "
                f"{frame[column].iloc[row]!r} is not a finite number"
            )
    for column in keys:
        if frame[column].isna().any():
            row = int(np.flatnonzero(frame[column].isna().to_numpy())[0])
            raise DataError(f"{path}: row {row} (0-based data row), field {column!r} is empty")
    return outcomes


def numeric_time_unit(values: pd.Series, declared: str = "auto") -> str | None:
    """The unit of numeric timestamps: the declared one, else by magnitude; None for text.

    pandas reads bare integers as nanoseconds, which turns epoch seconds into 1970-01-01.
    """
    if not pd.api.types.is_numeric_dtype(values) or pd.api.types.is_bool_dtype(values):
        return None
    if declared != "auto":
        return declared
    largest = float(np.nanmax(np.abs(values.to_numpy(dtype=np.float64)), initial=0.0))
    return next((unit for bound, unit in _MAGNITUDES if largest < bound), "ns")


def unit_note(unit: str | None, declared: str, path: Path) -> str | None:
    """The report's line naming how numeric timestamps were read (None for text times)."""
    if unit is None:
        return None
    how = "as declared (timestamp_unit)" if declared != "auto" else (
        "by magnitude; set timestamp_unit in the definition to override"
    )  # fmt: skip
    return f"{path.name}: numeric timestamps read as {_UNIT_NAMES[unit]} since 1970 UTC ({how})"


def _days(frame: pd.DataFrame, path: Path, unit: str | None) -> pd.Series:
    try:
        if unit is None:
            stamps = pd.to_datetime(frame["timestamp"], utc=True, format="mixed")
        else:
            stamps = pd.to_datetime(frame["timestamp"], utc=True, unit=unit)
    except (ValueError, TypeError, OverflowError) as exc:
        raise DataError(
            f"{path}: field 'timestamp' has a value that is not a time: {exc}"
        ) from None
    return stamps.dt.date


def impossible_rows(
    frame: pd.DataFrame, outcomes: list[str], allow_negative: list[str]
) -> pd.Series:
    """Why each row is impossible ('' when it is fine): a negative count, clicks > impressions.

    The same spirit as the preprocessing job's rejections: such a row is a logging error,
    and one of them can outweigh thousands of real users in a mean.
    """
    reason = pd.Series("", index=frame.index, dtype=object)
    for column in outcomes:
        if column not in allow_negative:
            reason = reason.mask((reason == "") & (frame[column] < 0), f"negative_{column}")
    for num, den in PARTS:
        if num in outcomes and den in outcomes:
            reason = reason.mask((reason == "") & (frame[num] > frame[den]), f"{num}_exceed_{den}")
    return reason


def reject_rows(
    frame: pd.DataFrame,
    outcomes: list[str],
    path: Path,
    *,
    allow_negative: list[str],
    max_fraction: float,
) -> tuple[pd.DataFrame, pd.DataFrame, str | None]:
    """(kept rows, rejected rows with a `reason`, the note counting them).

    DataError when more than `max_fraction` of the rows are impossible: then the log, not a
    few rows, is broken.
    """
    reason = impossible_rows(frame, outcomes, allow_negative)
    bad = (reason != "").to_numpy()
    if not bad.any():
        return frame, frame.iloc[:0].assign(**{REASON: pd.Series(dtype=object)}), None
    counts = reason[bad].value_counts().sort_index()
    summary = ", ".join(f"{name} {count}" for name, count in counts.items())
    first = int(np.flatnonzero(bad)[0])
    share = bad.sum() / len(frame)
    if share > max_fraction:
        raise DataError(
            f"{path}: {bad.sum()} of {len(frame)} rows are impossible ({summary}; first: row "
            f"{first}, 0-based data row), above max_rejected_fraction {max_fraction:g}: fix "
            "the log (or raise the limit in the definition)"
        )
    note = (
        f"{path.name}: {bad.sum()} of {len(frame)} rows rejected as impossible ({summary}; "
        f"first: row {first}) and left out"
    )
    return frame[~bad], frame[bad].assign(**{REASON: reason[bad]}), note


def user_table(
    events_path: Path,
    *,
    start: dt.date | None = None,
    pre_events: Path | None = None,
    variants: list[str] | None = None,
    timestamp_unit: str = "auto",
    max_rejected_fraction: float = 0.01,
    allow_negative: list[str] | None = None,
) -> UserTable:
    """Per-user sums of the experiment period, with pre-period sums (zero where none).

    Impossible rows are dropped (and returned as `rejected`); numeric timestamps are read in
    `timestamp_unit` (auto: by magnitude), named in the notes.
    """
    frame = read_log(events_path)
    outcomes = _check(frame, events_path, needs_variant=True)
    if not outcomes:
        raise DataError(f"{events_path}: no numeric outcome column besides {list(KEYS)}")
    unit = numeric_time_unit(frame["timestamp"], timestamp_unit)
    frame, rejected, rejected_note = reject_rows(
        frame, outcomes, events_path, allow_negative=allow_negative or [],
        max_fraction=max_rejected_fraction,
    )  # fmt: skip
    frame = frame.assign(
        user_id=user_ids(frame["user_id"]),
        variant=frame["variant"].astype(str),
        day=_days(frame, events_path, unit),
    )
    notes = [n for n in (unit_note(unit, timestamp_unit, events_path), rejected_note) if n]
    pre_rows = frame[frame["day"] < start] if start else frame.iloc[:0]
    period = frame[frame["day"] >= start] if start else frame
    held = int((period["variant"] == HOLDOUT).sum())
    if held:
        notes.append(f"{held} holdout rows are not part of the comparison")
        period = period[period["variant"] != HOLDOUT]
    if variants is not None:
        unknown = sorted(set(period["variant"]) - set(variants))
        if unknown:
            raise DataError(
                f"{events_path}: field 'variant' has {unknown}, not in the experiment's "
                f"variants {variants}"
            )
    if period.empty:
        raise DataError(f"{events_path}: no rows on or after the start date {start}")
    period, mixed = _drop_mixed_users(period)
    if mixed:
        notes.append(f"{mixed} users were seen in more than one variant and are excluded")
    pre, pre_rejected = _pre_period(
        pre_rows, pre_events, outcomes, allow_negative or [], max_rejected_fraction, notes
    )
    per_user = period.groupby("user_id").agg(
        variant=("variant", "first"), **{c: (c, "sum") for c in outcomes}
    )
    pre = pre.reindex(per_user.index, fill_value=0.0)
    users = per_user.join(pre.add_prefix(PRE))
    daily = period.groupby(["user_id", "day"], as_index=False)[outcomes].sum()
    rejected = pd.concat([r for r in (rejected, pre_rejected) if len(r)] or [rejected])
    return UserTable(users, outcomes, sorted(set(period["day"])), daily, notes, rejected)


def user_ids(values: pd.Series) -> pd.Series:
    """User ids as the assignment hashes them: text, surrounding whitespace removed."""
    return values.astype(str).str.strip()


def _drop_mixed_users(frame: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    per_user = frame.groupby("user_id")["variant"].nunique()
    mixed = per_user[per_user > 1].index
    return frame[~frame["user_id"].isin(mixed)], len(mixed)


def _pre_period(
    rows: pd.DataFrame,
    path: Path | None,
    outcomes: list[str],
    allow_negative: list[str],
    max_fraction: float,
    notes: list[str],
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-user pre-period sums (from the log's early rows, or a file) and its rejected rows."""
    rejected = rows.iloc[:0]
    if path is not None:
        frame = read_log(path)
        _check(frame, path, needs_variant=False)
        missing = [c for c in outcomes if c not in frame.columns]
        if missing:
            raise DataError(f"pre-period file {path}: missing outcome column(s) {missing}")
        frame, rejected, note = reject_rows(
            frame, outcomes, path, allow_negative=allow_negative, max_fraction=max_fraction
        )
        notes += [note] if note else []
        rows = frame.assign(user_id=user_ids(frame["user_id"]))
    if rows.empty:
        empty = pd.DataFrame(0.0, index=pd.Index([], name="user_id"), columns=outcomes)
        return empty, rejected
    return rows.groupby("user_id")[outcomes].sum().astype(np.float64), rejected
