"""squeeze serve's HTTP front over a fake engine, under a real uvicorn server on an ephemeral port: every route,
streaming and not, errors in OpenAI's shape, authentication, metrics, disconnects, and the official client."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_engine import FakeEngine, serving
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from squeeze.serve.http.app import create_app
from squeeze.serve.types import EngineStoppedError, QueueFullError, RequestError, SamplingParams

PROMPT = "the cat sat"
TIMEOUT = 20.0


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


def events(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of an event stream: JSON objects, and the final ``"[DONE]"``."""
    out: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_error(response: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and "\n" not in error["message"]
    assert error["param"] == param, error
    assert contains in error["message"], error
    return error


def metric_values(text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


def wait_until(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- routes ---------------------------------------------------------------------------------------------------


def test_health_models_and_unknown_routes(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake-model"]
    assert models["data"][0]["max_model_len"] == 4096
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    error = assert_error(client.get("/v1/models/gpt-4"), 404, "model", "gpt-4")
    assert error["code"] == "model_not_found"
    assert_error(client.get("/v1/nothing"), 404, contains="GET /v1/nothing")
    assert_error(client.get("/v1/completions"), 405)


def test_completion(client: httpx.Client, engine: FakeEngine) -> None:
    response = client.post("/v1/completions", json={"model": "fake-model", "prompt": PROMPT, "max_tokens": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("cmpl-") and len(body["id"]) == len("cmpl-") + 32
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert abs(body["created"] - time.time()) < 60
    [choice] = body["choices"]
    assert choice == {"index": 0, "text": " the cat sat the cat", "logprobs": None, "finish_reason": "length"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    [(prompt_ids, params, request_id)] = engine.submitted
    assert prompt_ids == [0, 1, 2] and request_id == body["id"]
    assert params == SamplingParams(max_tokens=5, temperature=1.0, top_p=1.0, seed=None, stop=())


def test_completion_options_reach_the_engine(client: httpx.Client, engine: FakeEngine) -> None:
    response = client.post(
        "/v1/completions",
        json={"prompt": [1, 2], "temperature": 0, "top_p": 0.5, "seed": 7, "stop": ["cat"], "user": "x", "n": 1},
    )
    assert response.status_code == 200, response.text
    assert engine.submitted[0][:2] == ([1, 2], SamplingParams(16, 0.0, 0.5, 7, ("cat",)))
    # a batch of one prompt is that prompt; the model field may be left out
    engine.tokenize("the cat")
    body = client.post("/v1/completions", json={"prompt": ["the cat the"], "stop": " cat", "max_tokens": 9}).json()
    assert body["choices"][0]["text"] == " the" and body["choices"][0]["finish_reason"] == "stop"


def test_completion_stream(client: httpx.Client) -> None:
    request = {"prompt": PROMPT, "max_tokens": 5, "stream": True}
    with client.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        got = events(response)
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == " the cat sat the cat"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all("usage" not in c for c in chunks)


def test_completion_stream_with_usage(client: httpx.Client) -> None:
    request = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=request) as response:
        got = events(response)
    *chunks, usage, done = got
    assert done == "[DONE]"
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert all(c["usage"] is None for c in chunks)


def test_chat() -> None:
    engine = FakeEngine(max_model_len=40)
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    ]
    with serving(create_app(engine)) as base:
        response = httpx.post(f"{base}/v1/chat/completions", json={"model": "fake-model", "messages": messages})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].startswith(" system: be brief")
    assert choice["finish_reason"] == "length"
    assert engine.chat_calls == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"}]]
    # no max_tokens: the rest of the context
    prompt_ids, params, _ = engine.submitted[0]
    assert params.max_tokens == engine.max_model_len - len(prompt_ids) == body["usage"]["completion_tokens"]


def test_chat_stream(client: httpx.Client) -> None:
    request = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_completion_tokens": 8,
        "max_tokens": 2,  # the older field loses to max_completion_tokens
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=request) as response:
        got = events(response)
    assert got[-1] == "[DONE]"
    first, *middle, last, usage = got[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"]["content"] for c in middle)
    assert text == " user: hello there user: hello there user: hello" and all(
        c["choices"][0]["finish_reason"] is None for c in middle
    )
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8


def test_stop_token_finishes_with_stop(client: httpx.Client) -> None:
    body = client.post("/v1/completions", json={"prompt": "a b EOS", "max_tokens": 10}).json()
    assert body["choices"][0] == {"index": 0, "text": " a b", "logprobs": None, "finish_reason": "stop"}


# -- errors ---------------------------------------------------------------------------------------------------


def test_malformed_and_invalid_bodies_are_400(client: httpx.Client, engine: FakeEngine) -> None:
    bad = client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert_error(bad, 400, contains="not valid JSON")
    assert_error(client.post("/v1/completions", content=b"prompt=hi"), 400, contains="JSON object")
    assert_error(client.post("/v1/completions", json={"max_tokens": 3}), 400, "prompt", "prompt: Field required")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "temperature": "hot"}), 400, "temperature")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "temperature": 2.5}), 400, "temperature")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "n": 17}), 400, "n", "less than or equal to 16")
    assert_error(client.post("/v1/completions", json={"prompt": [[1], []]}), 400, "prompt", "prompt 1 is an empty")
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert_error(client.post("/v1/chat/completions", json=image), 400, "messages.0.content", "image_url")
    wrong_model = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert assert_error(wrong_model, 404, "model")["code"] == "model_not_found"
    assert engine.submitted == []


