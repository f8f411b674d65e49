"""squeeze serve's text and log-probabilities on stories260K, whose tokenizer is SentencePiece's (a word's
leading space is written only in context), over HTTP: completions keep their first space (issue 50 item 2),
log-probabilities name tokens distinctly with offsets into the text (item 5), and /tokenize refuses a lone
surrogate with a 400 where the real tokenizer raised (item 7)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import serving

from squeeze import api
from squeeze.runtime.options import KVOptions
from squeeze.serve.engine.engine import Engine
from squeeze.serve.http.app import create_app
from squeeze.serve.types import EngineConfig

PROMPT = "Once upon a time,"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # a chat prompt that is the bare text
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def engine(serve_artifact: Path) -> Engine:
    engine = api.serve_engine(serve_artifact, config=EngineConfig(kv=KVOptions(16), kv_memory_bytes=4 << 20))
    engine.tokenizer.chat_template = TEMPLATE  # this engine's own tokenizer: stories260K has no template
    return engine


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with serving(create_app(engine, shutdown_grace_seconds=1.0)) as base:
        yield base


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return dict(response.json())


def greedy(url: str, engine: Engine, prompt: str | list[int], **fields: Any) -> dict[str, Any]:
    request = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
    return dict(post(url, "/v1/completions", request)["choices"][0])


def test_a_completion_appended_to_its_prompt_reads_as_both_decoded(url: str, engine: Engine) -> None:
    prompt_ids = engine.tokenize(PROMPT)
    text = greedy(url, engine, PROMPT)["text"]
    whole = engine.tokenize(PROMPT + text)
    assert whole[: len(prompt_ids)] == prompt_ids
    assert PROMPT + text == engine.tokenizer.decode(whole, skip_special_tokens=True)
    assert text.startswith(" ") and text.strip()  # " there was ...": the space the old code dropped
    streamed = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True},
        timeout=TIMEOUT,
    )
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert greedy(url, engine, PROMPT, echo=True)["text"] == PROMPT + text  # it read "Once upon a time,there"
    stopped = greedy(url, engine, PROMPT, stop=[text.split()[1]])["text"]  # a stop string in the text read so
    assert stopped == text[: text.index(text.split()[1])] and stopped.startswith(" ")
    messages = [{"role": "user", "content": PROMPT}]
    chat = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0})
    # the same tokens as a completion of the template's ids: the same text, read after them
    as_ids = greedy(url, engine, engine.tokenize_chat(messages))["text"]
    assert chat["choices"][0]["message"]["content"] == as_ids and as_ids.startswith(" ")


def test_twenty_logprobs_are_twenty_distinct_keys_with_the_chosen_token_among_them(url: str, engine: Engine) -> None:
    choice = greedy(url, engine, PROMPT, logprobs=20)
    logprobs = choice["logprobs"]
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        assert len(top) == 20 and token in top  # greedy: the chosen token is the top one; 18-19 keys before
        assert top[token] == max(top.values())
    text = choice["text"]
    assert "".join(logprobs["tokens"]) == text  # story text: every token is named by the text it adds
    assert all(text[o:].startswith(t) for o, t in zip(logprobs["text_offset"], logprobs["tokens"], strict=True))
    messages = [{"role": "user", "content": PROMPT}]
    chat = post(
        url,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 20},
    )["choices"][0]
    for item in chat["logprobs"]["content"]:
        names = [t["token"] for t in item["top_logprobs"]]
        assert len(set(names)) == 20 and item["token"] == names[0]  # '"' listed once
    assert "".join(i["token"] for i in chat["logprobs"]["content"]) == chat["message"]["content"]


@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_text_offsets_index_the_returned_text(url: str, engine: Engine, as_ids: bool) -> None:
    prompt: str | list[int] = engine.tokenize(PROMPT) if as_ids else PROMPT
    choice = greedy(url, engine, prompt, echo=True, logprobs=1, max_tokens=4)
    text, logprobs = choice["text"], choice["logprobs"]
    assert text.startswith("<s> Once" if as_ids else "Once upon a time, ")  # a prompt sent as ids echoes its <s>
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert tokens[0] == "<s>" and offsets == sorted(offsets) and len(tokens) == len(engine.tokenize(PROMPT)) + 4
    for offset, token in zip(offsets[1:], tokens[1:], strict=True):  # <s> is in the text only when sent as ids
        assert text[offset:].startswith(token), (offset, token)
    assert tokens[1] == (" Once" if as_ids else "Once") and offsets[1] == (3 if as_ids else 0)


@pytest.mark.parametrize(
    "body",
    [
        '{"prompt": "a \\ud800 b"}',
        '{"messages": [{"role": "user", "content": "a \\ud800 b"}]}',
    ],
)
def test_tokenize_a_lone_surrogate_is_a_400_on_the_real_tokenizer(url: str, body: str) -> None:
    """It was a 500: the tokenizer raised TypeError on text UTF-8 cannot encode."""
    response = httpx.post(
        f"{url}/tokenize", content=body.encode(), headers={"Content-Type": "application/json"}, timeout=TIMEOUT
    )
    assert response.status_code == 400, response.text
    assert "surrogate" in response.json()["error"]["message"]
