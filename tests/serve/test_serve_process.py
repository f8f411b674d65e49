"""``squeeze serve`` for real: a process serving stories260K (engine in the main thread, uvicorn beside it), the
official openai client against it, a client that disconnects mid-stream, and SIGTERM -> exit 0."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server_process import running_server
from squeeze import api

openai = pytest.importorskip("openai")


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


@pytest.fixture
def server(serve_artifact: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    command = [sys.executable, "-c", "from squeeze.cli.app import main; main()", "serve", str(serve_artifact)]
    options = ["--port", "0", "--json", "--kv-memory", "8MiB", "--shutdown-grace", "5"]
    with running_server([*command, *options], startup_seconds=120) as (process, url):
        yield process, url.removesuffix("/v1")


def test_a_real_server_answers_the_openai_client_frees_blocks_and_stops_on_sigterm(
    server: tuple[subprocess.Popen, str], serve_artifact: Path
) -> None:
    process, base = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0)
    alone = api.generate(serve_artifact, "Once upon a time", max_new_tokens=16)
    assert completion.choices[0].text == alone.text
    assert completion.usage.completion_tokens == alone.new_tokens[0]
    with pytest.raises(openai.BadRequestError, match="chat template"):  # stories260K's tokenizer has none
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)

    total = _metric(base, "squeeze_kv_blocks_total")
    generated = _metric(base, "squeeze_generation_tokens_total")
    body = {"prompt": "Once upon a time", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # the first token arrived: hang up mid-stream
    deadline = time.monotonic() + 30
    while _metric(base, "squeeze_kv_blocks_free") != total or _metric(base, "squeeze_requests_running"):
        assert time.monotonic() < deadline, "the disconnected request kept its blocks"
        time.sleep(0.05)
    assert _metric(base, "squeeze_generation_tokens_total") - generated < 500  # cancelled, not run to its end

    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
