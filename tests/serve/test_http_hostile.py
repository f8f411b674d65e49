"""squeeze serve against hostile clients (issue 41): text that is not Unicode, NaN numbers, oversized bodies,
slow tokenization, idle connections and shutdown with streams open. Over a fake engine on 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fake_engine import FakeEngine, serving

from squeeze.serve.http.app import create_app
from squeeze.serve.http.connection_limits import (
    MIN_BODY_RATE,
    body_deadline,
    default_max_connections,
    default_max_request_bytes,
)
from squeeze.serve.http.uvicorn_server import uvicorn_config

TIMEOUT = 20.0
PROMPT = "the cat sat"


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


# -- big bodies and slow tokenization (issue 41 item 3) -------------------------------------------------------


def raw_exchange(base: str, request: bytes, seconds: float = 10.0) -> bytes:
    """Send ``request`` on a fresh socket and read what comes back until the server closes or ``seconds``."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=seconds) as sock:
        sock.sendall(request)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks)


def test_a_body_over_the_cap_is_refused_from_its_content_length_unread(engine: FakeEngine) -> None:
    with serving(create_app(engine, max_request_bytes=4096)) as base:
        started = time.monotonic()
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n"
        )
        reply = raw_exchange(base, head + b'{"prompt": "')  # the other 50 MB never come
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"--max-request-bytes" in reply
        assert time.monotonic() - started < 5


def test_a_chunked_body_over_the_cap_is_refused(engine: FakeEngine) -> None:
    with serving(create_app(engine, max_request_bytes=4096)) as base:

        def chunks() -> Iterator[bytes]:
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"word " * 200
            yield b'"}'

        with httpx.Client(base_url=base, timeout=TIMEOUT) as http:
            response = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert response.status_code == 413, response.text
        assert "4096 bytes" in response.json()["error"]["message"]
        assert not engine.submitted


