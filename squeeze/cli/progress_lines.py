"""Progress as plain log lines, for a stderr that is not a terminal (nohup, CI, a cluster scheduler's log).

The same ``progress(stage, done, total)`` callback the terminal's bars consume (squeeze.compression.job's
``StageProgress``), written as one line per event worth a line: every stage's start (``total == 0``: a stage with
no count, or one about to count) and, for counted work (Fisher windows, layer groups, tuning blocks), its first
report, its last (``done == total``) and the others at most once per ``interval`` seconds. Each line carries the
time since the command started, done / total, the time in this stage and an estimate of what is left in it::

    [0:00:03] stage: sensitivity
    [0:00:09] Fisher sensitivity (windows) 10/40 (25%), 0:00:06 in this stage, about 0:00:18 left
    [0:12:41] Quantizing (layers) 98/98 (100%), 0:09:30 in this stage, done
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

#: At most one count line per this many seconds (a stage's first and last reports always print).
LOG_INTERVAL_SECONDS = 5.0


def clock_text(seconds: float) -> str:
    """``h:mm:ss`` of a duration (whole seconds)."""
    return str(timedelta(seconds=int(max(seconds, 0.0))))


class ProgressLines:
    """A thread-safe ``progress(stage, done, total)`` that writes rate-limited plain lines through ``write``.

    ``labels``: stage name -> what a count line calls it (default: the name). ``clock``: seconds, monotonic
    (tests pass a fake one). ``interval``: default :data:`LOG_INTERVAL_SECONDS`. The time in a stage runs from
    its last start report (``total == 0``), or from its first count report when it never announced a start; the
    estimate is that time per unit done, times what is left.
    """

    def __init__(
        self,
        labels: dict[str, str],
        write: Callable[[str], None],
        *,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.labels = labels
        self.write = write
        self.interval = LOG_INTERVAL_SECONDS if interval is None else interval
        self.clock = clock
        self.started = clock()
        self.last_line = float("-inf")
        self.stage_started = self.started
        self.counting: dict[str, float] = {}  # counted stage -> when it started
        self.lock = threading.Lock()

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self.lock:
            now = self.clock()
            if total <= 0:  # a stage starts
                self.stage_started = now
                self.counting.pop(stage, None)
                self._emit(now, f"stage: {stage}")
                return
            first = stage not in self.counting
            if first:  # counted work inside the stage that started last (Fisher windows inside "sensitivity")
                self.counting[stage] = self.stage_started
            if not (first or done >= total or now - self.last_line >= self.interval):
                return
            self._emit(now, self._count_line(stage, done, total, now - self.counting[stage]))

    def _count_line(self, stage: str, done: int, total: int, spent: float) -> str:
        label = self.labels.get(stage, stage)
        if done >= total:
            left = "done"
        elif done > 0:
            left = f"about {clock_text(spent / done * (total - done))} left"
        else:
            left = "no estimate yet"
        return f"{label} {done}/{total} ({100 * done // total}%), {clock_text(spent)} in this stage, {left}"

    def _emit(self, now: float, text: str) -> None:
        self.last_line = now
        self.write(f"[{clock_text(now - self.started)}] {text}")


__all__ = ["LOG_INTERVAL_SECONDS", "ProgressLines", "clock_text"]
