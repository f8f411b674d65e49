"""What ``squeeze serve`` bounds for each client: the request body's size, how long a connection may sit
without sending a complete request head (or its body), and how many connections are open at once.

- :class:`BodyLimit` (ASGI middleware): a body over the cap is refused with 413 before it is read (from its
  Content-Length) or as soon as the bytes read pass the cap (chunked), never parsed or tokenized.
- :func:`guarded_protocol`: uvicorn's h11 protocol with a header timeout (a connection that has not sent a
  whole request head within ``idle_timeout`` seconds, at its start or after a response, is closed: idle and
  half-open sockets do not pile up), a body deadline (the body must follow its head within ``idle_timeout``
  seconds plus one second per MIN_BODY_RATE bytes, else 408 and the connection is closed: a client that sends
  a head and part of a body cannot hold a connection), and a connection cap answered with 503 and closed at
  once, so that the server stays below its open-file limit and keeps accepting (silence would look like a hang).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from squeeze.serve.http.open_files import (
    RESERVED_FILES,
    check_max_connections,
    default_max_connections,
    limit_accept_errors,
)

if TYPE_CHECKING:  # squeeze's CLI imports this module without the serve extra
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: Bytes a request body may take per token of context: a token is ~4 characters of text, which JSON may
#: escape to 6 bytes each (``\u00e9``), or one id of up to 7 digits and a comma; generous, since only a body
#: far beyond any usable prompt should be refused here rather than by the tokenizer's length check.
BYTES_PER_TOKEN = 32
#: Room for the rest of a request (sampling fields, chat roles, stop strings).
BODY_OVERHEAD = 1 * 2**20
#: Seconds a connection may go without sending a whole request head (at its start or after a response).
DEFAULT_IDLE_TIMEOUT = 10.0
#: Bytes per second a request body must arrive at, on average, after the ``idle_timeout`` seconds it is given
#: on top: 64 KiB/s (half a megabit) takes the largest default body (~1 MiB for a 2k context) in ~16 s more.
MIN_BODY_RATE = 64 * 1024


def default_max_request_bytes(max_model_len: int) -> int:
    """The body cap for a context of ``max_model_len`` tokens: BYTES_PER_TOKEN each, plus BODY_OVERHEAD."""
    return BYTES_PER_TOKEN * max(1, max_model_len) + BODY_OVERHEAD


def _error_json(message: str, error_type: str) -> bytes:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    return json.dumps(body).encode()


#: After a 413 in the middle of a body, up to this much more of it is read and dropped (for at most
#: DRAIN_SECONDS): closing a connection with unread bytes resets it, and the client, still sending, would see the
#: reset instead of the answer. A bigger or slower body is cut off there all the same.
DRAIN_BYTES = 1 << 20
DRAIN_SECONDS = 2.0


async def _drain(receive: Receive, more: bool) -> None:
    """Read and drop what is left of a refused body, bounded by DRAIN_BYTES and DRAIN_SECONDS."""
    loop = asyncio.get_running_loop()
    deadline, drained = loop.time() + DRAIN_SECONDS, 0
    while more and drained < DRAIN_BYTES and (left := deadline - loop.time()) > 0:
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        more = bool(message.get("more_body", False))


class BodyLimit:
    """Refuse a request body over ``max_bytes`` with 413 (OpenAI-shaped), before the app reads it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, found: str) -> bytes:
        return _error_json(
            f"the request body is {found}, more than this server's limit of {self.max_bytes} bytes "
            "(set by --max-request-bytes)",
            "invalid_request_error",
        )

    async def _refuse(self, send: Send, body: bytes) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),  # whole and framed, whatever happens to the rest
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, self._too_large(f"{declared} bytes (Content-Length)"))
            return
        seen = 0
        refused = False

        async def limited_receive() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # answered here; the app then sees a client that went away, and whatever it sends is dropped
                    refused = True
                    await self._refuse(send, self._too_large(f"over {self.max_bytes} bytes"))
                    await _drain(receive, bool(message.get("more_body", False)))
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses a malformed one before the app runs
    return None


