"""Structured output in the engine and through the official openai client: the tiny random Llama writes
garbage, which the grammar must turn into JSON that validates against the schema (greedy and sampled), through
preemption, without changing an unconstrained request's tokens; a schema that does not compile is a 400."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from fake_engine import FakeEngine, serving
from tiny_engine import make_engine, tiny_model

from squeeze.serve.engine.engine import Engine
from squeeze.serve.http.app import create_app
from squeeze.serve.types import RequestError, RequestOutput, SamplingParams, StructuredOutput

pytest.importorskip("xgrammar")

#: An enum, an integer and a nested object (the issue's schema).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "admin": {"type": "boolean"}},
            "required": ["name", "admin"],
        },
    },
    "required": ["color", "count", "owner"],
}
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps(SCHEMA))
PROMPTS = ["Once upon a time", "the dog ran to the park", "Lily and Tom", "one day she found a big red ball"]


@pytest.fixture(scope="module")
def tiny(tiny_text: str) -> tuple[Any, Any]:
    return tiny_model(tiny_text)


def generate(
    engine: Engine, requests: list[tuple[str, SamplingParams]], *, first_alone: bool = False
) -> list[list[RequestOutput]]:
    """Every request's outputs, submitted together (``first_alone``: the first one finished before the rest)."""

    async def one(i: int, prompt: str, params: SamplingParams) -> list[RequestOutput]:
        return [out async for out in engine.submit(engine.tokenize(prompt), params, f"r{i}")]

    async def main() -> list[list[RequestOutput]]:
        engine.start()
        try:
            first = [await one(0, *requests[0])] if first_alone else []
            rest = enumerate(requests[len(first) :], start=len(first))
            return first + list(await asyncio.gather(*(one(i, p, s) for i, (p, s) in rest)))
        finally:
            engine.shutdown(5)

    return asyncio.run(main())


def text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def test_json_schema_output_validates_greedy_and_sampled(tiny: tuple[Any, Any]) -> None:
    requests = [(p, SamplingParams(max_tokens=120, structured=JSON_SCHEMA)) for p in PROMPTS]
    requests += [
        (p, SamplingParams(120, temperature=1.0, seed=i, structured=JSON_SCHEMA)) for i, p in enumerate(PROMPTS)
    ]
    for outputs in generate(make_engine(tiny), requests):
        assert outputs[-1].finish_reason == "stop"
        jsonschema.validate(json.loads(text(outputs)), SCHEMA)
        assert outputs[-1].token_ids[-1] == 2  # it ended on end-of-sequence, allowed only once the grammar is done


def test_unconstrained_requests_keep_their_tokens_beside_constrained_ones(tiny: tuple[Any, Any]) -> None:
    plain = [(p, SamplingParams(max_tokens=24, temperature=t, seed=3)) for p in PROMPTS for t in (0.0, 0.8)]
    alone = generate(make_engine(tiny), plain)
    constrained = [(p, SamplingParams(max_tokens=60, structured=JSON_SCHEMA)) for p in PROMPTS]
    mixed = generate(make_engine(tiny), [x for pair in zip(plain, constrained * 2, strict=True) for x in pair])
    assert [tokens(o) for o in mixed[0::2]] == [tokens(o) for o in alone]
    assert any(not text(o).startswith("{") for o in alone)  # the model left alone does not write JSON


def test_the_grammar_follows_a_preempted_sequence(tiny: tuple[Any, Any]) -> None:
    requests = [(p, SamplingParams(max_tokens=150, structured=JSON_SCHEMA)) for p in PROMPTS * 2]
    roomy = generate(make_engine(tiny, max_model_len=256), requests)
    block_bytes = make_engine(tiny, max_model_len=256).pool.block_bytes
    engine = make_engine(tiny, max_model_len=256, kv_memory_bytes=18 * block_bytes, max_num_seqs=8)
    tight = generate(engine, requests)
    assert engine.stats().preemptions_total > 0
    assert [tokens(o) for o in tight] == [tokens(o) for o in roomy]
    for outputs in tight:
        jsonschema.validate(json.loads(text(outputs)), SCHEMA)


def test_prefix_cache_hits_leave_the_grammar_alone(tiny: tuple[Any, Any]) -> None:
    story = "once upon a time there was a little girl named lily who liked to play in the park with her dog. "
    requests = [(story * 2 + p, SamplingParams(max_tokens=120, structured=JSON_SCHEMA)) for p in PROMPTS]
    uncached = generate(make_engine(tiny, prefix_cache=False), requests)
    engine = make_engine(tiny)
    cached = generate(engine, requests, first_alone=True)  # the others find the story's blocks cached
    assert engine.stats().prefix_cache_hits_total > 0
    assert [tokens(o) for o in cached] == [tokens(o) for o in uncached]
    for outputs in cached:
        jsonschema.validate(json.loads(text(outputs)), SCHEMA)


