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


@dataclass
class UserTable:
    """Per-user sums: one row per user, `variant`, each outcome and its `pre_` pre-period sum."""

    users: pd.DataFrame
    outcomes: list[str]
    days: list[dt.date]
    daily: pd.DataFrame
    notes: list[str] = field(default_factory=list)

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
            frame = pd.read_csv(path)
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


def _days(frame: pd.DataFrame, path: Path) -> pd.Series:
    try:
        stamps = pd.to_datetime(frame["timestamp"], utc=True, format="mixed")
    except (ValueError, TypeError) as exc:
        raise DataError(
            f"{path}: field 'timestamp' has a value that is not a time: {exc}"
        ) from None
    return stamps.dt.date


def user_table(
    events_path: Path,
    *,
    start: dt.date | None = None,
    pre_events: Path | None = None,
    variants: list[str] | None = None,
) -> UserTable:
    """Per-user sums of the experiment period, with pre-period sums (zero where none)."""
    frame = read_log(events_path)
    outcomes = _check(frame, events_path, needs_variant=True)
    if not outcomes:
        raise DataError(f"{events_path}: no numeric outcome column besides {list(KEYS)}")
    frame = frame.assign(
        user_id=frame["user_id"].astype(str),
        variant=frame["variant"].astype(str),
        day=_days(frame, events_path),
    )
    notes: list[str] = []
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
    pre = _pre_period(pre_rows, pre_events, outcomes)
    per_user = period.groupby("user_id").agg(
        variant=("variant", "first"), **{c: (c, "sum") for c in outcomes}
    )
    pre = pre.reindex(per_user.index, fill_value=0.0)
    users = per_user.join(pre.add_prefix(PRE))
    daily = period.groupby(["user_id", "day"], as_index=False)[outcomes].sum()
    return UserTable(users, outcomes, sorted(set(period["day"])), daily, notes)


def _drop_mixed_users(frame: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    per_user = frame.groupby("user_id")["variant"].nunique()
    mixed = per_user[per_user > 1].index
    return frame[~frame["user_id"].isin(mixed)], len(mixed)


def _pre_period(rows: pd.DataFrame, path: Path | None, outcomes: list[str]) -> pd.DataFrame:
    if path is not None:
        frame = read_log(path)
        _check(frame, path, needs_variant=False)
        missing = [c for c in outcomes if c not in frame.columns]
        if missing:
            raise DataError(f"pre-period file {path}: missing outcome column(s) {missing}")
        rows = frame.assign(user_id=frame["user_id"].astype(str))
    if rows.empty:
        return pd.DataFrame(0.0, index=pd.Index([], name="user_id"), columns=outcomes)
    return rows.groupby("user_id")[outcomes].sum().astype(np.float64)
