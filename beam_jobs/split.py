"""Leave-last-out split per user (docs/PREPROCESSING.md), dropping exact duplicates first.

Duplicates are found inside each user's group: an exact duplicate has the same user, so the
one GroupByKey the split needs anyway also finds them, with no second shuffle.
"""

from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.typehints import no_annotations

from beam_jobs.records import DUPLICATE, Rejection, rejection
from recsys.schema import SPLITS

REJECTED = "rejected"
TRAIN, VALIDATION, TEST = SPLITS

# (timestamp, item, file, row, weight, raw): see records.Event.
EventValue = tuple[int, str, str, int, float, str]


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


class _SplitUser(beam.DoFn):
    def __init__(self, min_interactions: int) -> None:
        self._min = min_interactions

    def process(self, element: tuple[str, Iterable[EventValue]]) -> Iterator[Any]:
        user, events = element
        # Tuple order sorts by (timestamp, item id) as the protocol says, then by (file, row).
        kept, duplicates = dedupe(sorted(events))
        for dup in duplicates:
            yield beam.pvalue.TaggedOutput(REJECTED, dup)
        for split, (ts, item, _, _, weight, _) in zip(
            split_names(len(kept), self._min), kept, strict=True
        ):
            interaction = (user, item, ts, weight)
            yield interaction if split == TRAIN else beam.pvalue.TaggedOutput(split, interaction)


class SplitPerUser(beam.PTransform):
    """Events keyed by user -> (train, validation, test, rejected duplicates)."""

    def __init__(self, min_interactions: int) -> None:
        super().__init__()
        self._min = min_interactions

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, events: beam.PCollection) -> beam.pvalue.DoOutputsTuple:
        return (
            events
            | "GroupByUser" >> beam.GroupByKey()
            | "Split"
            >> beam.ParDo(_SplitUser(self._min)).with_outputs(
                VALIDATION, TEST, REJECTED, main=TRAIN
            )
        )
