"""The tokenizer endpoints in vLLM's shapes: POST /tokenize, POST /detokenize, GET /tokenizer_info.

lm-evaluation-harness's ``tokenizer_backend=remote`` reads the served model's tokenizer through them (and a
client counts tokens without loading one). /tokenize takes a ``prompt`` (``add_special_tokens``, default
true) or chat ``messages`` (the chat template with the generation prompt) and answers ``count``,
``max_model_len``, ``tokens`` and, with ``return_token_strs``, ``token_strs``; /detokenize takes ``tokens``
and answers ``prompt``. A text longer than the context is refused (400) rather than tokenized past it, and so is
text that is not valid Unicode (a lone surrogate, as the generation endpoints refuse it).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from squeeze.serve.http.request_fields import refuse_unencodable
from squeeze.serve.http.request_schema import ChatMessage
from squeeze.serve.types import EngineClient, RequestError

#: A text of more characters than this many per token of context is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 64


class TokenizeRequest(BaseModel):
    """A POST /tokenize body: ``prompt`` or ``messages``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data: Any) -> Any:
        # refused as /v1/completions and chat refuse it (the tokenizer cannot read it: it was a 500), not
        # tokenized with the surrogate replaced: /tokenize counts what those endpoints would take
        return refuse_unencodable(data)


class DetokenizeRequest(BaseModel):
    """A POST /detokenize body."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


def tokenize(engine: EngineClient, body: TokenizeRequest) -> dict[str, Any]:
    """The /tokenize response (RequestError for a text beyond the context)."""
    limit = engine.max_model_len
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("send either prompt (a string) or messages", param="prompt")
    if body.messages is not None:
        if not body.add_generation_prompt:
            raise RequestError(
                "add_generation_prompt false is not supported: the chat template is applied with the generation "
                "prompt, as /v1/chat/completions applies it",
                param="add_generation_prompt",
            )
        roles = {"developer": "system"}
        ids = engine.tokenize_chat([{"role": roles.get(m.role, m.role), "content": m.content} for m in body.messages])
    else:
        text = body.prompt or ""
        if len(text) > MAX_CHARS_PER_TOKEN * limit:
            raise RequestError(
                f"the prompt is {len(text)} characters long, far more than the context of {limit} tokens holds",
                param="prompt",
            )
        ids = engine.tokenize(text, add_special_tokens=body.add_special_tokens) if text else []
    if len(ids) > limit:
        raise RequestError(f"the prompt is {len(ids)} tokens, more than the context of {limit} tokens", param="prompt")
    return {
        "count": len(ids),
        "max_model_len": limit,
        "tokens": ids,
        "token_strs": engine.token_strings(ids) if body.return_token_strs else None,
    }


def detokenize(engine: EngineClient, body: DetokenizeRequest) -> dict[str, Any]:
    """The /detokenize response (RequestError naming an id outside the vocabulary)."""
    return {"prompt": engine.detokenize(body.tokens)}


__all__ = ["TokenizeRequest", "DetokenizeRequest", "tokenize", "detokenize", "MAX_CHARS_PER_TOKEN"]
