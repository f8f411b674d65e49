"""The values of OpenAI request fields that need more than a type to check (squeeze.serve.http.request_schema's):
``prompt`` in its four shapes, a message's content as text parts, numbers that must be finite, and strings that
must be valid Unicode. Each raises ValueError (pydantic names the field) or RequestError (the body as a whole)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BeforeValidator

from squeeze.serve.types import RequestError


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _prompts(value: object) -> object:
    """OpenAI's ``prompt``: a string, token ids, or a batch of either, as a list of prompts (one choice each)."""
    if isinstance(value, str) or not isinstance(value, list):
        return [value] if isinstance(value, str) else value  # a non-list fails the type check, naming the field
    if not value:
        raise ValueError("the prompt is empty")
    if _is_token_ids(value):
        return [value]
    if all(isinstance(p, str) for p in value) or all(_is_token_ids(p) for p in value):
        for i, p in enumerate(value):
            if p == []:
                raise ValueError(f"prompt {i} is an empty list of token ids")
        return value
    raise ValueError("must be a string, a list of token ids, or a list of strings or of token-id lists")


def _text_content(value: object) -> object:
    """A message's content as one string: a list of ``{"type": "text", "text": ...}`` parts is joined with
    newlines; other part types (images, audio) are refused."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"only text content parts are supported, found {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def _first_unencodable(value: object, where: str) -> str | None:
    """The dotted path of the first string in ``value`` that UTF-8 cannot encode (a lone surrogate such as
    ``"\\ud800"``, valid JSON), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _first_unencodable(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def refuse_unencodable(data: Any) -> Any:
    """``data`` (a request body as parsed), or a 400 naming the field for a string that is not valid Unicode (a
    lone surrogate): it would fail in the tokenizer or when the response echoes it, as a 500. Raised as a
    RequestError, which pydantic lets through, so that the message does not repeat the string."""
    where = _first_unencodable(data, "")
    if where is not None:
        raise RequestError(
            f"{where}: the text holds a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode",
            hint="send text that encodes as UTF-8",
            param=where,
        )
    return data


def finite(value: object) -> object:
    """Refuse NaN and infinities (Python's JSON reads ``NaN``), which would otherwise fail a bound check with a
    misleading message ("should be <= 2")."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a number, found {value}")
    return value


Prompts = Annotated[list[str | list[int]], BeforeValidator(_prompts)]
TextContent = Annotated[str, BeforeValidator(_text_content)]


__all__ = ["Prompts", "TextContent", "finite", "refuse_unencodable"]
