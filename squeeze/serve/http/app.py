"""The HTTP front of ``squeeze serve``: an OpenAI-compatible FastAPI app over any :class:`EngineClient`.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (and /v1/models/{id}), GET /health,
GET /metrics, and vLLM's tokenizer endpoints POST /tokenize, POST /detokenize, GET /tokenizer_info
(squeeze.serve.http.tokenization). A request's choices (prompts x ``n``) are engine requests held as one stream
(squeeze.serve.http.choices). Every error is OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``), schema
violations and malformed JSON included (400, not FastAPI's 422; squeeze.serve.http.error_handlers).

A request is tokenized and submitted before its response starts, so a refusal (400, 429 + Retry-After, 503)
comes back as a JSON error even for ``stream: true``; an engine failure in the middle of a stream becomes an
``error`` event before ``[DONE]`` (squeeze.serve.http.responses). A client that goes away cancels its request (its KV
blocks are freed):
Starlette's disconnect watch cancels a streamed body, whose response cancels the request in ``finally``;
a non-streamed handler waits for the result and the disconnect together. Requests whose responses the
server cut at shutdown are cancelled before the engine shuts down. Handlers are coroutines, so the engine's
methods are called on the event loop's thread (its contract), except tokenization, which runs on one worker
thread so that a long prompt does not hold up /health and the other requests. A body over
``max_request_bytes`` is refused with 413 before it is read (squeeze.serve.http.connection_limits).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from squeeze.serve.http import protocol, tokenization
from squeeze.serve.http.choices import Choices, check_n, completion_body, completion_events
from squeeze.serve.http.connection_limits import BodyLimit, default_max_request_bytes
from squeeze.serve.http.error_handlers import error_response, install_error_handlers
from squeeze.serve.http.metrics import ServeMetrics
from squeeze.serve.http.request_schema import ChatRequest, CompletionRequest
from squeeze.serve.http.responses import release, respond
from squeeze.serve.http.tokenization import DetokenizeRequest, TokenizeRequest
from squeeze.serve.http.tool_calls import tool_chat_body, tool_chat_events
from squeeze.serve.types import EngineClient, RequestError, RequestStream, StructuredOutput

logger = logging.getLogger("squeeze.serve")

_T = TypeVar("_T")


@dataclass
class _AppState:
    """What the routes and the lifespan of one app share: the engine, the served name, the requests whose
    response has not ended, and the shutdown's state."""

    engine: EngineClient
    model_name: str
    metrics: ServeMetrics
    shutdown_grace_seconds: float
    started_at: int = field(default_factory=protocol.now)
    shutting_down: bool = False
    #: requests submitted whose response has not ended
    in_flight: set[RequestStream] = field(default_factory=set)
    # set when the shutdown's grace has ended: every open response then ends (an error event and [DONE] for a
    # stream, 503 otherwise) before uvicorn would cancel its task, which ended streams mid-air with a traceback
    cut: asyncio.Event = field(default_factory=asyncio.Event)
    shutdown_timer: list[asyncio.TimerHandle] = field(default_factory=list)
    running_loop: list[asyncio.AbstractEventLoop] = field(default_factory=list)
    # one thread: tokenizers are not safe to call from several at once, and the loop must stay free
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="squeeze-tokenize")
    )

    def cut_open_requests(self) -> None:
        for stream in list(self.in_flight):
            logger.warning(
                "request %s cancelled: still open %g s after the shutdown began (--shutdown-grace)",
                stream.request_id,
                self.shutdown_grace_seconds,
            )
        self.cut.set()

    def arm_cut(self) -> None:
        if not self.shutdown_timer:
            timer = self.running_loop[0].call_later(self.shutdown_grace_seconds, self.cut_open_requests)
            self.shutdown_timer.append(timer)

    def begin_shutdown(self) -> None:
        """The server stopped accepting: open requests get ``shutdown_grace_seconds`` more (any thread)."""
        if self.running_loop:
            self.running_loop[0].call_soon_threadsafe(self.arm_cut)

    async def off_loop(self, fn: Callable[..., _T], *arguments: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *arguments)

    async def compile_grammar(self, found: tuple[StructuredOutput, str] | None) -> StructuredOutput | None:
        """Compile a request's grammar on the tokenizer thread (a 400 naming the field when it does not
        compile, or when the engine has no structured output); the grammar, or None."""
        if found is None:
            return None
        compile_grammar = getattr(self.engine, "compile_grammar", None)
        if compile_grammar is None:
            raise RequestError("this engine does not support structured output", param=found[1])
        await self.off_loop(compile_grammar, *found)
        return found[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise protocol.ModelNotFoundError(
                f"the model {name!r} does not exist on this server",
                hint=f"it serves {self.model_name!r}",
                param="model",
            )

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.started_at,
            "owned_by": "squeeze",
            "max_model_len": self.engine.max_model_len,
        }


