"""What evaluation and benchmark clients send, over the fake engine: prompt batches, ``n``, ``echo`` with
``logprobs`` (OpenAI's legacy shape, as lm-evaluation-harness reads it), chat log-probabilities, and vLLM's
tokenizer endpoints."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from fake_engine import FakeEngine, serving
from test_http import TIMEOUT, assert_error, events

from squeeze.serve.http.app import create_app


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def url(engine: FakeEngine) -> Iterator[str]:
    with serving(create_app(engine, shutdown_grace_seconds=1.0)) as base:
        yield base


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        yield http


def test_a_batch_of_prompts_gives_one_choice_each_in_order(client: httpx.Client, engine: FakeEngine) -> None:
    body = client.post("/v1/completions", json={"prompt": ["a b", "c d e", "f"], "max_tokens": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [" a b", " c d", " f f"]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    ids = client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 1}).json()
    assert [c["text"] for c in ids["choices"]] == [" b", " d"]


def test_n_samples_are_seeded_one_after_another(client: httpx.Client, engine: FakeEngine) -> None:
    body = client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "n": 3, "best_of": 3, "seed": 10, "max_tokens": 1}
    ).json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [params.seed for _, params, _ in engine.submitted] == [10, 11, 12, 10, 11, 12]
    assert [prompt for prompt, _, _ in engine.submitted] == [[0]] * 3 + [[1]] * 3
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 6
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2}
    ).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert all(params.seed is None for _, params, _ in engine.submitted[6:])


def test_n_beyond_what_the_engine_batches_is_refused(client: httpx.Client, engine: FakeEngine) -> None:
    engine.max_num_seqs = 2  # type: ignore[attr-defined]
    assert_error(client.post("/v1/completions", json={"prompt": "a", "n": 3}), 400, "n", "--max-num-seqs 2")
    assert engine.submitted == []


def test_echo_with_logprobs_scores_the_prompt_in_the_legacy_shape(client: httpx.Client, engine: FakeEngine) -> None:
    # what lm-evaluation-harness's local-completions sends for every log-likelihood request
    request = {"prompt": [[3, 1, 2]], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    (choice,) = client.post("/v1/completions", json=request).json()["choices"]
    engine_words = [engine.word(i) for i in (3, 1, 2)]
    assert choice["text"] == " ".join(engine_words) + " " + engine.word(3)
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert logprobs["tokens"] == ["t3", " t1", " t2", " t3"]
    # prompt token p: -(id + p) / 10, the first one's null; then the generated token at position 3
    assert logprobs["token_logprobs"] == [None, -0.2, -0.4, -0.6]
    assert logprobs["top_logprobs"][0] is None
    # the top one and the chosen token, named as in ``tokens`` (read in context: issue 50 item 5)
    assert logprobs["top_logprobs"][1] == {" t0": -0.01, " t1": -0.2}
    assert logprobs["text_offset"] == [0, 2, 5, 8]
    score_only = {**request, "max_tokens": 0}
    (scored,) = client.post("/v1/completions", json=score_only).json()["choices"]
    assert scored["logprobs"]["token_logprobs"] == [None, -0.2, -0.4] and scored["finish_reason"] == "length"
    assert scored["text"] == "t3 t1 t2"
    echoed = client.post("/v1/completions", json={"prompt": "x y", "echo": True, "max_tokens": 1}).json()
    assert echoed["choices"][0]["text"] == "x y x" and echoed["choices"][0]["logprobs"] is None


def test_logprobs_without_echo_cover_the_completion(client: httpx.Client) -> None:
    body = client.post("/v1/completions", json={"prompt": "a b", "logprobs": 0, "max_tokens": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" a", " b"] and logprobs["token_logprobs"] == [-0.2, -0.4]
    assert logprobs["top_logprobs"] == [{" a": -0.2}, {" b": -0.4}] and logprobs["text_offset"] == [0, 2]
    streamed = events(
        client.post("/v1/completions", json={"prompt": "a b", "logprobs": 2, "max_tokens": 2, "stream": True})
    )
    chunks = [e for e in streamed if e != "[DONE]"]
    assert [c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks] == [[-0.2], [-0.4]]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0], [2]]


def test_streamed_choices_carry_their_index(client: httpx.Client) -> None:
    request = {"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    streamed = events(client.post("/v1/completions", json=request))
    assert streamed[-1] == "[DONE]" and streamed[-2]["usage"]["completion_tokens"] == 8
    texts: dict[int, str] = {}
    finished = set()
    for chunk in streamed[:-2]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert texts == {0: " a a", 1: " a a", 2: " b b", 3: " b b"} and finished == {0, 1, 2, 3}


def test_chat_logprobs_in_the_current_shape(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(
        model="fake-model", messages=messages, max_tokens=2, logprobs=True, top_logprobs=2, n=2
    )
    assert len(reply.choices) == 2
    content = reply.choices[0].logprobs.content
    assert [t.token for t in content] == [" user:", " hi"]  # read after the prompt
    assert content[0].logprob == pytest.approx(-0.2)
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [(" user:", -0.01), (" hi", -0.02)]
    assert content[0].bytes == list(b" user:")
    plain = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None
    stream = client.chat.completions.create(
        model="fake-model", messages=messages, max_tokens=2, logprobs=True, stream=True
    )
    tokens = [t.token for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert tokens == [" user:", " hi"]  # each streamed piece read after what came before it


def test_tokenizer_endpoints(client: httpx.Client, engine: FakeEngine) -> None:
    tokens = client.post("/tokenize", json={"prompt": "a b a", "return_token_strs": True}).json()
    assert tokens == {"count": 3, "max_model_len": 4096, "tokens": [0, 1, 0], "token_strs": ["a", "b", "a"]}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "c"}]}).json()
    assert chat["count"] == 2 and chat["token_strs"] is None
    assert client.post("/detokenize", json={"tokens": [1, 0]}).json() == {"prompt": "b a"}
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "FakeTokenizer" and info["eos_token"] == "EOS"
    assert_error(client.post("/detokenize", json={"tokens": [5000]}), 400, "tokens", "5000")
    assert_error(client.post("/tokenize", json={}), 400, "prompt", "either prompt")
    assert_error(client.post("/tokenize", json={"prompt": "x " * 5000}), 400, "prompt", "context of 4096")
    huge = client.post("/tokenize", json={"prompt": "x" * (64 * 4096 + 1)})
    assert_error(huge, 400, "prompt", "characters long")
