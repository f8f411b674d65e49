"""A request submitted to the serving engine, on the event loop's side (squeeze.serve.engine.engine): its updates
reach an asyncio queue through ``loop.call_soon_threadsafe``, and cancelling it is a message to the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from squeeze.serve.types import RequestOutput


class _Cancels(Protocol):
    """The engine, as a handle sees it."""

    def cancel(self, request_id: str) -> None: ...


class RequestHandle:
    """One submitted request on the event loop's side: ``async for`` its updates; ``cancel()`` stops it."""

    def __init__(self, engine: _Cancels, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._done = False

    def deliver(self, output: RequestOutput) -> None:
        """Called from the engine's thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, output)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self._done:
            output = await self._queue.get()
            self._done = output.finished
            yield output

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._engine.cancel(self.request_id)


__all__ = ["RequestHandle"]
