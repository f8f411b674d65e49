"""The responses of ``squeeze serve``'s generation routes: an event stream, or the whole result as one JSON
object once every choice is collected. Either way the engine requests are cancelled however the response ends
(finished, client gone, or the shutdown's grace over), and a failure once a stream has started becomes an
``error`` event before ``[DONE]``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from squeeze.serve.http import protocol
from squeeze.serve.http.choices import Choices
from squeeze.serve.types import EngineStoppedError, RequestStream

logger = logging.getLogger("squeeze.serve")

#: nginx's "client closed request": the status of a response nobody is left to read.
CLIENT_CLOSED = 499


class _EventStream(StreamingResponse):
    """A server-sent event stream that cancels its engine request however the response ends: finished,
    client gone (Starlette cancels the body), or the server cancelling the task at shutdown."""

    def __init__(self, events: AsyncIterator[bytes], stream: RequestStream, in_flight: set[RequestStream]) -> None:
        # no-cache / no buffering: proxies must pass each event on as it comes
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._stream = stream
        self._in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            release(self._stream, self._in_flight)


def release(stream: RequestStream, in_flight: set[RequestStream]) -> None:
    """Cancel ``stream`` (a no-op once it finished) and forget it."""
    stream.cancel()
    in_flight.discard(stream)


async def _wait_for_disconnect(request: Request) -> None:
    """Return once the client has gone (the body has been read already, so only http.disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_gone(
    request: Request, choices: Choices, in_flight: set[RequestStream], cut: asyncio.Event
) -> bool:
    """Collect every choice (:meth:`Choices.collect`); False as soon as the client disconnects. The requests
    are cancelled either way unless they finished (and on cancellation of this task). EngineStoppedError (503)
    when the shutdown's grace ends first (``cut``)."""
    result = asyncio.ensure_future(choices.collect())
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    stop = asyncio.ensure_future(cut.wait())
    try:
        await asyncio.wait((result, gone, stop), return_when=asyncio.FIRST_COMPLETED)
        if result.done():
            result.result()
            return True
        if stop.done():
            raise _shutdown_error()
        return False
    finally:
        gone.cancel()
        result.cancel()
        stop.cancel()
        release(choices, in_flight)


def _shutdown_error() -> EngineStoppedError:
    return EngineStoppedError(
        "the request was cancelled: the server is shutting down and its --shutdown-grace period has ended"
    )


async def respond(
    request: Request,
    choices: Choices,
    in_flight: set[RequestStream],
    streaming: bool,
    events: Callable[[], AsyncIterator[bytes]],
    build: Callable[[], dict[str, Any]],
) -> Response:
    """The response to submitted choices: an event stream, or the whole result as one JSON object."""
    cut: asyncio.Event = request.app.state.shutdown_cut
    if streaming:
        return _EventStream(_guarded(events(), choices.request_id, cut), choices, in_flight)
    if not await _collect_unless_gone(request, choices, in_flight, cut):
        return Response(status_code=CLIENT_CLOSED)
    choices.raise_for_failure()
    return JSONResponse(build())


async def _guarded(events: AsyncIterator[bytes], request_id: str, cut: asyncio.Event) -> AsyncIterator[bytes]:
    """``events``, ending in an error event and [DONE] should they fail, or once the shutdown's grace has
    ended (``cut``): once the response has started, an event is all the client can still be told."""
    iterator = events.__aiter__()
    stop = asyncio.ensure_future(cut.wait())
    step: asyncio.Future[bytes] | None = None
    try:
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            await asyncio.wait((step, stop), return_when=asyncio.FIRST_COMPLETED)
            if not step.done():  # the grace has ended (cut_open_requests logged it)
                step.cancel()
                yield protocol.sse(protocol.request_error_body(_shutdown_error()))
                yield protocol.DONE_EVENT
                return
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            yield event
    except Exception as exc:  # noqa: BLE001 - reported to the client and logged with its traceback
        logger.exception("request %s failed while streaming", request_id)
        yield protocol.sse(protocol.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"))
        yield protocol.DONE_EVENT
    finally:
        stop.cancel()
        if step is not None and not step.done():  # the client went away (Starlette cancelled this body)
            step.cancel()


__all__ = ["CLIENT_CLOSED", "release", "respond"]
