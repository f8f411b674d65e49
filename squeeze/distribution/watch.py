"""A pull's pace limits: a minimum transfer rate over a sliding window, and an overall deadline.

The per-read timeout alone never trips on a server that sends a byte every few seconds (each read returns in
time), so a pull could run for a week. :class:`TransferWatch` sees every read of every worker: when the bytes
of the last ``window`` seconds average below ``min_rate`` bytes/s, or the pull has run ``deadline`` seconds,
the next read raises a TransferError that says which limit tripped and how to change it. Both settings
default from the environment (``SQUEEZE_PULL_MIN_RATE``, ``SQUEEZE_PULL_RATE_WINDOW``,
``SQUEEZE_PULL_DEADLINE``), so ``squeeze run -m URL`` honours them too.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time

from squeeze.errors import ConfigError, TransferError

#: Bytes per second a pull must average over the window (4 KiB/s: only a stalled or drip-fed link is slower).
DEFAULT_MIN_RATE = 4096.0
#: Seconds over which the rate is averaged (short stalls, a slow start, are tolerated).
DEFAULT_RATE_WINDOW = 60.0
#: Seconds a whole pull may take; 0: no deadline.
DEFAULT_DEADLINE = 0.0

ENV_MIN_RATE = "SQUEEZE_PULL_MIN_RATE"
ENV_RATE_WINDOW = "SQUEEZE_PULL_RATE_WINDOW"
ENV_DEADLINE = "SQUEEZE_PULL_DEADLINE"


def _setting(
    value: float | None, env: str, default: float, what: str, example: tuple[str, str], *, positive: bool = False
) -> float:
    """``value``, else the environment variable ``env``, else ``default``; ConfigError unless finite and >= 0
    (> 0 with ``positive``). ``example``: (flag or "", a value with its unit) for the hint, e.g.
    ("--deadline", "3600 (seconds; 0: none)")."""
    flag, sample = example
    origin, shown = what, f"{flag} {sample}"
    if value is None:
        text = os.environ.get(env, "").strip()
        if not text:
            return default
        origin, shown = f"${env}", f"{env}={sample}"
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(
                f"{origin} must be a number, found {text!r}", hint=f"set it to a number, e.g. {shown}, or unset it"
            ) from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0 (0: off)"
        raise ConfigError(f"{origin} must be a finite number {bound}, found {value}", hint=f"e.g. {shown}")
    return float(value)


class TransferWatch:
    """Counts the bytes every worker reads; :meth:`add` raises TransferError once a limit is passed."""

    def __init__(
        self,
        *,
        min_rate: float | None = None,
        window: float | None = None,
        deadline: float | None = None,
        clock: object = time.monotonic,
    ) -> None:
        self.min_rate = _setting(
            min_rate, ENV_MIN_RATE, DEFAULT_MIN_RATE, "min_rate (--min-rate)", ("--min-rate", "4096 (bytes/s; 0: off)")
        )
        self.window = _setting(
            window,
            ENV_RATE_WINDOW,
            DEFAULT_RATE_WINDOW,
            "rate window",
            ("window", "60 (seconds)"),
            positive=True,
        )
        self.deadline = _setting(
            deadline, ENV_DEADLINE, DEFAULT_DEADLINE, "deadline (--deadline)", ("--deadline", "3600 (seconds; 0: none)")
        )
        self._clock = clock
        self._started = self._now()
        self._total = 0
        # (time, bytes so far), from the first byte on (planning, re-hashing kept files and the first
        # connection are not a slow transfer); the oldest kept is the last one at or before ``now - window``
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def _now(self) -> float:
        return self._clock()  # type: ignore[operator,no-any-return]

    def time_left(self) -> float | None:
        """Seconds left before the deadline (None: no deadline; 0 or less once it has passed): what each connect
        and read may wait at most, so that a stalled server cannot hold a pull past it by a whole read timeout."""
        if not self.deadline:
            return None
        return self.deadline - (self._now() - self._started)

    def deadline_error(self) -> TransferError:
        """The TransferError of a pull past its deadline (not retryable)."""
        with self._lock:
            return self._deadline_error(self._now() - self._started)

    def _deadline_error(self, elapsed: float) -> TransferError:
        return TransferError(
            f"the pull passed its deadline of {self.deadline:g} s ({self._total:,} bytes in {elapsed:.1f} s)",
            hint=f"raise it with --deadline or ${ENV_DEADLINE} (0: none); rerun to resume",
            retryable=False,
        )

    def add(self, count: int) -> None:
        """Record ``count`` bytes just read or re-hashed from an earlier pull (progress either way); TransferError
        when a limit is passed."""
        now = self._now()
        with self._lock:
            self._total += count
            elapsed = now - self._started
            if self.deadline and elapsed > self.deadline:
                raise self._deadline_error(elapsed)
            if not self._samples:
                self._samples.append((now, self._total - count))
            self._samples.append((now, self._total))
            cutoff = now - self.window
            while len(self._samples) > 1 and self._samples[1][0] <= cutoff:
                self._samples.popleft()
            since, then = self._samples[0]
            if self.min_rate and since <= cutoff:
                rate = (self._total - then) / (now - since)
                if rate < self.min_rate:
                    raise TransferError(
                        f"the transfer ran at {rate:,.0f} bytes/s over the last {now - since:.0f} s, below the "
                        f"minimum of {self.min_rate:,.0f} bytes/s",
                        hint=f"a stalled or throttled server; lower --min-rate or ${ENV_MIN_RATE} (0: off) to wait "
                        "for it, or rerun later to resume",
                        retryable=False,
                    )


__all__ = [
    "DEFAULT_MIN_RATE",
    "DEFAULT_RATE_WINDOW",
    "DEFAULT_DEADLINE",
    "ENV_MIN_RATE",
    "ENV_RATE_WINDOW",
    "ENV_DEADLINE",
    "TransferWatch",
]