def test_the_default_cap_follows_the_context(engine: FakeEngine) -> None:
    cap = default_max_request_bytes(engine.max_model_len)
    assert cap >= 16 * engine.max_model_len
    with serving(create_app(engine)) as base, httpx.Client(base_url=base, timeout=TIMEOUT) as http:
        assert http.post("/v1/completions", json={"prompt": "x " * (cap // 2)}).status_code == 413
        assert http.post("/v1/completions", json={"prompt": PROMPT}).status_code == 200


def test_health_answers_while_a_long_prompt_is_tokenized(engine: FakeEngine, monkeypatch) -> None:
    """Tokenization ran on the event loop: one huge prompt held /health and everyone else."""
    release = threading.Event()
    original = engine.tokenize

    def slow_tokenize(prompt):  # a tokenizer busy for as long as the test wants
        release.wait(20)
        return original(prompt)

    monkeypatch.setattr(engine, "tokenize", slow_tokenize)
    with serving(create_app(engine)) as base, httpx.Client(base_url=base, timeout=TIMEOUT) as http:
        slow = threading.Thread(target=lambda: http.post("/v1/completions", json={"prompt": PROMPT}), daemon=True)
        slow.start()
        time.sleep(0.3)
        try:
            started = time.monotonic()
            assert http.get("/health", timeout=3).status_code == 200
            assert time.monotonic() - started < 2
        finally:
            release.set()
            slow.join(20)


# -- idle and half-open connections (issue 41 item 4) ---------------------------------------------------------


@contextlib.contextmanager
def guarded_server(engine: FakeEngine, *, max_connections: int, idle_timeout: float) -> Iterator[tuple[str, int]]:
    """The app under the uvicorn configuration squeeze serve uses, on an ephemeral 127.0.0.1 port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    config = uvicorn_config(
        create_app(engine),
        shutdown_grace=1,
        max_connections=max_connections,
        idle_timeout=idle_timeout,
        configure_logging=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (reading whatever it sends first)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_an_idle_or_half_sent_connection_is_closed_after_the_idle_timeout(engine: FakeEngine) -> None:
    with guarded_server(engine, max_connections=50, idle_timeout=0.5) as address:
        silent = socket.create_connection(address)
        half = socket.create_connection(address)
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        with silent, half:
            assert closed_within(silent, 5)
            assert closed_within(half, 5)
        with httpx.Client(timeout=TIMEOUT) as http:  # and the server still answers
            assert http.get(f"http://{address[0]}:{address[1]}/health").status_code == 200


def test_a_drip_fed_head_is_cut_at_the_idle_timeout(engine: FakeEngine) -> None:
    """Any byte used to reset uvicorn's only timer: the head must be whole within the timeout."""
    with guarded_server(engine, max_connections=50, idle_timeout=0.6) as address:
        with socket.create_connection(address) as sock:
            started = time.monotonic()
            closed = False
            for byte in b"GET /health HTTP/1.1\r\nHost: xxxxxxxxxxxxxxxxxxxxxxxx\r\n":
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    closed = True
                    break
                time.sleep(0.1)
                if time.monotonic() - started > 5:
                    break
            assert closed or closed_within(sock, 2)
            assert time.monotonic() - started < 5


def test_connections_past_the_cap_get_503_and_the_server_recovers(engine: FakeEngine) -> None:
    with guarded_server(engine, max_connections=3, idle_timeout=30) as address:
        held = [socket.create_connection(address) for _ in range(3)]
        time.sleep(0.2)
        try:
            with socket.create_connection(address) as extra:
                extra.settimeout(5)
                reply = extra.recv(4096)
            assert reply.startswith(b"HTTP/1.1 503"), reply
            assert b"--max-connections" in reply
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.2)
        with httpx.Client(timeout=TIMEOUT) as http:
            assert http.get(f"http://{address[0]}:{address[1]}/health").status_code == 200


def read_until_closed(sock: socket.socket, seconds: float) -> bytes:
    """What the server sends on ``sock`` until it closes it (or ``seconds`` pass: then what came so far)."""
    sock.settimeout(seconds)
    chunks = []
    try:
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    except (TimeoutError, ConnectionResetError):
        pass
    return b"".join(chunks)


SLOW_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 3000\r\n\r\n"
)


def test_a_body_that_stops_coming_gets_408_and_frees_its_connection(engine: FakeEngine) -> None:
    """Issue 50 item 4: a head, 10 bytes of a 3000-byte body, then nothing held the connection forever (and
    the clients doing so held every admitted one: /health answered 503)."""
    with guarded_server(engine, max_connections=4, idle_timeout=0.5) as address:
        slow = [socket.create_connection(address) for _ in range(5)]
        started = time.monotonic()
        for sock in slow:
            sock.sendall(SLOW_HEAD + b'{"prompt":')
        replies = [read_until_closed(sock, 10) for sock in slow]
        elapsed = time.monotonic() - started
        for sock in slow:
            sock.close()
        timed_out = [r for r in replies if r.startswith(b"HTTP/1.1 408")]
        assert len(timed_out) == 4, [r[:40] for r in replies]  # the fifth was over the cap: 503 at once
        assert b"did not arrive in time: 10 of 3000 bytes" in timed_out[0]
        assert 0.5 <= elapsed < 5
        assert not engine.submitted
        with httpx.Client(timeout=TIMEOUT) as http:
            assert http.get(f"http://{address[0]}:{address[1]}/health").status_code == 200


def test_a_body_that_keeps_coming_within_the_deadline_is_served(engine: FakeEngine) -> None:
    body = b'{"prompt": "the cat sat", "max_tokens": 2}'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with guarded_server(engine, max_connections=4, idle_timeout=1.0) as address:
        with socket.create_connection(address) as sock:
            sock.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body[:10])
            time.sleep(0.4)
            sock.sendall(body[10:])
            reply = read_until_closed(sock, 10)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_the_body_deadline_grows_with_the_body() -> None:
    assert body_deadline(100.0, 2.0, None, 0) == 102.0
    assert body_deadline(100.0, 2.0, 3 * MIN_BODY_RATE, 10) == 105.0  # Content-Length: its time at once
    assert body_deadline(100.0, 2.0, None, MIN_BODY_RATE) == 103.0  # chunked: what came earns its time


