"""What ``squeeze serve`` bounds for each client: the request body's size, how long a connection may sit
without sending a complete request head (or its body), and how many connections are open at once.

- :class:`BodyLimit` (ASGI middleware): a body over the cap is refused with 413 before it is read (from its
  Content-Length) or as soon as the bytes read pass the cap (chunked), never parsed or tokenized.
- the connection guards, which squeeze.serve.http.uvicorn_server builds into uvicorn's h11 protocol: a header
  timeout (a connection that has not sent a whole request head within ``idle_timeout`` seconds, at its start or
  after a response, is closed: idle and half-open sockets do not pile up), a body deadline (:func:`body_deadline`:
  the body must follow its head within ``idle_timeout`` seconds plus one second per MIN_BODY_RATE bytes, else 408
  and the connection is closed: a client that sends a head and part of a body cannot hold a connection), and a
  connection cap answered with 503 and closed at once, so that the server stays below its open-file limit and
  keeps accepting (silence would look like a hang).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from squeeze.serve.http.open_files import (
    RESERVED_FILES,
    default_max_connections,
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
        declared = content_length(scope)
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


def content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses a malformed one before the app runs
    return None


def busy_response(max_connections: int) -> bytes:
    """The whole HTTP/1.1 response (503, Retry-After, a JSON error) to a connection over ``max_connections``."""
    busy = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\nretry-after: 1\r\n"
    )
    busy_body = _error_json(
        f"the server has {max_connections} connections open, its limit (--max-connections): try again shortly",
        "service_unavailable",
    )
    return busy + b"content-length: %d\r\n\r\n" % len(busy_body) + busy_body


def late_body_response(received: int, declared: int | None, seconds: float) -> bytes:
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


__all__ = [
    "BYTES_PER_TOKEN",
    "BODY_OVERHEAD",
    "DEFAULT_IDLE_TIMEOUT",
    "MIN_BODY_RATE",
    "BodyLimit",
    "body_deadline",
    "busy_response",
    "content_length",
    "late_body_response",
    "default_max_request_bytes",
    "default_max_connections",
    "RESERVED_FILES",
]
