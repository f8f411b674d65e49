"""The OpenAI request schemas of ``squeeze serve``: /v1/completions and /v1/chat/completions (pydantic), and
their conversion to :class:`~squeeze.serve.types.SamplingParams` (the responses are squeeze.serve.protocol).

Requests: fields this server does not know are ignored (OpenAI clients send ``user``, ``metadata``, penalties
...), but the known ones are checked strictly (``"0.5"`` is not a float), so a mistyped field is a 400 that
names it. Fields that would change the response's shape or meaning and are not implemented (``best_of``
other than ``n``, ``suffix``, ``tools``, a JSON ``response_format``, ``echo`` with ``stream``) are refused
rather than ignored. Defaults are OpenAI's: temperature 1.0, top_p 1.0, max_tokens 16 for completions and the
rest of the context for chat.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from squeeze.serve.logprobs import MAX_LOGPROBS
from squeeze.serve.types import RequestError, SamplingParams

#: OpenAI's defaults for the sampling fields.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
#: /v1/completions' default ``max_tokens`` (OpenAI's); chat defaults to the rest of the context.
DEFAULT_COMPLETION_TOKENS = 16
#: OpenAI accepts up to 4 stop sequences.
MAX_STOP_STRINGS = 4
#: The most choices per prompt (``n``).
MAX_N = 16
#: Seeds are int64 in OpenAI's API.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


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


def _finite(value: object) -> object:
    """Refuse NaN and infinities (Python's JSON reads ``NaN``), which would otherwise fail a bound check with a
    misleading message ("should be <= 2")."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a number, found {value}")
    return value


Prompts = Annotated[list[str | list[int]], BeforeValidator(_prompts)]
TextContent = Annotated[str, BeforeValidator(_text_content)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The fields both endpoints share."""

    # unknown fields: ignored (clients send more than this server uses); known ones: no type coercion
    model_config = ConfigDict(extra="ignore", strict=True)

    #: None: the served model.
    model: str | None = None
    temperature: Annotated[float | None, BeforeValidator(_finite)] = Field(default=None, ge=0.0, le=2.0)
    top_p: Annotated[float | None, BeforeValidator(_finite)] = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: Choices per prompt, sampled with seeds ``seed``, ``seed + 1``, ... (when ``seed`` is given).
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    #: vLLM's extension: generate past end-of-sequence tokens (benchmarks use it to fix output lengths).
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data: Any) -> Any:
        return refuse_unencodable(data)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences, found {len(strings)}")
        if any(s == "" for s in strings):
            raise ValueError("stop sequences must not be empty")
        return stop

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    def _sampling_params(
        self, max_tokens: int, logprobs: int | None = None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=DEFAULT_TOP_P if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


def _refuse(value: object, name: str, what: str) -> None:
    raise ValueError(f"{name} is not supported by this server ({what}), found {value!r}")


class CompletionRequest(_GenerationRequest):
    """A POST /v1/completions body: one choice per prompt (``n`` per prompt), ``index`` in prompt order."""

    prompt: Prompts
    #: The prompt comes back first in each choice's text (and its tokens first in ``logprobs``).
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    #: 0 only with ``echo``: the prompt is scored, nothing generated.
    max_tokens: int | None = Field(default=None, ge=0)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _echo_not_streamed(cls, echo: bool | None, info: ValidationInfo) -> bool | None:
        if echo and info.data.get("stream"):
            raise ValueError("echo is not supported with stream: send stream false to get the prompt back")
        return echo

    @field_validator("max_tokens")
    @classmethod
    def _zero_needs_echo(cls, max_tokens: int | None, info: ValidationInfo) -> int | None:
        if max_tokens == 0 and not info.data.get("echo"):
            raise ValueError("must be greater than or equal to 1 (0 only with echo: score the prompt)")
        return max_tokens

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if best_of is not None and best_of != n:
            _refuse(best_of, "best_of", f"only best_of equal to n ({n}): every candidate is returned")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            _refuse(suffix, "suffix", "no fill-in-the-middle")
        return suffix

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters: ``max_tokens`` defaults to 16 (OpenAI's default); with ``echo`` and
        ``logprobs`` the prompt's log-probabilities too."""
        max_tokens = DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, self.logprobs if self.echo else None)


class ChatMessage(BaseModel):
    """One turn: ``content`` is a string or a list of text parts (joined with newlines)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: TextContent


class ChatRequest(_GenerationRequest):
    """A POST /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, tools: list[Any] | None) -> list[Any] | None:
        if tools:
            raise ValueError("tool and function calling are not supported by this server")
        return tools

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        if fmt is not None and fmt.get("type", "text") != "text":
            _refuse(fmt.get("type"), "response_format", "text only")
        return fmt

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them; OpenAI's "developer" role is the templates' "system"."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in self.messages]

    def sampling_params(self, prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """The engine's parameters: ``max_completion_tokens`` (else the older ``max_tokens``) or, when neither
        is given, the rest of the context; RequestError when the prompt leaves no room for a token."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - prompt_tokens
            if max_tokens < 1:
                raise RequestError(
                    f"the conversation is {prompt_tokens} tokens long, which leaves no room for a reply in "
                    f"the context of {max_model_len} tokens",
                    hint="shorten the messages",
                    param="messages",
                )
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


__all__ = [
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "DEFAULT_COMPLETION_TOKENS",
    "MAX_STOP_STRINGS",
    "StreamOptions",
    "CompletionRequest",
    "ChatMessage",
    "ChatRequest",
    "refuse_unencodable",
]
