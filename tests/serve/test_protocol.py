"""The OpenAI request schemas (defaults, ranges, strict types, refused features) and the response builders."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from squeeze.serve.http import protocol
from squeeze.serve.http.request_schema import ChatRequest, CompletionRequest
from squeeze.serve.types import EngineStoppedError, QueueFullError, RequestError, RequestOutput, SamplingParams


def problem(model: type, body: dict[str, Any]) -> tuple[str, str]:
    """(field, message) of the first validation error ``body`` raises."""
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    first = caught.value.errors()[0]
    return ".".join(str(p) for p in first["loc"]), first["msg"]


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def test_completion_defaults_are_openais() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": "hello"})
    assert request.sampling_params() == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, seed=None, stop=())
    assert not request.stream and not request.include_usage
    nulls = {"prompt": "x", "max_tokens": None, "temperature": None, "top_p": None, "stop": None, "n": None}
    assert CompletionRequest.model_validate(nulls).sampling_params() == request.sampling_params()


def test_completion_fields_convert() -> None:
    body = {"prompt": [3, 4], "max_tokens": 5, "temperature": 0, "top_p": 0.9, "seed": -3, "stop": "\n"}
    assert CompletionRequest.model_validate(body).sampling_params() == SamplingParams(5, 0.0, 0.9, -3, ("\n",))
    no_eos = ChatRequest.model_validate(chat(ignore_eos=True, max_tokens=4)).sampling_params(2, 10)
    assert no_eos == SamplingParams(4, 1.0, 1.0, None, (), ignore_eos=True)
    stops = CompletionRequest.model_validate({"prompt": "x", "stop": ["a", "b", "c", "d"]})
    assert stops.stop_strings() == ("a", "b", "c", "d")
    streamed = CompletionRequest.model_validate(
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    )
    assert streamed.include_usage


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", ["text"]),
        ([1, 2], [[1, 2]]),
        (["one"], ["one"]),
        ([[7, 8]], [[7, 8]]),
        ("", [""]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == expected


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "the prompt is empty"),
        ([[1], []], "prompt 1 is an empty list of token ids"),
        (["a", [1]], "must be a string, a list of token ids"),
        ([1, "a"], "must be a string, a list of token ids"),
        ([True], "must be a string, a list of token ids"),
        (5, "valid list"),
        (None, "valid list"),
    ],
)
def test_bad_prompts_name_the_field(prompt: Any, message: str) -> None:
    field, text = problem(CompletionRequest, {"prompt": prompt})
    assert field.split(".")[0] == "prompt" and message in text


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"temperature": 2.01}, "temperature", "less than or equal to 2"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1 (0 only with echo"),
        ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"n": 17}, "n", "less than or equal to 16"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop sequences, found 5"),
        ({"stop": ""}, "stop", "must not be empty"),
        ({"seed": 2**64}, "seed", "less than or equal to"),
        # strict types: no quietly coerced strings, floats or booleans
        ({"temperature": "0.5"}, "temperature", "valid number"),
        ({"max_tokens": 1.5}, "max_tokens", "valid integer"),
        ({"max_tokens": True}, "max_tokens", "valid integer"),
        ({"stream": "yes"}, "stream", "valid boolean"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "valid boolean"),
        # features that would change the answer are refused, not ignored
        ({"echo": True, "stream": True}, "echo", "echo is not supported with stream"),
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ({"logprobs": 1.5}, "logprobs", "valid integer"),
        ({"logprobs": True}, "logprobs", "valid integer"),
        ({"best_of": 3}, "best_of", "best_of is not supported"),
        ({"n": 2, "best_of": 3}, "best_of", "only best_of equal to n (2)"),
        ({"suffix": "end"}, "suffix", "suffix is not supported"),
    ],
)
def test_completion_field_checks(fields: dict[str, Any], field: str, message: str) -> None:
    found_field, text = problem(CompletionRequest, {"prompt": "x", **fields})
    assert found_field == field and message in text, (found_field, text)


def test_logprob_fields_convert() -> None:
    scored = CompletionRequest.model_validate({"prompt": [1, 2], "echo": True, "logprobs": 1, "max_tokens": 0})
    assert scored.sampling_params() == SamplingParams(0, 1.0, 1.0, None, (), logprobs=1, prompt_logprobs=1)
    plain = CompletionRequest.model_validate({"prompt": "x", "logprobs": 0, "n": 3, "best_of": 3})
    assert plain.sampling_params().logprobs == 0 and plain.sampling_params().prompt_logprobs is None
    assert plain.choices_per_prompt == 3
    echoed = CompletionRequest.model_validate({"prompt": "x", "echo": True})
    assert echoed.sampling_params().prompt_logprobs is None  # the prompt's text, not its log-probabilities
    top = ChatRequest.model_validate(chat(logprobs=True, top_logprobs=5)).sampling_params(2, 10)
    assert top.logprobs == 5 and top.prompt_logprobs is None
    assert ChatRequest.model_validate(chat(logprobs=True)).sampling_params(2, 10).logprobs == 0
    assert ChatRequest.model_validate(chat(logprobs=False)).sampling_params(2, 10).logprobs is None


def test_limits_and_unknown_fields_are_accepted() -> None:
    body = {
        "prompt": "x",
        "temperature": 2,  # an int for a float field is fine
        "top_p": 1,
        "n": 1,
        "echo": False,
        "best_of": 1,
        "user": "someone",
        "presence_penalty": 0.5,
        "metadata": {"a": 1},
    }
    request = CompletionRequest.model_validate(body)
    assert request.temperature == 2.0 and not hasattr(request, "user")


def test_chat_messages() -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "system", "content": "more", "name": "ignored"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
    ]
    request = ChatRequest.model_validate({"messages": messages})
    assert request.template_messages() == [
        {"role": "system", "content": "rules"},
        {"role": "system", "content": "more"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
    ]


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'system', 'developer'"),
        ({"messages": [{"role": "user"}]}, "messages.0", "content is required"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0", "content is required"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
            "only text content parts are supported, found 'image_url'",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content", "string 'text'"),
        ({"messages": "hi"}, "messages", "valid list"),
        ({**chat(), "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
        ({**chat(), "logprobs": 1}, "logprobs", "valid boolean"),
        ({**chat(), "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({**chat(), "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({**chat(), "tools": [{"type": "function"}]}, "tools.0.function", "required"),
        ({**chat(), "functions": [{"name": "f"}]}, "functions", "send tools"),
        ({**chat(), "response_format": {"type": "xml"}}, "response_format", "'text', 'json_object' or 'json_schema'"),
        ({**chat(), "response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
        ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages.0", "content is required"),
        ({**chat(), "n": 17}, "n", "less than or equal to 16"),
    ],
)
def test_chat_field_checks(fields: dict[str, Any], field: str, message: str) -> None:
    found_field, text = problem(ChatRequest, fields)
    assert found_field == field and message in text, (found_field, text)


def test_chat_max_tokens() -> None:
    # no limit given: the rest of the context
    assert ChatRequest.model_validate(chat()).sampling_params(10, 100).max_tokens == 90
    assert ChatRequest.model_validate(chat(max_tokens=5)).sampling_params(10, 100).max_tokens == 5
    both = ChatRequest.model_validate(chat(max_tokens=5, max_completion_tokens=7))
    assert both.sampling_params(10, 100).max_tokens == 7
    plain = ChatRequest.model_validate(chat(response_format={"type": "text"}, tools=[], logprobs=False))
    assert plain.sampling_params(3, 100) == SamplingParams(97, 1.0, 1.0, None, ())
    with pytest.raises(RequestError, match="no room") as full:
        ChatRequest.model_validate(chat()).sampling_params(100, 100)
    assert full.value.param == "messages" and full.value.status == 400


def output(finish: Any = "length", error: str | None = None) -> RequestOutput:
    return RequestOutput("r", "", (), True, finish, prompt_tokens=3, completion_tokens=4, error=error)


def test_request_ids() -> None:
    request_id = protocol.new_request_id("cmpl")
    assert request_id.startswith("cmpl-") and int(request_id[5:], 16) >= 0 and len(request_id) == 37
    assert protocol.new_request_id("cmpl") != request_id


def test_chunks() -> None:
    piece = protocol.completion_chunk("c", "m", 1, " a", None, include_usage=False)
    assert piece["object"] == "text_completion" and "usage" not in piece
    assert piece["choices"] == [{"index": 0, "text": " a", "logprobs": None, "finish_reason": None}]
    assert protocol.completion_chunk("c", "m", 1, "", "stop", include_usage=True)["usage"] is None
    delta = protocol.chat_chunk("c", "m", 1, {"content": "x"}, None, include_usage=False)
    assert delta["object"] == "chat.completion.chunk" and delta["choices"][0]["delta"] == {"content": "x"}
    usage = protocol.usage_chunk("chat.completion.chunk", "c", "m", 1, output())
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    event = protocol.sse({"text": "é\n"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:]) == {"text": "é\n"}
    assert protocol.DONE_EVENT == b"data: [DONE]\n\n"


def test_failures_map_to_errors() -> None:
    protocol.raise_for_failure(output("stop"))
    protocol.raise_for_failure(output("length"))
    with pytest.raises(protocol.GenerationError, match="generation failed: out of memory") as failed:
        protocol.raise_for_failure(output("error", "out of memory"))
    assert failed.value.status == 500 and failed.value.error_type == "server_error"
    with pytest.raises(EngineStoppedError, match="shutting down") as aborted:
        protocol.raise_for_failure(output("abort"))
    assert aborted.value.status == 503


def test_error_bodies() -> None:
    assert protocol.error_body("m", "t") == {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    body = protocol.request_error_body(RequestError("bad", hint="do this", param="stop"))
    assert body["error"] == {"message": "bad (do this)", "type": "invalid_request_error", "param": "stop", "code": None}
    assert protocol.request_error_body(QueueFullError("full"))["error"]["type"] == "rate_limit_error"
    missing = protocol.request_error_body(protocol.ModelNotFoundError("no", param="model"))["error"]
    assert missing["code"] == "model_not_found" and protocol.ModelNotFoundError.status == 404
    assert protocol.AuthenticationError.status == 401
