"""Progress of the Beam job per pipeline stage: rows read, shards written.

A `Tally` is a dead-end branch of the graph that counts what passes a stage into a progress
bar of this process (recsys.core.progress). The local runner (Beam's FnApiRunner, in memory)
runs the DoFns here, so the bars advance while the job runs; on other runners (the
multi-process direct runner, Dask, Dataflow) the DoFns run in workers, whose bars are silent,
and the job shows its final counts only (the stats the stage logs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import apache_beam as beam

from beam_jobs.split import SPLIT_KEY, TRAIN
from recsys.core.progress import LogFriendlyBar, bar

_bars: dict[str, LogFriendlyBar] = {}


class Tally(beam.DoFn):
    """Counts `weight(element)` per element into the process's bar `label`; outputs nothing."""

    def __init__(
        self, label: str, unit: str, total: int | None, weight: Callable[[Any], int]
    ) -> None:
        super().__init__()
        self._label, self._unit, self._total, self._weight = label, unit, total, weight

    def process(self, element: Any) -> list[Any]:
        """Advance the bar (silent unless this process shows progress)."""
        counter = _bars.get(self._label)
        if counter is None:
            counter = _bars[self._label] = bar(self._label, self._total, self._unit)
        counter.update(self._weight(element))
        return []


def close_bars() -> None:
    """Write the final line of every bar this process opened (after the pipeline ran)."""
    for label in list(_bars):
        _bars.pop(label).close()


def batch_rows(element: tuple[int, tuple[int, Any]]) -> int:
    """The rows of one (shard, (rows, Arrow IPC bytes or spill file)) batch of the reader."""
    return int(element[1][0])


def shard_written(element: tuple[str, int]) -> int:
    """1 for the `split:train` count a shard emits once its files are closed, else 0."""
    return int(element[0] == SPLIT_KEY + TRAIN)
