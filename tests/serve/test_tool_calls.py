"""Tool calls: replies parsed in the Hermes and bare-JSON formats, streamed as OpenAI streams them (the same
calls as the whole body), ``required`` and named choices constrained by the grammar, the tool turns of a
conversation rendered by the chat template, and the official openai client's round trip on the tiny Llama with a
Hermes-style template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from fake_engine import serving
from tiny_engine import make_engine, tiny_model

from squeeze.serve.http.app import create_app, protocol
from squeeze.serve.http.request_schema import ChatRequest
from squeeze.serve.http.tool_calls import ParsedCall, ParsedReply, _ToolStream, parse_reply
from squeeze.serve.http.tool_schema import ToolDefinition, ToolPlan, tool_plan
from squeeze.serve.types import RequestError

pytest.importorskip("xgrammar")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}}}},
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
#: A Hermes-style template (as Qwen 2.5's and NousResearch's): tools listed in a system turn, calls written as
#: <tool_call>{json}</tool_call>, tool results as <tool_response>.
HERMES_TEMPLATE = (
    "{%- if tools %}<|system|> Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|> "
    "{%- for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}\n"
    "{%- elif m.role == 'tool' %}<|tool|> <tool_response>{{ m.content }}</tool_response>\n"
    "{%- else %}<|{{ m.role }}|> {{ m.content }}\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def plan(mode: str = "auto", named: str | None = None) -> ToolPlan:
    tools = tuple(ToolDefinition.model_validate(t) for t in TOOLS)
    return ToolPlan(mode, tools, named=named)  # type: ignore[arg-type]


WEATHER_ARGS = '{"city": "Oslo", "unit": "c"}'


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (f'<tool_call>{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}</tool_call>', (None, [WEATHER_ARGS])),
        (
            f'Let me look. <tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}',  # the last one unclosed: the model stopped there
            ("Let me look. ", [WEATHER_ARGS, "{}"]),
        ),
        (f' {{"name": "get_weather", "parameters": {WEATHER_ARGS}}}', (None, [WEATHER_ARGS])),  # Llama 3.x
        (f'<|python_tag|>[{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}]', (None, [WEATHER_ARGS])),
        ('{"name": "get_weather", "arguments": "{\\"city\\": 1}"}', (None, ['{"city": 1}'])),  # arguments as text
        ('{"name": "launch_rocket", "arguments": {}}', ('{"name": "launch_rocket", "arguments": {}}', [])),
        ('<tool_call>{"name": "get_weather", "arguments": {</tool_call>', None),  # broken JSON: content
        ("The weather is fine {mostly}.", None),
    ],
)
def test_auto_replies_parse_in_the_hermes_and_bare_json_formats(reply: str, expected: Any) -> None:
    parsed = parse_reply(reply, plan())
    if expected is None:
        assert parsed == ParsedReply(reply)
        return
    content, arguments = expected
    assert parsed.content == content
    assert [json.loads(c.arguments) for c in parsed.calls] == [json.loads(a) for a in arguments]


def test_required_and_named_replies_parse_by_construction() -> None:
    required = parse_reply(f'[{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}]', plan("required"))
    assert required == ParsedReply(None, (ParsedCall("get_weather", WEATHER_ARGS),))
    assert parse_reply(WEATHER_ARGS, plan("named", "get_weather")) == ParsedReply(
        None, (ParsedCall("get_weather", WEATHER_ARGS),)
    )
    assert parse_reply("hello", plan("none")) == ParsedReply("hello")
    tools = plan().tools
    one = ToolPlan("required", tools, parallel=False).structured()
    many = ToolPlan("required", tools).structured()
    assert one is not None and many is not None
    assert json.loads(one.spec)["maxItems"] == 1 and "maxItems" not in json.loads(many.spec)
    assert [c["properties"]["name"] for c in json.loads(many.spec)["items"]["anyOf"]] == [
        {"const": "get_weather"},
        {"const": "get_time"},
    ]
    named = ToolPlan("named", tools, named="get_time").structured()
    assert named is not None and json.loads(named.spec) == SCHEMAS["get_time"]


def _stream(reply: str, the_plan: ToolPlan, piece: int) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """Feed ``reply`` to the tool stream ``piece`` characters at a time as chat chunks; what a client
    reassembles: the content, the calls (name, arguments), the finish reason."""
    stream = _ToolStream(the_plan)
    template = protocol.chat_chunk("id", "m", 0, {}, None, include_usage=False)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**template, "choices": [{**template["choices"][0], "delta": delta, "finish_reason": finish}]}

    events = stream.rewrite(chunk({"role": "assistant", "content": ""}))
    for at in range(0, len(reply), piece):
        events += stream.rewrite(chunk({"content": reply[at : at + piece]}))
    events += stream.rewrite(chunk({}, "stop"))
    content, calls, finish = None, {}, None
    for event in events:
        choice = json.loads(event[len(b"data: ") :])["choices"][0]
        delta = choice["delta"]
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["id"].startswith("call_") and call["type"] == "function"
                calls[call["index"]] = [call["function"]["name"], call["function"]["arguments"]]
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


@pytest.mark.parametrize(
    ("reply", "mode"),
    [
        (f'Sure. <tool_call>{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}</tool_call>', "auto"),
        (f'  {{"name": "get_weather", "parameters": {WEATHER_ARGS}}}', "auto"),
        ("a < b and <tool but no call", "auto"),
        ('{"not": "a call"}', "auto"),
        (
            f'[{{"name": "get_time", "parameters": {{}}}}, {{"name": "get_weather", "parameters": {WEATHER_ARGS}}}]',
            "required",
        ),
        (WEATHER_ARGS, "named"),
    ],
)
def test_a_streamed_reply_gives_what_the_whole_body_gives(reply: str, mode: str) -> None:
    the_plan = plan(mode, "get_weather" if mode == "named" else None)
    parsed = parse_reply(reply, the_plan)
    whole = (parsed.content, [(c.name, c.arguments) for c in parsed.calls], "tool_calls" if parsed.calls else "stop")
    for piece in (1, 3, 7, len(reply)):
        assert _stream(reply, the_plan, piece) == whole


def test_tool_choice_is_checked() -> None:
    tools = [ToolDefinition.model_validate(t) for t in TOOLS]
    with pytest.raises(RequestError, match="not among the tools") as unknown:
        tool_plan(tools, {"type": "function", "function": {"name": "nope"}}, None)
    assert unknown.value.param == "tool_choice"
    with pytest.raises(RequestError, match="needs tools"):
        tool_plan(None, "required", None)
    with pytest.raises(RequestError, match="distinct"):
        tool_plan(tools + tools[:1], "auto", None)
    with pytest.raises(RequestError, match="must be 'none', 'auto'"):
        tool_plan(tools, "always", None)
    assert tool_plan(tools, "none", None).template_tools is None  # the model is not told about them
    request = ChatRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        }
    )
    with pytest.raises(RequestError, match="both constrain"):
        request.tool_plan()


# -- through the openai client -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hermes(tiny_text: str) -> tuple[Any, Any]:
    return tiny_model(tiny_text, HERMES_TEMPLATE)


@pytest.fixture
def hermes_client(hermes: tuple[Any, Any]) -> Iterator[openai.OpenAI]:
    with serving(create_app(make_engine(hermes), shutdown_grace_seconds=1.0)) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def _streamed_calls(stream: Any) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    calls[call.index] = [call.function.name, call.function.arguments or ""]
                else:
                    calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(calls[i][0], calls[i][1]) for i in sorted(calls)], finish


def test_forced_tool_calls_round_trip_with_the_openai_client(hermes_client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for temperature in (0.0, 1.0):
            options = {"tools": TOOLS, "tool_choice": choice, "temperature": temperature, "seed": 5, "max_tokens": 150}
            reply = hermes_client.chat.completions.create(model="tiny", messages=messages, **options)
            message = reply.choices[0].message
            assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            if isinstance(choice, dict):
                assert [name for name, _ in calls] == ["get_weather"]
            stream = hermes_client.chat.completions.create(model="tiny", messages=messages, stream=True, **options)
            assert _streamed_calls(stream) == (calls, "tool_calls")

    # the round trip: the assistant's call and the tool's answer go back through the template
    call = message.tool_calls[0]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = hermes_client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    options = {"tools": TOOLS, "max_tokens": 12, "temperature": 0}
    auto = hermes_client.chat.completions.create(model="tiny", messages=messages, **options)
    content = auto.choices[0].message.content
    assert content and not auto.choices[0].message.tool_calls  # the tiny model writes no call: plain content
    pieces = []
    for chunk in hermes_client.chat.completions.create(model="tiny", messages=messages, stream=True, **options):
        pieces += [c.delta.content or "" for c in chunk.choices]
        assert not any(c.delta.tool_calls for c in chunk.choices)
    assert "".join(pieces) == content


def test_tool_turns_reach_the_template(hermes: tuple[Any, Any]) -> None:
    engine = make_engine(hermes)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}
    request = ChatRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": TOOLS,
        }
    )
    ids = engine.tokenize_chat(request.template_messages(), request.tool_plan().template_tools)
    text = hermes[1].decode(ids)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' in text  # arguments as an object
    assert "<tool_response>sunny</tool_response>" in text and '"name": "get_time"' in text


def test_a_template_without_tools_is_a_400(tiny_text: str) -> None:
    with serving(create_app(make_engine(tiny_model(tiny_text)), shutdown_grace_seconds=1.0)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError, match="does not render tools") as bad:
            client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        assert bad.value.body["param"] == "tools"
        plain = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=TOOLS,
            tool_choice="none",  # type: ignore[arg-type]
            max_tokens=4,
        )
        assert plain.choices[0].message.tool_calls is None
