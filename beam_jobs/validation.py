"""Turn raw rows into typed interactions keyed by user, or into rejections saying why not."""

import datetime as dt
import math
from typing import Any

from beam_jobs.records import (
    AFTER_RUN_DATE,
    BAD_ID,
    BAD_TIMESTAMP,
    BAD_WEIGHT,
    BEFORE_MIN_TIMESTAMP,
    MISSING_FIELD,
    Event,
    RawRow,
    Rejection,
    rejection,
)
from recsys.core.schema import ITEM_ID, TIMESTAMP, USER_ID, WEIGHT

DEFAULT_WEIGHT = 1.0
MS_PER_SECOND = 1000


class InvalidValue(ValueError):
    """A field's value cannot be used; `reason` is the rejection reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse_id(value: Any) -> str:
    """An id as a stripped string; InvalidValue if missing or not one printable line."""
    if isinstance(value, float):
        if math.isnan(value):
            raise InvalidValue(MISSING_FIELD)
        # Integer ids come back as floats from pandas-written Parquet with nulls: 7.0 means "7".
        if value.is_integer():
            value = int(value)
    elif isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    text = "" if value is None else str(value).strip()
    if not text:
        raise InvalidValue(MISSING_FIELD)
    # Vocab files hold one id per line: an id with a line break or control character would
    # silently shift every id after it.
    if not text.isprintable():
        raise InvalidValue(BAD_ID)
    return text


def parse_timestamp(value: Any, unit_divisor: int = 1) -> int:
    """Whole seconds since the epoch from an int/float (s or ms), ISO-8601 text or a datetime."""
    if value is None or isinstance(value, bool):
        raise InvalidValue(MISSING_FIELD if value is None else BAD_TIMESTAMP)
    if isinstance(value, str):
        value = value.strip()
        if not value:
            raise InvalidValue(MISSING_FIELD)
        seconds = _parse_timestamp_text(value, unit_divisor)
    elif isinstance(value, int):
        seconds = value // unit_divisor
    elif isinstance(value, float):
        if math.isnan(value):
            raise InvalidValue(MISSING_FIELD)
        if math.isinf(value):
            raise InvalidValue(BAD_TIMESTAMP)
        seconds = math.floor(value / unit_divisor)
    elif isinstance(value, dt.datetime | dt.date):
        seconds = _datetime_seconds(value)
    else:
        raise InvalidValue(BAD_TIMESTAMP)
    if seconds < 0:
        raise InvalidValue(BAD_TIMESTAMP)  # before 1970: a corrupt value, not a real event
    return seconds


def _parse_timestamp_text(text: str, unit_divisor: int) -> int:
    try:
        return int(text) // unit_divisor
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        try:
            return _datetime_seconds(dt.datetime.fromisoformat(text))
        except ValueError:
            raise InvalidValue(BAD_TIMESTAMP) from None
    if not math.isfinite(number):
        raise InvalidValue(BAD_TIMESTAMP)
    return math.floor(number / unit_divisor)


def _datetime_seconds(value: dt.date) -> int:
    if not isinstance(value, dt.datetime):
        value = dt.datetime.combine(value, dt.time())
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)  # the log's times are UTC unless they say otherwise
    return math.floor(value.timestamp())


def parse_weight(value: Any) -> float:
    """The interaction weight; a missing value (no column, empty, null) is 1.0."""
    if value is None or value == "":
        return DEFAULT_WEIGHT
    if isinstance(value, bool):
        raise InvalidValue(BAD_WEIGHT)
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise InvalidValue(BAD_WEIGHT) from None
    if math.isnan(weight):
        return DEFAULT_WEIGHT
    if math.isinf(weight):
        raise InvalidValue(BAD_WEIGHT)
    return weight


def validate(row: RawRow, cutoff: int, unit_divisor: int = 1, floor: int = 0) -> Event | Rejection:
    """One raw row -> an Event keyed by user id, or the Rejection of its first bad field.

    Accepted timestamps are in [floor, cutoff): the run date's end, and the configured lower
    bound (preprocess.min_timestamp / max_age_days; 0 when unset).
    """
    file, line, (user, item, timestamp, weight), raw = row
    field = USER_ID
    try:
        user_id = parse_id(user)
        field = ITEM_ID
        item_id = parse_id(item)
        field = TIMESTAMP
        seconds = parse_timestamp(timestamp, unit_divisor)
        field = WEIGHT
        strength = parse_weight(weight)
    except InvalidValue as exc:
        return rejection(file, line, field, exc.reason, raw)
    if seconds >= cutoff:
        return rejection(file, line, TIMESTAMP, AFTER_RUN_DATE, raw)
    if seconds < floor:
        return rejection(file, line, TIMESTAMP, BEFORE_MIN_TIMESTAMP, raw)
    return user_id, (seconds, item_id, file, line, strength, raw)
