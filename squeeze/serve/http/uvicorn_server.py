"""``squeeze serve`` under uvicorn: the h11 protocol with the connection guards of
squeeze.serve.http.connection_limits (a header timeout, a body deadline, a connection cap answered 503), the
``uvicorn.Config`` it runs under, and a server whose event loop logs failed accepts once in a while
(squeeze.serve.http.open_files). uvicorn and h11 are imported here, at the top: squeeze's CLI and API import this
module only when they serve.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from squeeze.serve.http.connection_limits import (
    DEFAULT_IDLE_TIMEOUT,
    body_deadline,
    busy_response,
    content_length,
    late_body_response,
)
from squeeze.serve.http.open_files import check_max_connections, default_max_connections, limit_accept_errors


@dataclass(frozen=True)
class Guard:
    """What a guarded connection enforces: ``max_connections`` open at once (the next is sent ``busy`` and
    closed), ``idle_timeout`` seconds for a request head (and, with the body deadline, for a body), and
    ``on_shutdown``, called when uvicorn starts its graceful shutdown (it asks each connection to end)."""

    max_connections: int
    idle_timeout: float
    on_shutdown: Callable[[], None] | None
    busy: bytes


def guarded_protocol(
    *, max_connections: int, idle_timeout: float, on_shutdown: Callable[[], None] | None = None
) -> type[Any]:
    """uvicorn's H11Protocol with a header timeout of ``idle_timeout`` seconds, a body deadline
    (squeeze.serve.http.connection_limits.body_deadline, then 408) and a cap of ``max_connections`` open
    connections (the next is answered 503 and closed), as a class for ``uvicorn.Config(http=...)``.
    ``on_shutdown`` is called when uvicorn starts its graceful shutdown (it asks each connection to end)."""
    guard = Guard(max_connections, idle_timeout, on_shutdown, busy_response(max_connections))
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class GuardedH11Protocol(H11Protocol):  # type: ignore[misc]
    """H11Protocol, closing a connection that sends no whole request head (or body) in time, and over the cap
    (``guard``: set on the subclass :func:`guarded_protocol` makes)."""

    guard: Guard

    _head_timer: Any = None
    _body_timer: Any = None
    _body_started: float | None = None  # loop time the head of the request whose body is awaited arrived
    _body_bytes = 0  # bytes of that body received so far

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.conn.next_event = self._counting(self.conn.next_event)  # type: ignore[method-assign]
        if len(self.connections) > self.guard.max_connections:
            transport.write(self.guard.busy)
            transport.close()
            # out of the count at once: until connection_lost runs, uvicorn's own limit (limit_concurrency) would
            # count this refused connection and answer the admitted ones' requests 503 (seen on a loaded machine)
            self.connections.discard(self)
            return
        self._arm_head_timer()

    def _counting(self, next_event: Callable[[], Any]) -> Callable[[], Any]:
        """h11's next_event, counting the bytes of each request's body as uvicorn takes them."""

        def counted() -> Any:
            event = next_event()
            if isinstance(event, h11.Request):
                self._body_bytes = 0
            elif isinstance(event, h11.Data):
                self._body_bytes += len(event.data)
            return event

        return counted

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request head has arrived (or the connection ended)
            self._cancel_head_timer()
        if self.conn.their_state is h11.SEND_BODY:
            if self._body_started is None:
                self._body_started = self.loop.time()
                self._arm_body_timer(self._body_started)
        elif self._body_started is not None:  # the body is whole (or the connection ended)
            self._cancel_body_timer()
            self._body_started = None

    def on_response_complete(self) -> None:
        self._arm_head_timer()  # before the next cycle starts: a pipelined request cancels it at once
        super().on_response_complete()

    def shutdown(self) -> None:
        if self.guard.on_shutdown is not None:
            self.guard.on_shutdown()  # idempotent: once per connection
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.guard.idle_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()

    def _declared_length(self) -> int | None:
        return content_length({"headers": getattr(self, "headers", ())})

    def _arm_body_timer(self, started: float) -> None:
        self._cancel_body_timer()
        deadline = body_deadline(started, self.guard.idle_timeout, self._declared_length(), self._body_bytes)
        self._body_timer = self.loop.call_at(deadline, self._body_timed_out)

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        started = self._body_started
        if started is None or self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        declared = self._declared_length()
        if self.loop.time() < body_deadline(started, self.guard.idle_timeout, declared, self._body_bytes):
            self._arm_body_timer(started)  # more of a chunked body came: it earned more time
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self.transport.write(late_body_response(self._body_bytes, declared, self.loop.time() - started))
            # the app, waiting for the body, sees a client that went away; what it sends is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def uvicorn_config(
    app: Any,
    *,
    shutdown_grace: float,
    max_connections: int | None = None,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    log_level: str = "warning",
    configure_logging: bool = True,
) -> Any:
    """The ``uvicorn.Config`` squeeze serve runs ``app`` under: the guarded protocol, keep-alive as long as the
    header timeout, uvicorn's own 503 above the same concurrency, and the graceful shutdown's timeout.
    ``configure_logging=False`` leaves the logging configuration alone (tests)."""
    if max_connections is not None:
        check_max_connections(max_connections)
    limit = max_connections if max_connections is not None else default_max_connections()
    # squeeze's app ends its open responses when the grace is over (create_app's begin_shutdown); uvicorn's
    # own deadline, one second later, only cancels what is left (with a traceback each)
    on_shutdown = getattr(getattr(app, "state", None), "begin_shutdown", None)
    kwargs: dict[str, Any] = {} if configure_logging else {"log_config": None}
    return uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(shutdown_grace) + 1,
        lifespan="on",
        http=guarded_protocol(max_connections=limit, idle_timeout=idle_timeout, on_shutdown=on_shutdown),
        timeout_keep_alive=max(1, math.ceil(idle_timeout)),
        limit_concurrency=limit + 1,  # uvicorn counts the connection asking; the protocol refuses the excess
        **kwargs,
    )


def uvicorn_server(config: Any) -> Any:
    """A ``uvicorn.Server`` over ``config`` whose event loop logs failed accepts (out of open files) once per
    ACCEPT_ERROR_LOG_SECONDS instead of a traceback per try (squeeze.serve.http.open_files.AcceptErrorLimiter)."""

    class GuardedServer(uvicorn.Server):  # type: ignore[misc]
        async def serve(self, sockets: Any = None) -> None:
            limit_accept_errors(asyncio.get_running_loop())
            await super().serve(sockets=sockets)

    return GuardedServer(config)


__all__ = ["Guard", "GuardedH11Protocol", "guarded_protocol", "uvicorn_config", "uvicorn_server"]
