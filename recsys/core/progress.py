"""Progress of long stages through tqdm: a redrawn bar on a terminal, plain lines in logs.

On a terminal tqdm draws its bar. Elsewhere (cron, systemd, Kubernetes logs) the same bar
writes a plain timestamped line at each quarter of its total (unless the stage is that fast)
and otherwise at most every `interval` seconds, and a final line when it closes, so logs stay
short:

    2026-12-02T17:02:30Z train: 81/380 steps (21%), ETA 0:01:51, 3 steps/s, elapsed 0:00:30

Library code asks for bars with `bar(...)`; they stay silent unless the caller turned
progress on (`shown()`: the `recsys` CLI and the nightly do), so tests, benchmarks and
library users get no output they did not ask for.
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm import tqdm

INTERVAL_S = 30.0
"""Seconds between two plain lines (not on a terminal)."""
QUARTER_S = 5.0
"""A quarter reached sooner than this after the last line (or the start) writes none."""

_shown = False


@contextmanager
def shown(enabled: bool = True) -> Iterator[None]:
    """Within the block, `bar()` draws (or logs) progress; outside it bars are silent."""
    global _shown
    previous, _shown = _shown, enabled
    try:
        yield
    finally:
        _shown = previous


def enabled() -> bool:
    """Whether progress is being shown (inside `shown()`)."""
    return _shown


def duration(seconds: float) -> str:
    """`0:01:51`: hours, minutes, seconds."""
    return str(dt.timedelta(seconds=round(max(seconds, 0.0))))


class LogFriendlyBar(tqdm):  # type: ignore[type-arg]  # tqdm is generic in its stubs only
    """tqdm's bar on a terminal; elsewhere plain lines at a bounded rate (`display` override,
    tqdm's documented extension point)."""

    # tqdm's monitor thread forces refreshes on stalled bars: not wanted in a cron log.
    monitor_interval = 0

    def __init__(
        self,
        desc: str,
        total: int | None,
        unit: str,
        *,
        stream: TextIO,
        initial: int = 0,
        interval: float = INTERVAL_S,
        quarter_s: float = QUARTER_S,
        disable: bool = False,
    ) -> None:
        self._plain = not _isatty(stream)
        self._quarter, self._quarter_s = 0, quarter_s
        # tqdm only redraws after `mininterval` seconds: on a log that is the lines' rate.
        super().__init__(
            desc=desc,
            total=total,
            unit=unit,
            initial=initial,
            file=stream,
            disable=disable,
            dynamic_ncols=True,
            mininterval=interval if self._plain else 0.1,
            maxinterval=max(interval, 10.0),
            leave=True if self._plain else None,
        )
        if self._plain and not self.disable and self.total:
            self._quarter = int(4 * self.n / self.total)  # a resumed fit starts part-way

    def update(self, n: float | None = 1) -> bool | None:
        """Advance by `n`; a plain bar also writes a line on reaching each quarter."""
        displayed = super().update(n)
        if self._plain and not self.disable and self.total:
            quarter = int(4 * self.n / self.total)
            if quarter > self._quarter:
                self._quarter = quarter
                now = time.time()  # tqdm's own clock
                # The last quarter is close()'s line; quarters reached within `quarter_s` of
                # the last line (a fast stage: of its start) write none.
                recent = now - self.last_print_t < self._quarter_s
                if not displayed and self.n < self.total and not recent:
                    self.refresh()
                    self.last_print_n, self.last_print_t = self.n, now
        return displayed

    def display(self, msg: str | None = None, pos: int | None = None) -> None:
        """Draw the bar (terminal) or write one plain line (anything else)."""
        if not self._plain:
            super().display(msg, pos)
            return
        # close() sets `disable` before its last display and writes the newline itself.
        closing = bool(self.disable)
        if msg == "" or (not closing and self.n == self.initial):
            # Nothing to clear in a log; and the first line waits for real progress (the
            # first steps include tracing, so an ETA from them would be wildly high).
            return
        stamp = f"{dt.datetime.now(dt.UTC):%Y-%m-%dT%H:%M:%SZ}"
        self.fp.write(f"{stamp} {self.plain_line()}" + ("" if closing else "\n"))
        self.fp.flush()

    def plain_line(self) -> str:
        """`<desc>: done/total unit (pct%), ETA, rate, elapsed[; postfix]`."""
        d = self.format_dict
        n, total, unit, elapsed = d["n"], d["total"], d["unit"], d["elapsed"]
        rate = d["rate"] or ((n - d["initial"]) / elapsed if elapsed else 0.0)
        text = f"{d['prefix']}: {n:,}"
        if total:
            text += f"/{total:,} {unit} ({100.0 * n / total:.0f}%)"
            if 0 < n < total and rate > 0:
                text += f", ETA {duration((total - n) / rate)}"
        else:
            text += f" {unit}"
        # Slow units (export steps, tuning trials) keep two significant digits.
        speed = f"{rate:,.0f}" if rate >= 10 else f"{rate:.2g}"
        text += f", {speed} {unit}/s, elapsed {duration(elapsed)}"
        postfix = str(d.get("postfix") or "").lstrip(", ")
        return text + (f"; {postfix}" if postfix else "")


def bar(
    desc: str,
    total: int | None = None,
    unit: str = "items",
    *,
    initial: int = 0,
    stream: TextIO | None = None,
    interval: float = INTERVAL_S,
    quarter_s: float = QUARTER_S,
    show: bool | None = None,
) -> LogFriendlyBar:
    """A progress bar for one stage; silent unless `show` (default: inside `shown()`)."""
    visible = _shown if show is None else show
    return LogFriendlyBar(
        desc,
        total,
        unit,
        stream=stream or sys.stderr,
        initial=initial,
        interval=interval,
        quarter_s=quarter_s,
        disable=not visible,
    )


def _isatty(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty()) if callable(isatty) else False
