"""Per-user split (leave-last-out or time window) with history features, after de-duplication,
written straight to the TFRecord shards.

Duplicates are found inside each user's group: an exact duplicate has the same user, so the
one GroupByKey the split needs anyway also finds them, with no second shuffle. The same group
gives each interaction its history: the user's earlier items, in the protocol's order. The
group is a whole shard of users, so the split rows never travel through a second shuffle to
the writer (history lists are the largest part of a row) and leave as per-shard counts.
"""

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.typehints import no_annotations

from beam_jobs.records import (
    DUPLICATE,
    RARE_ITEM,
    RARE_USER,
    Event,
    Interaction,
    Raw,
    Rejection,
    rejection,
)
from beam_jobs.sinks import shard_of, shard_path, write_shard
from recsys.schema import ITEM_ID, SPLITS, USER_ID

REJECTED = "rejected"
COUNTS = "counts"
USERS = "users"
ITEMS = "items"
SPLIT_KEY = "split:"  # as in beam_jobs.stats
TRAIN, VALIDATION, TEST = SPLITS
SECONDS_PER_DAY = 86_400
LEAVE_LAST_OUT = "leave_last_out"
TIME_WINDOW = "time_window"

# (timestamp, item, file, row, weight, raw): see records.Event.
EventValue = tuple[int, str, str, int, float, Raw]


def dedupe(ordered: list[EventValue]) -> tuple[list[EventValue], list[Rejection]]:
    """Keep the first of each (timestamp, item) by (file, row); reject the rest.

    `ordered` must be sorted: then the first of equal (timestamp, item) is the earliest row.
    """
    kept: list[EventValue] = []
    duplicates: list[Rejection] = []
    for event in ordered:
        if kept and kept[-1][:2] == event[:2]:
            duplicates.append(rejection(event[2], event[3], None, DUPLICATE, event[5]))
        else:
            kept.append(event)
    return kept, duplicates


def split_names(count: int, min_interactions: int) -> list[str]:
    """Split of each of a user's `count` time-ordered interactions: ..., validation, test."""
    if count < min_interactions:
        return [TRAIN] * count
    return [TRAIN] * (count - 2) + [VALIDATION, TEST]


def window_split_names(timestamps: list[int], cutoff: int, eval_days: int) -> list[str]:
    """Time-window split: the last `eval_days` days before `cutoff` are test, the ones before
    them validation, everything earlier train."""
    test_from = cutoff - eval_days * SECONDS_PER_DAY
    validation_from = test_from - eval_days * SECONDS_PER_DAY
    return [
        TEST if ts >= test_from else VALIDATION if ts >= validation_from else TRAIN
        for ts in timestamps
    ]


def histories(items: list[str], length: int) -> list[tuple[str, ...]]:
    """For each position, the up to `length` items strictly before it, oldest first."""
    if length == 0:
        return [()] * len(items)
    return [tuple(items[max(0, i - length) : i]) for i in range(len(items))]


@dataclass(frozen=True)
class SplitSettings:
    """What the split needs from the config: protocol, thresholds, history length, cutoff."""

    min_interactions: int = 5
    history_length: int = 0
    protocol: str = LEAVE_LAST_OUT
    cutoff: int = 0  # first second after the run date (time-window split)
    eval_days: int = 1
    min_user_count: int = 0
    min_item_count: int = 0


def split_user(
    user: str,
    events: list[EventValue],
    settings: SplitSettings,
    item_counts: Mapping[str, int] | None = None,
) -> tuple[dict[str, list[Interaction]], list[Rejection]]:
    """One user's events -> rows per split (time order, with history) and rejections.

    Order of the checks: exact duplicates, then rare items, then rare users.
    """
    s = settings
    # Tuple order sorts by (timestamp, item id) as the protocol says, then by (file, row).
    kept, rejected = dedupe(sorted(events))
    if s.min_item_count and item_counts is not None:
        rare = [e for e in kept if item_counts.get(e[1], 0) < s.min_item_count]
        rejected += [rejection(e[2], e[3], ITEM_ID, RARE_ITEM, e[5]) for e in rare]
        kept = [e for e in kept if item_counts.get(e[1], 0) >= s.min_item_count]
    rows: dict[str, list[Interaction]] = {name: [] for name in SPLITS}
    if len(kept) < s.min_user_count:
        rejected += [rejection(e[2], e[3], USER_ID, RARE_USER, e[5]) for e in kept]
        return rows, rejected
    if s.protocol == TIME_WINDOW:
        names = window_split_names([e[0] for e in kept], s.cutoff, s.eval_days)
    else:
        names = split_names(len(kept), s.min_interactions)
    history = histories([e[1] for e in kept], s.history_length)
    for split, (ts, item, _, _, weight, _), past in zip(names, kept, history, strict=True):
        rows[split].append((user, item, ts, weight, past))
    return rows, rejected


