"""The OpenAI request schemas of ``squeeze serve``: /v1/completions and /v1/chat/completions (pydantic), and
their conversion to :class:`~squeeze.serve.types.SamplingParams` (the responses are squeeze.serve.http.protocol).

Requests: fields this server does not know are ignored (OpenAI clients send ``user``, ``metadata``, penalties
...), but the known ones are checked strictly (``"0.5"`` is not a float), so a mistyped field is a 400 that
names it. Fields that would change the response's shape or meaning and are not implemented (``best_of``
other than ``n``, ``suffix``, the legacy ``functions``, ``echo`` with ``stream``) are refused rather than
ignored. Structured output (``response_format``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice``)
becomes the parameters' :class:`StructuredOutput`; tools are squeeze.serve.http.tool_schema's. Defaults are
OpenAI's: temperature 1.0, top_p 1.0, max_tokens 16 for completions and the rest of the context for chat.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from squeeze.serve.engine.grammar import JSON_OBJECT_SCHEMA
from squeeze.serve.http.request_fields import Prompts, TextContent, finite, refuse_unencodable
from squeeze.serve.http.tool_schema import ToolCall, ToolDefinition, ToolPlan, tool_plan
from squeeze.serve.logprobs import MAX_LOGPROBS
from squeeze.serve.types import RequestError, SamplingParams, StructuredOutput

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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The fields both endpoints share."""

    # unknown fields: ignored (clients send more than this server uses); known ones: no type coercion
    model_config = ConfigDict(extra="ignore", strict=True)

    #: None: the served model.
    model: str | None = None
    temperature: Annotated[float | None, BeforeValidator(finite)] = Field(default=None, ge=0.0, le=2.0)
    top_p: Annotated[float | None, BeforeValidator(finite)] = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: Choices per prompt, sampled with seeds ``seed``, ``seed + 1``, ... (when ``seed`` is given).
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    #: vLLM's extension: generate past end-of-sequence tokens (benchmarks use it to fix output lengths).
    ignore_eos: bool = False
    #: OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}``.
    response_format: dict[str, Any] | None = None
    #: vLLM's structured-output extras: a JSON schema, a regular expression, one of a list of strings.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)

    @field_validator("response_format")
    @classmethod
    def _check_format(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        if fmt is None:
            return fmt
        kind = fmt.get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', found {kind!r}")
        if kind == "json_schema":
            inner = fmt.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
                raise ValueError("type 'json_schema' needs json_schema.schema, a JSON schema object")
        return fmt

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The grammar the output must match and the field that gave it, or None; RequestError when two
        fields ask for one."""
        found: list[tuple[StructuredOutput, str]] = []
        fmt = self.response_format or {}
        if fmt.get("type") == "json_object":
            found.append((StructuredOutput("json_schema", JSON_OBJECT_SCHEMA), "response_format"))
        elif fmt.get("type") == "json_schema":
            schema = json.dumps(fmt["json_schema"]["schema"])
            found.append((StructuredOutput("json_schema", schema), "response_format"))
        if self.guided_json is not None:
            text = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            found.append((StructuredOutput("json_schema", text), "guided_json"))
        if self.guided_regex is not None:
            found.append((StructuredOutput("regex", self.guided_regex), "guided_regex"))
        if self.guided_choice is not None:
            found.append((StructuredOutput("choice", json.dumps(self.guided_choice)), "guided_choice"))
        if len(found) > 1:
            raise RequestError(
                f"{found[0][1]} and {found[1][1]} both constrain the output: send one of them",
                param=found[1][1],
            )
        return found[0] if found else None

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
        self,
        max_tokens: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
        if structured is None:
            found = self.structured_output()
            structured = found[0] if found is not None else None
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=DEFAULT_TOP_P if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
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
    """One turn: ``content`` is a string or a list of text parts (joined with newlines); an assistant turn may
    instead carry the ``tool_calls`` it made, and a ``tool`` turn answers one (``tool_call_id``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: TextContent | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check_turn(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, found role {self.role!r}")
        return self

    def template_entry(self) -> dict[str, Any]:
        """The message as chat templates take it (OpenAI's "developer" role is the templates' "system")."""
        entry: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        entry["content"] = self.content if self.content is not None else ""
        if self.tool_calls:
            entry["tool_calls"] = [call.template_entry() for call in self.tool_calls]
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":  # the function answered (some templates show it)
            entry["name"] = self.name
        return entry


class ChatRequest(_GenerationRequest):
    """A POST /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, functions: list[Any] | None) -> list[Any] | None:
        if functions:
            raise ValueError("functions (the legacy form of tools) is not supported by this server: send tools")
        return functions

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them."""
        return [m.template_entry() for m in self.messages]

    def tool_plan(self) -> ToolPlan:
        """What the request's tools mean (squeeze.serve.http.tool_schema); RequestError for a ``required`` or named
        choice beside a structured-output field (both would constrain the reply)."""
        plan = tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        found = self.structured_output()
        if found is not None and plan.structured() is not None:
            raise RequestError(
                f"tool_choice {plan.mode} and {found[1]} both constrain the reply: send one of them",
                param="tool_choice",
            )
        return plan

    def structured_for(self, plan: ToolPlan) -> tuple[StructuredOutput, str] | None:
        """The grammar of the reply: a ``required`` or named tool choice's, else the structured-output field's."""
        forced = plan.structured()
        return (forced, "tool_choice") if forced is not None else self.structured_output()

    def sampling_params(
        self, prompt_tokens: int, max_model_len: int, structured: StructuredOutput | None = None
    ) -> SamplingParams:
        """The engine's parameters: ``max_completion_tokens`` (else the older ``max_tokens``) or, when neither
        is given, the rest of the context; RequestError when the prompt leaves no room for a token.
        ``structured``: the reply's grammar when a tool choice gives it (else the request's fields')."""
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
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, None, structured)


__all__ = [
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "DEFAULT_COMPLETION_TOKENS",
    "MAX_STOP_STRINGS",
    "StreamOptions",
    "CompletionRequest",
    "ChatMessage",
    "ChatRequest",
]