def test_engine_refusals_keep_their_status(client: httpx.Client, engine: FakeEngine) -> None:
    too_long = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 5000})
    assert_error(too_long, 400, "max_tokens", "context of 4096")
    assert_error(client.post("/v1/completions", json={"prompt": [5, 5000]}), 400, "prompt", "5000")
    engine.fail_next_submit = RequestError("no such thing", hint="try another", param="stop")
    error = assert_error(
        client.post("/v1/completions", json={"prompt": "x"}), 400, "stop", "no such thing (try another)"
    )
    assert error["type"] == "invalid_request_error"
    engine.fail_next_submit = EngineStoppedError("going away")
    assert assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503)["type"] == "service_unavailable"


@pytest.mark.parametrize("stream", [False, True])
def test_queue_full_is_429_with_retry_after_even_when_streaming(
    client: httpx.Client, engine: FakeEngine, stream: bool
) -> None:
    engine.fail_next_submit = QueueFullError("too many waiting", retry_after=7)
    response = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": stream}
    )
    error = assert_error(response, 429, contains="too many waiting")
    assert error["type"] == "rate_limit_error" and response.headers["retry-after"] == "7"


def test_no_chat_template_is_400(url: str) -> None:
    engine = FakeEngine(chat_template=False)
    with serving(create_app(engine)) as base:
        response = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert_error(response, 400, "messages", "chat template")


def test_chat_prompt_filling_the_context_is_400() -> None:
    engine = FakeEngine(max_model_len=3)
    with serving(create_app(engine)) as base:
        messages = [{"role": "user", "content": "one two"}]  # "user: one two": 3 tokens
        response = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages})
    assert_error(response, 400, "messages", "no room")


def test_engine_failure_is_500_or_an_error_event(client: httpx.Client) -> None:
    error = assert_error(client.post("/v1/completions", json={"prompt": "x FAIL"}), 500, contains="failed on purpose")
    assert error["type"] == "server_error"
    with client.stream("POST", "/v1/completions", json={"prompt": "x FAIL", "stream": True}) as response:
        assert response.status_code == 200
        got = events(response)
    assert got[0]["choices"][0]["text"] == " x"
    assert got[1]["error"]["type"] == "server_error" and "failed on purpose" in got[1]["error"]["message"]
    assert got[2:] == ["[DONE]"]