def test_the_default_connection_cap_stays_below_the_open_file_limit() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        assert default_max_connections() < soft


# -- shutdown with streams open past the grace (issue 41 item 11) ---------------------------------------------


def test_streams_open_past_the_grace_end_with_an_error_event_and_done(engine: FakeEngine, caplog) -> None:
    import json
    import logging

    import uvicorn

    engine.step_seconds = 0.01
    app = create_app(engine, shutdown_grace_seconds=0.5)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn_config(app, shutdown_grace=0.5, configure_logging=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    outcomes: list[list] = [[], []]

    def read(slot: int, path: str, body: dict) -> None:
        try:
            with httpx.stream("POST", base + path, json=body, timeout=TIMEOUT) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        payload = line[len("data: ") :]
                        outcomes[slot].append(payload if payload == "[DONE]" else json.loads(payload))
        except httpx.HTTPError as exc:
            outcomes[slot].append(exc)

    readers = [
        threading.Thread(target=read, args=(0, "/v1/completions", {"prompt": "a", "max_tokens": 3000, "stream": True})),
        threading.Thread(
            target=read,
            args=(1, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stream": True}),
        ),
    ]
    with caplog.at_level(logging.WARNING):
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 10
        while engine.stats().generation_tokens_total < 4:
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.01)
        started = time.monotonic()
        server.should_exit = True  # what SIGTERM does
        for reader in readers:
            reader.join(TIMEOUT)
        thread.join(15)
        sock.close()
    assert time.monotonic() - started < 5
    for events in outcomes:
        assert events[-1] == "[DONE]", events[-3:]
        assert "shutting down" in events[-2]["error"]["message"]
    cancelled = [r for r in caplog.records if "cancelled: still open" in r.getMessage()]
    assert len(cancelled) == 2
    assert not [r for r in caplog.records if r.exc_info], "no tracebacks"
    assert sorted(engine.cancelled) == sorted(s[2] for s in engine.submitted)


# -- more choices than the queue holds (issue 50 item 10) -------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "shape"),
    [
        ({"prompt": ["a"] * 17}, "prompt", "17 choices (17 prompts)"),
        ({"prompt": ["a", "b", "c"], "n": 6}, "n", "18 choices (3 prompts x n 6)"),
    ],
)
def test_more_choices_than_the_queue_holds_is_a_400_not_a_429(engine: FakeEngine, body: dict, param: str, shape: str):
    """A 429 with Retry-After for a request that can never be queued: the OpenAI SDK retried it forever."""
    engine.max_num_seqs = 8  # type: ignore[attr-defined]
    with serving(create_app(engine)) as base, httpx.Client(base_url=base, timeout=TIMEOUT) as http:
        response = http.post("/v1/completions", json={**body, "max_tokens": 1})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param
        assert f"this request has {shape}, more than --max-queue ({engine.max_queue})" in error["message"]
        assert "split it" in error["message"]
        assert not engine.submitted
        chat = {"messages": [{"role": "user", "content": "a"}], "n": 17}
        engine.max_num_seqs = 32  # type: ignore[attr-defined]
        assert http.post("/v1/chat/completions", json=chat).status_code == 400
        assert http.post("/v1/completions", json={"prompt": ["a"] * 16, "max_tokens": 1}).status_code == 200


def test_the_real_engine_refuses_more_choices_than_its_queue(compress_tiny, tmp_path) -> None:
    from squeeze import api
    from squeeze.serve.types import EngineConfig

    artifact = compress_tiny(tmp_path / "tiny-w4")
    engine = api.serve_engine(artifact, config=EngineConfig(kv_memory_bytes=4 << 20, max_queue=4))
    assert engine.max_queue == 4
    with serving(create_app(engine)) as base, httpx.Client(base_url=base, timeout=TIMEOUT) as http:
        refused = http.post("/v1/completions", json={"prompt": ["a b"] * 5, "max_tokens": 1})
        assert refused.status_code == 400, refused.text
        assert "retry-after" not in refused.headers
        assert "more than --max-queue (4)" in refused.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": ["a b"] * 4, "max_tokens": 1}).status_code == 200
