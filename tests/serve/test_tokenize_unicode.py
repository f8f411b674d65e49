"""/tokenize on text that is not valid Unicode (issue 50 item 7): a 400 naming the field, never a 500."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fake_engine import FakeEngine, serving

from squeeze.serve.http.app import create_app


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with serving(create_app(FakeEngine(), shutdown_grace_seconds=1.0)) as base:
        with httpx.Client(base_url=base, timeout=20.0) as http:
            yield http


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": "a \\ud800 b"}', "prompt"),
        ('{"prompt": "a \\udfff", "return_token_strs": true}', "prompt"),
        ('{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages.0.content"),
        ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "messages.0.content"),
    ],
)
def test_tokenize_refuses_a_lone_surrogate_as_generation_does(client: httpx.Client, body: str, param: str) -> None:
    """It was a 500 (the tokenizer cannot read it). A 400 naming the field, as /v1/completions and chat answer
    the same text, so that /tokenize counts only what those endpoints take."""
    response = client.post("/tokenize", content=body.encode(), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and "surrogate" in error["message"]
    fine = client.post("/tokenize", json={"prompt": "a \u00e9 b"})  # a real non-ASCII character is tokenized
    assert fine.status_code == 200 and fine.json()["count"] == 3