class _SplitAndWriteShard(beam.DoFn):
    """One shard's events -> its three TFRecord files; outputs counts, not rows."""

    def __init__(self, settings: SplitSettings, out_dir: str, num_shards: int) -> None:
        self._s = settings
        self._out = out_dir
        self._shards = num_shards

    def process(
        self,
        element: tuple[int, Iterable[Event | None]],
        item_counts: Mapping[str, int] | None = None,
    ) -> Iterator[Any]:
        shard, keyed = element
        by_user: dict[str, list[EventValue]] = defaultdict(list)
        for event in keyed:
            if event is not None:  # None: the marker that makes empty shards exist
                by_user[event[0]].append(event[1])
        out: dict[str, list[Interaction]] = {name: [] for name in SPLITS}
        items: Counter[str] = Counter()
        for user in sorted(by_user):  # users in id order, each in time order: a stable file
            rows, rejected = split_user(user, by_user.pop(user), self._s, item_counts)
            for rej in rejected:
                yield beam.pvalue.TaggedOutput(REJECTED, rej)
            for name in SPLITS:
                out[name].extend(rows[name])
            if rows[TRAIN]:
                yield beam.pvalue.TaggedOutput(USERS, (user, len(rows[TRAIN])))
                items.update(row[1] for row in rows[TRAIN])
        for name in SPLITS:
            write_shard(out[name], shard_path(f"{self._out}/{name}", shard, self._shards))
            yield beam.pvalue.TaggedOutput(COUNTS, (SPLIT_KEY + name, len(out[name])))
        for pair in sorted(items.items()):
            yield beam.pvalue.TaggedOutput(ITEMS, pair)


class SplitAndWrite(beam.PTransform):
    """Events keyed by user -> `<split>-SSSSS-of-NNNNN.tfrecord.gz` files, and the tallies.

    One shuffle, keyed by shard (a stable hash of the user id): each shard's users are split,
    get their history and are written by one worker, in sorted order, so the files are
    byte-identical whatever the runner. Outputs: `rejected` (duplicates, rare users/items),
    `counts` (("split:<name>", rows) per shard), `users` ((user, train rows)) and `items`
    ((item, train rows) per shard: sum them). A shard is held in one worker's memory: raise
    preprocess.num_shards with the input size (a shard of ~10M rows needs a few GB).
    """

    def __init__(
        self,
        settings: SplitSettings,
        out_dir: str,
        num_shards: int,
        item_counts: beam.PCollection | None = None,
    ) -> None:
        super().__init__()
        self._s = settings
        self._out = out_dir
        self._shards = num_shards
        self._counts = item_counts

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, events: beam.PCollection) -> beam.pvalue.DoOutputsTuple:
        n = self._shards
        extra = {}
        if self._counts is not None:
            extra["item_counts"] = beam.pvalue.AsDict(self._counts)
        markers = events.pipeline | "ShardMarkers" >> beam.Create([(i, None) for i in range(n)])
        keyed = events | "KeyByShard" >> beam.Map(lambda event: (shard_of(event[0], n), event))
        return (
            (keyed, markers)
            | "WithMarkers" >> beam.Flatten()
            | "GroupByShard" >> beam.GroupByKey()
            | "SplitAndWrite"
            >> beam.ParDo(_SplitAndWriteShard(self._s, self._out, n), **extra).with_outputs(
                REJECTED, COUNTS, USERS, ITEMS
            )
        )
