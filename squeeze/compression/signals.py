"""SIGINT / SIGTERM during a compress run: stop promptly, keep every committed checkpoint.

Checkpoints are committed atomically, so stopping between any two bytecodes is safe; only the few renames
that publish the finished artifact run with signals deferred, so that a publish is never left half done
by a Ctrl-C (a SIGKILL there is still recovered by the next run). Handlers are installed only in the main
thread (Python delivers signals nowhere else) and the previous ones are restored afterwards.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Signalled(BaseException):
    """Raised from the handler; a BaseException so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalGuard:
    """Turn SIGINT/SIGTERM into :class:`Signalled` inside a ``with`` block; ``received`` keeps the first one."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._deferring = 0
        self._pending: int | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self._deferring:
            self._pending = signum
            return
        raise Signalled(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold signals back until the block ends (then raise for the one that arrived, if any)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if not self._deferring and self._pending is not None:
            signum, self._pending = self._pending, None
            raise Signalled(signum)

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous = {}


__all__ = ["SignalGuard", "Signalled"]
