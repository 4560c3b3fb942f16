"""Progress of a long stage: a redrawn line on a terminal, plain timestamped lines in cron logs.

On a terminal the line is redrawn at most 5 times a second; elsewhere (cron, systemd, Kubernetes
logs) a plain line is written every `interval` seconds and at every 25%, so logs stay short.
ETA = elapsed / done x remaining, from the stage's own rate.
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from typing import Any, TextIO

import tensorflow as tf


def _duration(seconds: float) -> str:
    return str(dt.timedelta(seconds=round(max(seconds, 0.0))))


class Progress:
    """How far one stage is: `update(done)` as work completes, `finish()` at the end."""

    def __init__(
        self,
        stage: str,
        total: int | None,
        unit: str,
        stream: TextIO | None = None,
        interval: float = 30.0,
    ) -> None:
        self.stage, self.total, self.unit = stage, total, unit
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval = interval
        self.start = time.perf_counter()
        # The first plain line comes at the first quarter (or `interval`): the first steps
        # include tracing and compilation, so an ETA from them would be wildly high.
        self._last_draw = 0.0 if self.tty else self.start
        self._last_quarter = 0
        self.done = 0

    def line(self, done: int) -> str:
        """The progress text for `done` units."""
        elapsed = time.perf_counter() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        text = f"{self.stage}: {done:,}"
        if self.total:
            pct = 100.0 * done / self.total
            text += f"/{self.total:,} {self.unit} ({pct:.0f}%)"
            if 0 < done < self.total and rate > 0:
                text += f", ETA {_duration((self.total - done) / rate)}"
        else:
            text += f" {self.unit}"
        return text + f", {rate:,.0f} {self.unit}/s, elapsed {_duration(elapsed)}"

    def update(self, done: int) -> None:
        """Record progress; draws or logs when it is time to."""
        self.done = done
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw >= 0.2:
                self.stream.write("\r\033[K" + self.line(done))
                self.stream.flush()
                self._last_draw = now
            return
        quarter = int(4 * done / self.total) if self.total else 0
        if now - self._last_draw >= self.interval or quarter > self._last_quarter:
            self._emit(self.line(done))
            self._last_draw, self._last_quarter = now, quarter

    def finish(self, note: str = "") -> None:
        """The final line of the stage."""
        text = self.line(self.done) + (f"; {note}" if note else "")
        if self.tty:
            self.stream.write("\r\033[K")
        self._emit(text)

    def _emit(self, text: str) -> None:
        stamp = "" if self.tty else f"{dt.datetime.now(dt.UTC):%Y-%m-%dT%H:%M:%SZ} "
        self.stream.write(f"{stamp}{text}\n")
        self.stream.flush()


class KerasProgress(tf.keras.callbacks.Callback):
    """Training steps over all epochs as a Progress (the total comes from Keras' params).

    One instance follows every fit it is given to: the first is the `train` line, a later one
    (`training.refit`'s second fit) the `refit` line, each with its own total and ETA. The
    trainer names each fit through `begin_fit` (a run resumed during its refit starts there).
    """

    def __init__(self, stream: TextIO | None = None, interval: float = 30.0) -> None:
        super().__init__()
        self._stream, self._interval = stream, interval
        self._progress: Progress | None = None
        self._steps = 0
        self._epoch = 0
        self._fits = 0
        self._next: str | None = None

    def begin_fit(self, name: str) -> None:
        """The name of the fit that starts next (`train`, `refit`): its progress line's label."""
        self._next = name

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        steps, epochs = self.params.get("steps"), self.params.get("epochs") or 1
        total = steps * epochs if steps else None
        stage = self._next or ("train" if self._fits == 0 else "refit")
        self._next = None
        self._fits += 1
        self._epoch = self._steps = 0
        self._progress = Progress(stage, total, "steps", self._stream, self._interval)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # From the epoch and batch index, not a count of calls: with steps_per_execution > 1
        # Keras calls this once per N steps, and BackupAndRestore resumes at a later epoch.
        self._steps = self._epoch * (self.params.get("steps") or 0) + batch + 1
        if self._progress:
            self._progress.update(self._steps)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._progress:
            self._progress.finish(f"{self._epoch + 1} epochs")
