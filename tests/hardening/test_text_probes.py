"""Issue 50's text probes (items 2, 5 and 7) as a user meets them, each in a child process on the hardening
suite's rtn-w4 stories260K artifact (a SentencePiece tokenizer): ``squeeze run`` keeps the first generated
word's space, and a ``squeeze serve`` process answers logprobs 20 with 20 distinct keys, echo offsets that
index its text, and a lone surrogate sent to /tokenize with a 400.

Slow (a compress, a run and a server start): deselected from the default run, see conftest.py here.
"""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from test_hardening_probes import CLI, REPO, Probe, succeeded
from test_hardening_probes import probe as probe  # noqa: PLC0414  (the fixtures, shared with those probes)
from test_hardening_probes import shared as shared  # noqa: PLC0414

from server_process import running_server

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time,"


def test_run_keeps_the_first_generated_words_space(probe: Probe) -> None:
    """It printed "there was a" after "Once upon a time,", and the same in --json."""
    probe.artifact()
    streamed = probe.cli("run", PROMPT, "-m", "art", "-n", "6")
    as_json = probe.cli("run", PROMPT, "-m", "art", "-n", "6", "--json")
    succeeded(streamed)
    succeeded(as_json)
    text = json.loads(as_json.stdout)["text"]
    assert text.startswith(" ") and text.strip() and streamed.stdout == text + "\n"


def test_serve_names_logprob_tokens_in_context_and_refuses_a_surrogate(probe: Probe) -> None:
    art = probe.artifact()
    command = [sys.executable, "-c", CLI, "serve", str(art), "--port", "0", "--json", "--kv-memory", "8MiB"]
    with running_server(command, cwd=REPO, startup_seconds=120) as (_, url):  # cwd: this checkout's squeeze
        request = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 20, "echo": True}
        choice = httpx.post(f"{url}/completions", json=request, timeout=60).json()["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
        assert text.startswith(PROMPT + " ")  # it read "Once upon a time,there"
        for token, offset, top in zip(
            logprobs["tokens"][1:], logprobs["text_offset"][1:], logprobs["top_logprobs"][1:], strict=True
        ):
            assert len(top) >= 20 and token in top  # 18-19 keys before, the chosen " " not among them
            assert text[offset:].startswith(token)  # offsets counted "<s>" and spaces the text does not hold
        surrogate = b'{"prompt": "a \\ud800 b"}'
        response = httpx.post(
            url.removesuffix("/v1") + "/tokenize",
            content=surrogate,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"]
