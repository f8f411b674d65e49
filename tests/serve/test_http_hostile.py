"""squeeze serve against hostile clients (issue 41): text that is not Unicode, NaN numbers, oversized bodies,
slow tokenization, idle connections and shutdown with streams open. Over a fake engine on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fake_engine import FakeEngine, serving

from squeeze.serve.http import create_app

TIMEOUT = 20.0


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[httpx.Client]:
    with serving(create_app(engine, shutdown_grace_seconds=1.0)) as base:
        with httpx.Client(base_url=base, timeout=TIMEOUT) as http:
            yield http


def post_raw(client: httpx.Client, path: str, body: str) -> httpx.Response:
    return client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": "the \\ud800 cat"}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\udfff"}]}', "messages.0.content"),
        ("/v1/completions", '{"prompt": "a", "stop": ["\\ud800"]}', "stop.0"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(client: httpx.Client, path: str, body: str, param: str) -> None:
    """Issue 41 item 7: valid JSON, not valid Unicode: it was a 500."""
    response = post_raw(client, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_nan_temperature_is_not_a_number(client: httpx.Client, value: str) -> None:
    """Issue 41 item 15: NaN was reported as "should be less than or equal to 2"."""
    response = post_raw(client, "/v1/completions", f'{{"prompt": "a", "temperature": {value}}}')
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "temperature"
    assert "must be a number" in error["message"]
