"""``squeeze serve`` and its open-file limit (RLIMIT_NOFILE): each connection is a file, so the connection cap
must stay below the limit, and when the process runs out all the same, what it logs must not flood the log.

- :func:`default_max_connections` / :func:`check_max_connections`: the cap is the soft limit less
  RESERVED_FILES (the model's files, the log, the engine's own); a larger ``--max-connections`` is refused,
  since past the limit every accept fails and nothing answers, /health included.
- :class:`AcceptErrorLimiter`: an event loop exception handler. asyncio reports a failed accept ("Too many
  open files") with a traceback on every try, and its accept loop tries up to the listen backlog times per
  tick (97,391 tracebacks, 39 MB, in 12 s); this logs one line per ACCEPT_ERROR_LOG_SECONDS with the count.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import resource
import time
from collections.abc import Callable
from typing import Any

from squeeze.errors import ConfigError

logger = logging.getLogger("squeeze.serve")

#: File descriptors kept back from the connection cap: the model's files, the log, the engine's own.
RESERVED_FILES = 64
#: The cap when the process has no open-file limit.
UNLIMITED_MAX_CONNECTIONS = 4096
#: Seconds between two log lines about failed accepts.
ACCEPT_ERROR_LOG_SECONDS = 10.0
#: The errors asyncio's accept loop reports and retries (out of files, buffers or memory).
_ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

ExceptionHandler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]


def open_file_limits() -> tuple[int | None, int | None]:
    """The soft and hard RLIMIT_NOFILE (None: unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    return (None if soft == unlimited else soft), (None if hard == unlimited else hard)


def default_max_connections() -> int:
    """The connection cap: the soft open-file limit less RESERVED_FILES (at least 1); 4096 without a limit."""
    soft, _ = open_file_limits()
    if soft is None or soft <= 0:
        return UNLIMITED_MAX_CONNECTIONS
    return max(1, soft - RESERVED_FILES)


def check_max_connections(max_connections: int) -> None:
    """ConfigError when ``max_connections`` is below 1 or more than the open-file limit allows (the soft limit
    less RESERVED_FILES): past it, accepts fail and the server stops answering, /health included."""
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
        raise ConfigError(
            f"--max-connections must be at least 1, found {max_connections!r}",
            hint=f"leave it out to take the open-file limit less {RESERVED_FILES} ({default_max_connections()})",
        )
    soft, hard = open_file_limits()
    if soft is None or max_connections <= soft - RESERVED_FILES:
        return
    needed = max_connections + RESERVED_FILES
    if hard is None or needed <= hard:
        raise_it = f"or raise the limit first (ulimit -n {needed})"
    else:
        raise_it = f"the hard limit is {hard}: an administrator can raise it (limits.conf, LimitNOFILE=)"
    raise ConfigError(
        f"--max-connections {max_connections} is more than this process can open: its open-file limit "
        f"(ulimit -n) is {soft}, and {RESERVED_FILES} files are kept for the model, the log and the engine",
        hint=f"pass --max-connections {default_max_connections()} or less (the default), {raise_it}",
    )


def _is_accept_error(context: dict[str, Any]) -> bool:
    exc = context.get("exception")
    return "accept" in str(context.get("message", "")) and isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS


class AcceptErrorLimiter:
    """An event loop exception handler that logs failed accepts (asyncio's "socket.accept() out of system
    resource") as one line per ``interval`` seconds, counting those it held back, without a traceback, and
    hands every other error to ``previous`` (None: the loop's default handler)."""

    def __init__(
        self,
        previous: ExceptionHandler | None = None,
        *,
        interval: float = ACCEPT_ERROR_LOG_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.previous = previous
        self.interval = interval
        self.clock = clock
        self._next_log = -math.inf
        self._held_back = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not _is_accept_error(context):
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = self.clock()
        if now < self._next_log:
            self._held_back += 1
            return
        since = f" ({self._held_back} more since the last report)" if self._held_back else ""
        logger.error(
            "cannot accept a connection: %s%s; the server answers again once connections close. Lower "
            "--max-connections or raise the open-file limit (ulimit -n); next report in %g s at the earliest",
            context["exception"].strerror or context["exception"],
            since,
            self.interval,
        )
        self._next_log, self._held_back = now + self.interval, 0


def limit_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Put an :class:`AcceptErrorLimiter` in front of ``loop``'s exception handler (once)."""
    current = loop.get_exception_handler()
    if not isinstance(current, AcceptErrorLimiter):
        loop.set_exception_handler(AcceptErrorLimiter(current))


__all__ = [
    "ACCEPT_ERROR_LOG_SECONDS",
    "RESERVED_FILES",
    "AcceptErrorLimiter",
    "check_max_connections",
    "default_max_connections",
    "limit_accept_errors",
    "open_file_limits",
]