def _busy_response(max_connections: int) -> bytes:
    """The whole HTTP/1.1 response (503, Retry-After, a JSON error) to a connection over ``max_connections``."""
    busy = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\nretry-after: 1\r\n"
    )
    busy_body = _error_json(
        f"the server has {max_connections} connections open, its limit (--max-connections): try again shortly",
        "service_unavailable",
    )
    return busy + b"content-length: %d\r\n\r\n" % len(busy_body) + busy_body


def _late_body_response(received: int, declared: int | None, seconds: float) -> bytes:
    """The whole HTTP/1.1 response (408, a JSON error) to a request whose body stopped coming."""
    expected = f" of {declared}" if declared is not None else ""
    body = _error_json(
        f"the request body did not arrive in time: {received}{expected} bytes in {seconds:.1f} s (a body must "
        f"follow its head within --idle-timeout seconds plus one second per {MIN_BODY_RATE} bytes)",
        "request_timeout",
    )
    head = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


def body_deadline(started: float, idle_timeout: float, declared: int | None, received: int) -> float:
    """When a body whose head arrived at ``started`` must be whole: ``idle_timeout`` seconds, plus one second
    per MIN_BODY_RATE bytes of its length (its Content-Length, else what has arrived: a chunked body earns
    its time as it comes, and a stalled one runs out)."""
    return started + idle_timeout + max(declared or 0, received) / MIN_BODY_RATE


def guarded_protocol(
    *, max_connections: int, idle_timeout: float, on_shutdown: Callable[[], None] | None = None
) -> type[Any]:
    """uvicorn's H11Protocol with a header timeout of ``idle_timeout`` seconds, a body deadline
    (:func:`body_deadline`, then 408) and a cap of ``max_connections`` open connections (the next is answered
    503 and closed), as a class for ``uvicorn.Config(http=...)``. ``on_shutdown`` is called when uvicorn starts
    its graceful shutdown (it asks each connection to end)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = _busy_response(max_connections)

    class GuardedH11Protocol(H11Protocol):  # type: ignore[misc]
        """H11Protocol, closing a connection that sends no whole request head (or body) in time, and over the cap."""

        _head_timer: Any = None
        _body_timer: Any = None
        _body_started: float | None = None  # loop time the head of the request whose body is awaited arrived
        _body_bytes = 0  # bytes of that body received so far

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.conn.next_event = self._counting(self.conn.next_event)  # type: ignore[method-assign]
            if len(self.connections) > max_connections:
                transport.write(busy)
                transport.close()
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
            if on_shutdown is not None:
                on_shutdown()  # idempotent: once per connection
            super().shutdown()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            self._cancel_body_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(idle_timeout, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.close()

        def _declared_length(self) -> int | None:
            return _content_length({"headers": getattr(self, "headers", ())})

        def _arm_body_timer(self, started: float) -> None:
            self._cancel_body_timer()
            deadline = body_deadline(started, idle_timeout, self._declared_length(), self._body_bytes)
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
            if self.loop.time() < body_deadline(started, idle_timeout, declared, self._body_bytes):
                self._arm_body_timer(started)  # more of a chunked body came: it earned more time
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                self.transport.write(_late_body_response(self._body_bytes, declared, self.loop.time() - started))
                # the app, waiting for the body, sees a client that went away; what it sends is dropped
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

    return GuardedH11Protocol


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
    import math

    import uvicorn

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
    import uvicorn

    class GuardedServer(uvicorn.Server):  # type: ignore[misc]
        async def serve(self, sockets: Any = None) -> None:
            limit_accept_errors(asyncio.get_running_loop())
            await super().serve(sockets=sockets)

    return GuardedServer(config)


__all__ = [
    "BYTES_PER_TOKEN",
    "BODY_OVERHEAD",
    "DEFAULT_IDLE_TIMEOUT",
    "MIN_BODY_RATE",
    "BodyLimit",
    "body_deadline",
    "default_max_request_bytes",
    "default_max_connections",
    "guarded_protocol",
    "uvicorn_config",
    "uvicorn_server",
    "RESERVED_FILES",
]