def test_unexpected_exception_is_500_in_openai_shape(client: httpx.Client, engine: FakeEngine) -> None:
    engine.fail_next_submit = ValueError("a bug")
    error = assert_error(client.post("/v1/completions", json={"prompt": "x"}), 500, contains="ValueError: a bug")
    assert error["type"] == "server_error"


# -- authentication -------------------------------------------------------------------------------------------


def test_api_key() -> None:
    engine = FakeEngine()
    with serving(create_app(engine, api_key="s3cret")) as base, httpx.Client(base_url=base, timeout=TIMEOUT) as http:
        request = {"prompt": "x", "max_tokens": 1}
        missing = http.post("/v1/completions", json=request)
        assert assert_error(missing, 401)["code"] == "invalid_api_key"
        assert missing.headers["www-authenticate"] == "Bearer"
        assert_error(http.post("/v1/completions", json=request, headers={"Authorization": "Bearer nope"}), 401)
        assert_error(http.post("/v1/completions", json=request, headers={"Authorization": "Basic s3cret"}), 401)
        assert_error(http.get("/v1/models"), 401)
        assert_error(http.get("/metrics"), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert http.post("/v1/completions", json=request, headers=good).status_code == 200
        assert http.get("/v1/models", headers=good).status_code == 200
        assert http.get("/metrics", headers=good).status_code == 200
        assert http.get("/health").status_code == 200
    assert len(engine.submitted) == 1


# -- metrics --------------------------------------------------------------------------------------------------


def test_metrics(client: httpx.Client, engine: FakeEngine) -> None:
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    values = metric_values(response.text)
    assert values["squeeze_kv_blocks_total"] == values["squeeze_kv_blocks_free"] == engine.num_blocks
    assert values["squeeze_requests_running"] == values["squeeze_requests_waiting"] == 0
    assert values["squeeze_requests_finished_total"] == 1 and values["squeeze_generation_tokens_total"] == 4
    assert values["squeeze_prompt_tokens_total"] == 3 and values["squeeze_preemptions_total"] == 0
    assert values["squeeze_time_to_first_token_seconds_count"] == 1
    assert values["squeeze_inter_token_latency_seconds_count"] == 3


# -- disconnects ----------------------------------------------------------------------------------------------


def _raw_request(url: str, body: dict) -> socket.socket:
    """A POST written by hand on a plain socket, so the test can hang up mid-response."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _blocks_free(client: httpx.Client) -> float:
    return metric_values(client.get("/metrics").text)["squeeze_kv_blocks_free"]


def test_disconnect_mid_stream_cancels_and_frees_blocks(client: httpx.Client, url: str, engine: FakeEngine) -> None:
    sock = _raw_request(url, {"prompt": PROMPT, "max_tokens": 3000, "stream": True})
    received = b""
    while received.count(b"data: ") < 3:  # the stream is flowing
        received += sock.recv(4096)
    assert b" 200 OK" in received.split(b"\r\n", 1)[0]
    assert _blocks_free(client) < engine.num_blocks
    sock.close()
    wait_until(lambda: _blocks_free(client) == engine.num_blocks, "the cancelled stream's blocks")
    assert engine.cancelled == [engine.submitted[0][2]]


def test_disconnect_while_waiting_for_a_whole_completion_cancels_it(
    client: httpx.Client, url: str, engine: FakeEngine
) -> None:
    sock = _raw_request(url, {"prompt": PROMPT, "max_tokens": 3000})
    wait_until(lambda: engine.submitted != [] and engine.stats().generation_tokens_total > 2, "the request to run")
    sock.close()
    wait_until(lambda: _blocks_free(client) == engine.num_blocks, "the cancelled request's blocks")
    assert engine.cancelled == [engine.submitted[0][2]]


def test_finished_requests_are_not_cancelled(client: httpx.Client, engine: FakeEngine) -> None:
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}) as r:
        events(r)
    assert engine.cancelled == [] and engine.free_blocks == engine.num_blocks


# -- lifespan -------------------------------------------------------------------------------------------------


def test_lifespan_starts_and_shuts_down_the_engine_and_health_turns_503() -> None:
    engine = FakeEngine()
    app = create_app(engine, shutdown_grace_seconds=2.5, served_model_name="tiny")
    assert engine.observer is app.state.metrics
    with TestClient(app) as http:
        assert engine.start_calls == 1 and engine.shutdown_calls == []
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200
    assert engine.shutdown_calls == [2.5]
    after = TestClient(app).get("/health")  # no lifespan: the app as it was left
    assert_error(after, 503, contains="shutting down")


def test_stopping_the_server_lets_a_running_stream_finish(engine: FakeEngine) -> None:
    engine.step_seconds = 0.01
    got: list[Any] = []
    with serving(create_app(engine, shutdown_grace_seconds=5.0), graceful_seconds=5) as base:

        def read() -> None:
            with httpx.stream(
                "POST", f"{base}/v1/completions", json={"prompt": "a", "max_tokens": 40, "stream": True}
            ) as r:
                got.extend(events(r))

        reader = threading.Thread(target=read)
        reader.start()
        wait_until(lambda: engine.stats().generation_tokens_total > 2, "the stream to start")
    reader.join(timeout=TIMEOUT)
    assert got[-1] == "[DONE]" and got[-2]["choices"][0]["finish_reason"] == "length"
    assert engine.cancelled == [] and engine.shutdown_calls == [5.0]


# -- the official client --------------------------------------------------------------------------------------


def test_openai_client() -> None:
    engine = FakeEngine()
    with serving(create_app(engine, api_key="k")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        assert [m.id for m in client.models.list()] == ["fake-model"]
        completion = client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=4, temperature=0)
        assert completion.choices[0].text == " the cat sat the" and completion.usage.total_tokens == 7
        pieces = [
            c.choices[0].text
            for c in client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=4, stream=True)
        ]
        assert "".join(pieces) == completion.choices[0].text
        messages = [{"role": "user", "content": "hello"}]
        chat = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=3, seed=1)
        assert chat.choices[0].message.content == " user: hello user:" and chat.choices[0].finish_reason == "length"
        stream = client.chat.completions.create(
            model="fake-model", messages=messages, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="fake-model", prompt=PROMPT, logprobs=21)
        assert "logprobs" in str(bad.value) and bad.value.status_code == 400
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt=PROMPT)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="fake-model", prompt="x FAIL")
        with pytest.raises(openai.APIError, match="failed on purpose"):
            list(client.completions.create(model="fake-model", prompt="x FAIL", stream=True))
        engine.fail_next_submit = QueueFullError("busy")
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="fake-model", prompt=PROMPT)
        wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0, timeout=TIMEOUT)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()


def test_a_stream_past_the_grace_is_cancelled_at_shutdown(engine: FakeEngine) -> None:
    engine.step_seconds = 0.01
    outcome: list[Any] = []
    with serving(create_app(engine, shutdown_grace_seconds=0.5), graceful_seconds=1) as base:

        def read() -> None:
            request = {"prompt": "a", "max_tokens": 3000, "stream": True}
            try:
                with httpx.stream("POST", f"{base}/v1/completions", json=request, timeout=TIMEOUT) as r:
                    outcome.extend(events(r))
            except httpx.HTTPError as exc:  # the server cut the response short
                outcome.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        wait_until(lambda: engine.stats().generation_tokens_total > 2, "the stream to start")
    reader.join(timeout=TIMEOUT)
    assert "[DONE]" not in outcome
    assert engine.cancelled == [engine.submitted[0][2]] and engine.free_blocks == engine.num_blocks
    assert engine.shutdown_calls == [0.5]
