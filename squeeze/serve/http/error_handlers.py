"""The OpenAI-shaped errors of ``squeeze serve``'s app: every refusal, schema violation, malformed JSON body,
unknown route and unexpected failure becomes ``{"error": {"message", "type", "param", "code"}}`` (a schema
violation is 400, not FastAPI's 422)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from squeeze.serve.http import protocol
from squeeze.serve.types import QueueFullError, RequestError


def error_response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """One line naming the first offending field (``temperature: Input should be less than or equal to 2``)
    and that field as OpenAI's ``param``."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON: {reason}".rstrip(": "), None
    if not loc:
        if kind == "missing":
            return "the request body is missing: send a JSON object", None
        return "the request body must be a JSON object (with Content-Type: application/json)", None
    param = ".".join(loc)
    if kind == "value_error":
        message = str(first.get("ctx", {}).get("error", first.get("msg", "")))
    else:
        message = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{param}: {message}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    async def on_request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)  # registered for RequestError only
        headers = {}
        if isinstance(exc, QueueFullError):
            headers["Retry-After"] = str(exc.retry_after)
        if isinstance(exc, protocol.AuthenticationError):
            headers["WWW-Authenticate"] = "Bearer"
        return error_response(exc.status, protocol.request_error_body(exc), headers)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, protocol.error_body(message, "invalid_request_error", param))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"Invalid URL ({where})"
        elif exc.status_code == 405:
            message = f"method not allowed: {where}"
        else:
            message = str(exc.detail)
        body = protocol.error_body(message, "invalid_request_error")
        return error_response(exc.status_code, body, dict(exc.headers or {}))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises the exception once this response is sent, and the server logs its traceback
        body = protocol.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error")
        return error_response(500, body)

    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


__all__ = ["error_response", "install_error_handlers"]