def test_regex_and_choice(tiny: tuple[Any, Any]) -> None:
    regex = StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}")
    choice = StructuredOutput("choice", json.dumps(["yes", "no", "maybe not"]))
    requests = [
        (p, SamplingParams(max_tokens=20, temperature=1.0, seed=i, structured=regex)) for i, p in enumerate(PROMPTS)
    ]
    requests += [
        (p, SamplingParams(max_tokens=20, temperature=1.0, seed=i, structured=choice)) for i, p in enumerate(PROMPTS)
    ]
    results = [text(o) for o in generate(make_engine(tiny), requests)]
    import re

    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) for t in results[:4]), results
    assert all(t in ("yes", "no", "maybe not") for t in results[4:]), results


def test_a_schema_that_does_not_compile_is_refused_naming_the_problem(tiny: tuple[Any, Any]) -> None:
    engine = make_engine(tiny)
    with pytest.raises(RequestError, match="Unsupported type") as bad:
        engine.compile_grammar(StructuredOutput("json_schema", '{"type": "colour"}'), "response_format")
    assert bad.value.param == "response_format" and "/project/cpp" not in bad.value.message
    with pytest.raises(RequestError, match="regex does not compile"):
        engine.submit([1, 5], SamplingParams(4, structured=StructuredOutput("regex", "[a-")), "r")


# -- through the openai client -------------------------------------------------------------------------------


@pytest.fixture
def client(tiny: tuple[Any, Any]) -> Iterator[openai.OpenAI]:
    with serving(create_app(make_engine(tiny), shutdown_grace_seconds=1.0)) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def _streamed_content(stream: Any) -> tuple[str, str | None]:
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish


def test_json_mode_with_the_openai_client(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe the ball as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA, "strict": True}}
    for temperature, seed in ((0.0, None), (1.0, 7), (1.0, 8)):
        options = {"temperature": temperature, "seed": seed, "max_tokens": 150}
        reply = client.chat.completions.create(model="tiny", messages=messages, response_format=fmt, **options)
        content = reply.choices[0].message.content
        jsonschema.validate(json.loads(content), SCHEMA)
        assert reply.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(
            model="tiny", messages=messages, response_format=fmt, stream=True, **options
        )
        assert _streamed_content(stream) == (content, "stop")
    anything = client.chat.completions.create(
        model="tiny", messages=messages, response_format={"type": "json_object"}, max_tokens=200, temperature=0
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_completions_take_response_format_and_guided_extras(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA}}
    done = client.completions.create(model="tiny", prompt="Once", max_tokens=150, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    guided = client.completions.create(
        model="tiny", prompt="Once", max_tokens=150, temperature=1.0, seed=1, extra_body={"guided_json": SCHEMA}
    )
    jsonschema.validate(json.loads(guided.choices[0].text), SCHEMA)
    picked = client.completions.create(
        model="tiny", prompt="Once", max_tokens=10, extra_body={"guided_choice": ["alpha", "beta"]}
    )
    assert picked.choices[0].text in ("alpha", "beta")


def test_bad_schemas_are_400_naming_the_field(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}}
    with pytest.raises(openai.BadRequestError, match="properties must be an object") as bad:
        client.chat.completions.create(model="tiny", messages=messages, response_format=fmt)
    assert bad.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="guided_regex") as both:
        client.completions.create(model="tiny", prompt="x", extra_body={"guided_json": SCHEMA, "guided_regex": "a+"})
    assert both.value.body["param"] == "guided_regex"


def test_an_engine_without_grammars_refuses_structured_output_but_takes_tools() -> None:
    engine = FakeEngine()
    with serving(create_app(engine, shutdown_grace_seconds=1.0)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "hi there"}]
        with pytest.raises(openai.BadRequestError, match="does not support structured output") as bad:
            client.chat.completions.create(
                model=engine.model_name, messages=messages, response_format={"type": "json_object"}
            )
        assert bad.value.body["param"] == "response_format"
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        reply = client.chat.completions.create(model=engine.model_name, messages=messages, tools=[tool], max_tokens=3)
        assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls  # plain text: content
        assert engine.chat_tools[-1] == [tool]
