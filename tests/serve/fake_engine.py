"""A stand-in for the serving engine: implements squeeze.serve.types.EngineClient without a model.

Like the real engine it generates on its own thread and hands updates to the event loop with
``call_soon_threadsafe``. Words are tokens: a prompt's words get ids as they are first seen, and a request
"generates" its prompt's words again, cyclically, one per step (`` hello world hello ...``). Two words
act on the request when generated: ``EOS`` ends it with finish_reason "stop" (not emitted), ``FAIL`` with
"error" (after emitting it). Log-probabilities are made up and deterministic: token id t at position p has
-(t + p) / 10, and its top alternatives are ids 0, 1, ... with -0.01, -0.02, .... Blocks are allocated on
submit (ceil((prompt + max_tokens) / block_size)) and freed on finish or cancel, so tests can watch a
cancelled request give its blocks back through /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from squeeze.serve.types import (
    EngineStats,
    EngineStoppedError,
    LatencyObserver,
    QueueFullError,
    RequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    TokenNames,
    check_prompt,
)

VOCAB_LIMIT = 1000


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: FakeStream
    blocks: int
    arrival: float
    generated: int = 0
    text: str = ""
    last_token_at: float | None = None
    last_logprobs: tuple[TokenLogprob, ...] = ()


def _logprob(token: int, position: int, top: int) -> TokenLogprob:
    return TokenLogprob(token, -(token + position) / 10, tuple((i, -(i + 1) / 100) for i in range(top)))


class FakeStream:
    """One request's updates (``async for``); ``cancel()`` frees its blocks at once."""

    def __init__(self, engine: FakeEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def deliver(self, output: RequestOutput) -> None:
        """From the engine's thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, output)
        except RuntimeError:  # the loop has closed: nobody listens any more
            pass

    async def _updates(self) -> AsyncIterator[RequestOutput]:
        while True:
            output = await self._queue.get()
            yield output
            if output.finished:
                return

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._updates()

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)


class FakeEngine:
    """EngineClient for tests (see the module docstring). Public attributes record what the server did."""

    def __init__(
        self,
        *,
        model_name: str = "fake-model",
        max_model_len: int = 4096,
        num_blocks: int = 512,
        block_size: int = 16,
        step_seconds: float = 0.002,
        max_running: int = 4,
        max_queue: int = 16,
        chat_template: bool = True,
        kv_bits: int = 8,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.observer: LatencyObserver | None = None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.step_seconds = step_seconds
        self.max_running = max_running
        self.max_queue = max_queue
        self.chat_template = chat_template
        self.kv_bits = kv_bits
        self.vocab: list[str] = []
        self._ids: dict[str, int] = {}
        #: (prompt ids, params, request id) of every accepted request, in order.
        self.submitted: list[tuple[list[int], SamplingParams, str]] = []
        #: ids of the requests cancelled before they finished.
        self.cancelled: list[str] = []
        #: the messages of every tokenize_chat call.
        self.chat_calls: list[list[dict[str, Any]]] = []
        self.chat_tools: list[list[dict[str, Any]] | None] = []
        #: raised by the next submit (then cleared), to test the server's error paths.
        self.fail_next_submit: Exception | None = None
        self.start_calls = 0
        self.shutdown_calls: list[float] = []
        self._free = num_blocks
        self._active: dict[str, _Request] = {}
        self._accepting = True
        self._stop = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._finished = self._prompt_tokens = self._generated = 0

    # -- EngineClient ------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return [self._id(word) for word in prompt.split()]
        return self._check(prompt, "prompt")

    def _check(self, ids: Sequence[int], param: str) -> list[int]:
        bad = [i for i in ids if not 0 <= i < VOCAB_LIMIT]
        if bad:
            raise RequestError(f"token ids must lie in [0, {VOCAB_LIMIT}), found {bad[0]}", param=param)
        return list(ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(self.word(i) for i in self._check(ids, "tokens"))

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [self.word(i) for i in ids]

    def token_names(
        self, context: Sequence[int], entries: Sequence[TokenLogprob], *, specials: bool = False
    ) -> list[TokenNames]:
        """Words read in context: a space before every word but the text's first."""
        named = []
        for at, entry in enumerate(entries):
            space = " " if context or at else ""
            names = {i: space + self.word(i) for i in (entry.token_id, *(i for i, _ in entry.top))}
            named.append(TokenNames(names[entry.token_id], names))
        return named

    def tokenizer_info(self) -> dict[str, Any]:
        return {"tokenizer_class": "FakeTokenizer", "eos_token": "EOS", "bos_token": None, "pad_token": None}

    def tokenize_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        if not self.chat_template:
            raise RequestError("this model has no chat template", param="messages")
        self.chat_calls.append([dict(m) for m in messages])
        self.chat_tools.append(None if tools is None else list(tools))
        return self.tokenize(" ".join(f"{m['role']}: {m['content']}" for m in messages))

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str) -> FakeStream:
        if self.fail_next_submit is not None:
            error, self.fail_next_submit = self.fail_next_submit, None
            raise error
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down and takes no new requests")
        prompt = list(prompt_ids)
        check_prompt(prompt, params.max_tokens, self.max_model_len)  # the real engine's check
        blocks = math.ceil((len(prompt) + params.max_tokens) / self.block_size)
        with self._cond:
            if len(self._active) >= self.max_running + self.max_queue:
                raise QueueFullError(f"{self.max_queue} requests are already waiting", retry_after=3)
            if blocks > self._free:
                raise QueueFullError(f"no room: {blocks} blocks wanted, {self._free} free")
            self._free -= blocks
            stream = FakeStream(self, request_id, asyncio.get_running_loop())
            self._active[request_id] = _Request(request_id, prompt, params, stream, blocks, time.monotonic())
            self._prompt_tokens += len(prompt)
            self.submitted.append((prompt, params, request_id))
            self._cond.notify_all()
        return stream

    def stats(self) -> EngineStats:
        with self._cond:
            running = min(len(self._active), self.max_running)
            return EngineStats(
                kv_blocks_total=self.num_blocks,
                kv_blocks_free=self._free,
                requests_running=running,
                requests_waiting=len(self._active) - running,
                block_size=self.block_size,
                kv_bits=self.kv_bits,
                kv_pool_bytes=self.num_blocks * self.block_size * 1024,
                requests_finished_total=self._finished,
                prompt_tokens_total=self._prompt_tokens,
                generation_tokens_total=self._generated,
                kv_block_utilisation=0.5,
            )

    def start(self) -> None:
        with self._cond:
            self.start_calls += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
                self._thread.start()

    def shutdown(self, grace_seconds: float) -> None:
        """Stop taking requests, let the running ones go on for up to ``grace_seconds``, abort the rest."""
        self.shutdown_calls.append(grace_seconds)
        self._accepting = False
        deadline = time.monotonic() + grace_seconds
        with self._cond:
            while self._active and self._thread is not None and time.monotonic() < deadline:
                self._cond.wait(timeout=0.01)
            for request in list(self._active.values()):
                self._finish(request, "abort", "")
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- test helpers ------------------------------------------------------------------------------------

    def cancel(self, request_id: str) -> None:
        with self._cond:
            request = self._active.pop(request_id, None)
            if request is not None:
                self._free += request.blocks
                self.cancelled.append(request_id)
                self._cond.notify_all()

    @property
    def free_blocks(self) -> int:
        with self._cond:
            return self._free

    def word(self, token_id: int) -> str:
        return self.vocab[token_id] if token_id < len(self.vocab) else f"t{token_id}"

    # -- the engine's thread -----------------------------------------------------------------------------

    def _id(self, word: str) -> int:
        if word not in self._ids:
            self._ids[word] = len(self.vocab)
            self.vocab.append(word)
        return self._ids[word]

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._active and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                for request in list(self._active.values())[: self.max_running]:
                    self._step(request)
            time.sleep(self.step_seconds)

    def _step(self, request: _Request) -> None:
        """One new token of ``request`` (under the lock)."""
        if request.params.max_tokens == 0:
            self._finish(request, "length", "")
            return
        now = time.monotonic()
        if self.observer is not None:
            since = request.arrival if request.last_token_at is None else request.last_token_at
            (self.observer.observe_ttft if request.last_token_at is None else self.observer.observe_itl)(now - since)
        request.last_token_at = now
        token = request.prompt[request.generated % len(request.prompt)]
        word = self.word(token)
        request.generated += 1
        request.last_logprobs = ()
        if request.params.logprobs is not None:
            position = len(request.prompt) + request.generated - 1
            request.last_logprobs = (_logprob(token, position, request.params.logprobs),)
        self._generated += 1
        if word == "EOS":
            self._finish(request, "stop", "")
            return
        piece = " " + word
        full = request.text + piece
        cut = min((i for i in (full.find(s) for s in request.params.stop) if i >= 0), default=-1)
        if cut >= 0:
            self._finish(request, "stop", full[len(request.text) : cut])
        elif word == "FAIL":
            self._finish(request, "error", piece, error="the fake engine failed on purpose")
        elif request.generated >= request.params.max_tokens:
            self._finish(request, "length", piece)
        else:
            request.text = full
            request.stream.deliver(self._output(request, piece, None))

    def _output(self, request: _Request, text: str, finish: Any, error: str | None = None) -> RequestOutput:
        prompt_logprobs = None
        top = request.params.prompt_logprobs
        if finish is not None and top is not None:
            first = TokenLogprob(request.prompt[0], None)
            prompt_logprobs = (first, *(_logprob(t, p, top) for p, t in enumerate(request.prompt) if p))
        fresh = request.last_logprobs
        request.last_logprobs = ()
        return RequestOutput(
            request_id=request.request_id,
            text=text,
            token_ids=tuple(e.token_id for e in fresh),
            finished=finish is not None,
            finish_reason=finish,
            prompt_tokens=len(request.prompt),
            completion_tokens=request.generated,
            error=error,
            logprobs=fresh,
            prompt_logprobs=prompt_logprobs,
        )

    def _finish(self, request: _Request, reason: Any, text: str, error: str | None = None) -> None:
        del self._active[request.request_id]
        self._free += request.blocks
        self._finished += 1
        request.stream.deliver(self._output(request, text, reason, error))
        self._cond.notify_all()


@contextlib.contextmanager
def serving(app: Any, *, graceful_seconds: int = 5) -> Iterator[str]:
    """Run ``app`` under a real uvicorn server on an ephemeral 127.0.0.1 port, in a thread; yields its base URL
    and stops the server (lifespan shutdown included) on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", log_config=None, lifespan="on", timeout_graceful_shutdown=graceful_seconds
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=graceful_seconds + 10)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the test server did not stop")


__all__ = ["FakeEngine", "FakeStream", "VOCAB_LIMIT", "serving"]
