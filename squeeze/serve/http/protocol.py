"""The OpenAI wire format of ``squeeze serve``'s answers: the response, streaming chunk and error objects, and
the refusals OpenAI names with a ``code``. The request schemas are squeeze.serve.http.request_schema.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from squeeze.serve.types import EngineStoppedError, RequestError, RequestOutput

DONE_EVENT = b"data: [DONE]\n\n"


class ApiError(RequestError):
    """A refused request with an OpenAI error ``code`` as well (``model_not_found``, ``invalid_api_key``)."""

    code: str | None = None


class AuthenticationError(ApiError):
    """No or a wrong ``Authorization: Bearer`` key: HTTP 401."""

    status = 401
    code = "invalid_api_key"


class ModelNotFoundError(ApiError):
    """The request names a model this server does not serve: HTTP 404 (as OpenAI)."""

    status = 404
    code = "model_not_found"


class GenerationError(ApiError):
    """The engine failed on a request (finish_reason "error"): HTTP 500."""

    status = 500
    error_type = "server_error"


# -- responses ----------------------------------------------------------------------------------------------


def new_request_id(prefix: str) -> str:
    """``cmpl-<32 hex>`` / ``chatcmpl-<32 hex>``: unique, and the engine's request id as well."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """OpenAI's ``created``: Unix seconds."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def raise_for_failure(output: RequestOutput) -> None:
    """The engine's finish reasons OpenAI has no word for, as errors: "error" -> GenerationError (500),
    "abort" -> EngineStoppedError (503; only a server shutting down aborts a request someone still reads)."""
    if output.finish_reason == "error":
        raise GenerationError(f"generation failed: {output.error or 'the engine gave no reason'}")
    if output.finish_reason == "abort":
        raise EngineStoppedError("the request was cancelled before it finished: the server is shutting down")


def completion_chunk(
    request_id: str, model: str, created: int, text: str, finish_reason: str | None, *, include_usage: bool
) -> dict[str, Any]:
    """One streamed ``text_completion`` piece (OpenAI streams completions under the same object name)."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None  # as OpenAI: every chunk has the key, only the last (usage) chunk fills it
    return chunk


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, str],
    finish_reason: str | None,
    *,
    include_usage: bool,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``: ``delta`` is ``{"role": "assistant", "content": ""}`` first, then
    ``{"content": piece}``, and ``{}`` beside the finish reason."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(obj: str, request_id: str, model: str, created: int, output: RequestOutput) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: no choices, the request's token counts."""
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(output.prompt_tokens, output.completion_tokens),
    }


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def request_error_body(exc: RequestError) -> dict[str, Any]:
    """The error object of a refused request (its hint, if any, appended to the message)."""
    message = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
    return error_body(message, exc.error_type, exc.param, getattr(exc, "code", None))


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


__all__ = [
    "DONE_EVENT",
    "ApiError",
    "AuthenticationError",
    "ModelNotFoundError",
    "GenerationError",
    "new_request_id",
    "now",
    "usage",
    "raise_for_failure",
    "completion_chunk",
    "chat_chunk",
    "usage_chunk",
    "error_body",
    "request_error_body",
    "sse",
]