def create_app(
    engine: EngineClient,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    shutdown_grace_seconds: float = 10.0,
    max_request_bytes: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine``.

    api_key: when set, /v1/* and /metrics need ``Authorization: Bearer <api_key>`` (401 otherwise); /health
    stays open. served_model_name: the model name /v1/models lists and requests must name (default: the
    engine's). The app's lifespan starts the engine and, at shutdown, calls ``engine.shutdown`` with
    ``shutdown_grace_seconds``; /health answers 503 from then on. Sets ``engine.observer`` to the app's
    :class:`ServeMetrics`. max_request_bytes: bodies over it are refused with 413 before they are read (default:
    squeeze.serve.http.connection_limits.default_max_request_bytes of the engine's context). Prompts are tokenized
    on one worker thread, not on the event loop: /health and the streams keep answering while a long one is.
    """
    model_name = served_model_name or engine.model_name
    metrics = ServeMetrics(engine.stats)
    engine.observer = metrics
    state = _AppState(engine, model_name, metrics, shutdown_grace_seconds)

    app = FastAPI(title="squeeze serve", lifespan=_lifespan(state), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    app.state.shutdown_cut = state.cut
    app.state.begin_shutdown = state.begin_shutdown
    install_error_handlers(app)
    limit = max_request_bytes if max_request_bytes is not None else default_max_request_bytes(engine.max_model_len)
    app.add_middleware(BodyLimit, max_bytes=limit)

    guarded = [Depends(_authorizer(api_key))]
    _add_info_routes(app, state, guarded)
    _add_generation_routes(app, state, guarded)
    _add_tokenizer_routes(app, state, guarded)
    return app


def _lifespan(state: _AppState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: starts the engine; at shutdown cancels what is still open and stops the engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.running_loop.append(asyncio.get_running_loop())
        state.engine.start()
        try:
            yield
        finally:
            state.shutting_down = True
            for timer in state.shutdown_timer:
                timer.cancel()
            # uvicorn has stopped taking connections and waited up to its graceful timeout for the open ones;
            # those it cancelled have not run their cleanup yet (engine.shutdown blocks the loop, as the
            # engine's methods run on its thread): their requests are cancelled here, not left to the grace
            for stream in list(state.in_flight):
                release(stream, state.in_flight)
            state.engine.shutdown(state.shutdown_grace_seconds)
            state.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _authorizer(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The dependency that checks ``Authorization: Bearer <api_key>`` (lets everything through without a key)."""
    key = api_key.encode() if api_key is not None else None

    async def authorize(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise protocol.AuthenticationError(
                "missing or incorrect API key",
                hint="send the header 'Authorization: Bearer <key>' with the server's --api-key",
            )

    return authorize


def _add_info_routes(app: FastAPI, state: _AppState, guarded: list[Any]) -> None:
    """GET /health (open), /metrics and /v1/models[/{id}]."""

    @app.get("/health")
    async def health() -> Response:
        if state.shutting_down:
            body = protocol.error_body("the server is shutting down", "service_unavailable")
            return error_response(503, body)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=guarded)
    async def prometheus_metrics() -> Response:
        content, content_type = state.metrics.render()
        return Response(content, headers={"Content-Type": content_type})

    @app.get("/v1/models", dependencies=guarded)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=guarded)
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return state.model_card()


def check_choice_count(engine: EngineClient, prompts: int, n: int) -> None:
    """RequestError (400) when a request has more choices (``prompts`` x ``n``) than the engine queues
    (``--max-queue``): they are queued together, so it could never be taken, and a 429 would be retried forever."""
    limit = getattr(engine, "max_queue", None)
    choices = prompts * n
    if isinstance(limit, int) and choices > limit:
        shape = f"{prompts} prompts x n {n}" if prompts > 1 and n > 1 else (f"n {n}" if n > 1 else f"{prompts} prompts")
        raise RequestError(
            f"this request has {choices} choices ({shape}), more than --max-queue ({limit}): the server queues "
            f"at most {limit} at once, so it could never take them",
            hint=f"split it into requests of at most {limit} choices, or start the server with --max-queue {choices}",
            param="n" if n > 1 else "prompt",
        )


def _add_generation_routes(app: FastAPI, state: _AppState, guarded: list[Any]) -> None:
    """POST /v1/completions and /v1/chat/completions."""
    engine, model_name, in_flight, off_loop = state.engine, state.model_name, state.in_flight, state.off_loop

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        check_n(engine, body.choices_per_prompt)
        check_choice_count(engine, len(body.prompt), body.choices_per_prompt)
        prompts = [await off_loop(engine.tokenize, p) for p in body.prompt]
        echoes = None
        if body.echo:
            echoes = [p if isinstance(p, str) else await off_loop(engine.detokenize, p) for p in body.prompt]
        request_id, created = protocol.new_request_id("cmpl"), protocol.now()
        params = body.sampling_params()
        await state.compile_grammar(body.structured_output())
        choices = Choices.submit(engine, request_id, prompts, params, body.choices_per_prompt, echoes)
        in_flight.add(choices)
        return await respond(
            request,
            choices,
            in_flight,
            body.stream,
            lambda: completion_events(engine, choices, model_name, created, body.include_usage),
            lambda: completion_body(engine, choices, model_name, created),
        )

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        state.check_model(body.model)
        check_n(engine, body.choices_per_prompt)
        check_choice_count(engine, 1, body.choices_per_prompt)
        plan = body.tool_plan()
        structured = await state.compile_grammar(body.structured_for(plan))
        prompt_ids = await off_loop(engine.tokenize_chat, body.template_messages(), plan.template_tools)
        params = body.sampling_params(len(prompt_ids), engine.max_model_len, structured)
        request_id, created = protocol.new_request_id("chatcmpl"), protocol.now()
        choices = Choices.submit(engine, request_id, [prompt_ids], params, body.choices_per_prompt)
        in_flight.add(choices)
        return await respond(
            request,
            choices,
            in_flight,
            body.stream,
            lambda: tool_chat_events(engine, choices, model_name, created, body.include_usage, plan),
            lambda: tool_chat_body(engine, choices, model_name, created, plan),
        )


def _add_tokenizer_routes(app: FastAPI, state: _AppState, guarded: list[Any]) -> None:
    """vLLM's POST /tokenize, POST /detokenize and GET /tokenizer_info (squeeze.serve.http.tokenization)."""
    engine = state.engine

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        return await state.off_loop(tokenization.tokenize, engine, body)

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        return await state.off_loop(tokenization.detokenize, engine, body)

    @app.get("/tokenizer_info", dependencies=guarded)
    async def tokenizer_info() -> dict[str, Any]:
        return engine.tokenizer_info()


__all__ = ["create_app"]
