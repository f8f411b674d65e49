# ruff: noqa: F811
"""Issue 50's serve and pull probes against the real CLI, each in a child process (items 4, 6, 8, 10, 11, 12):
a body that stops coming, a connection cap past the open-file limit, a KV pool past ``ulimit -v``, more
choices than the queue, a pull deadline against a silent server, and refusals that must carry a hint.

Slow (child processes): deselected from the default run, see conftest.py here.
"""

from __future__ import annotations

import contextlib
import re
import resource
import signal
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

# the probe fixtures of the main hardening module (a test's ``probe`` argument names the imported fixture)
from test_hardening_probes import CLI, Child, Probe, probe, refused, shared  # noqa: F401

pytestmark = pytest.mark.slow

SLOW_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 3000\r\n\r\n"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serving(probe: Probe, *options: object) -> Iterator[str]:
    """``squeeze serve`` on the probe's artifact in a child; yields its base URL once /health answers 200, then
    stops it with SIGTERM and checks it exited 0."""
    port = free_port()
    child = probe.spawn("serve", probe.base, "--port", port, "--kv-memory", "64MiB", *options)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert not child.poll(), child.finish().describe()
        assert time.monotonic() < deadline, "the server did not start"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        time.sleep(0.2)
    try:
        yield base
    finally:
        child.signal(signal.SIGTERM)
        out = child.finish()
        assert out.rc == 0 and "Traceback" not in out.stderr, out.describe()


def read_until_closed(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    chunks = []
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks)


def test_bodies_that_stop_coming_get_408_and_free_the_server(probe: Probe) -> None:
    """Item 4: 12 clients (cap 10) send a head, 10 bytes of a 3000-byte body, then nothing."""
    with serving(probe, "--max-connections", 10, "--idle-timeout", 1) as base:
        address = ("127.0.0.1", int(base.rsplit(":", 1)[1]))
        slow = [socket.create_connection(address) for _ in range(12)]
        for sock in slow:
            sock.sendall(SLOW_HEAD + b'{"prompt":')
        started = time.monotonic()
        replies = [read_until_closed(sock, 20) for sock in slow]
        elapsed = time.monotonic() - started
        for sock in slow:
            sock.close()
        statuses = sorted(reply[9:12] for reply in replies)
        assert statuses == [b"408"] * 10 + [b"503"] * 2, [r[:40] for r in replies]
        assert elapsed < 10
        assert httpx.get(base + "/health", timeout=5).status_code == 200


def test_more_choices_than_the_queue_is_a_400(probe: Probe) -> None:
    """Item 10: 300 prompts, or 100 prompts x n 16, on an idle server with --max-queue 256."""
    with serving(probe) as base:
        for body in ({"prompt": ["Once"] * 300}, {"prompt": ["Once"] * 100, "n": 16}):
            response = httpx.post(base + "/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
            assert response.status_code == 400, response.text
            assert "retry-after" not in response.headers
            assert "more than --max-queue (256)" in response.json()["error"]["message"]


def test_a_connection_cap_past_the_open_file_limit_is_refused(probe: Probe) -> None:
    """Item 6: accepted, it let idle clients run the server out of files (/health timed out)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no open-file limit here")
    out = probe.cli("serve", probe.base, "--port", 0, "--max-connections", soft)
    refused(out, 2)
    assert f"--max-connections {soft} is more than this process can open" in out.error_line
    assert out.hint.startswith(f"Hint: pass --max-connections {soft - 64} or less")


def test_a_kv_pool_past_ulimit_v_is_one_error(probe: Probe) -> None:
    """Item 8: ``serve --kv-memory 10GB`` under ``ulimit -v 6000000`` exited 3."""
    limited = "import resource; resource.setrlimit(resource.RLIMIT_AS, (6_000_000 * 1024, -1)); " + CLI
    out = Child(["serve", probe.base, "--port", 0, "--kv-memory", "10GB"], probe.root, probe.env, code=limited).finish()
    refused(out, 2)
    assert "ulimit -v" in out.error_line and out.hint, out.describe()


def test_a_pull_deadline_holds_against_a_silent_server(probe: Probe) -> None:
    """Item 11: ``--deadline 1`` failed after 32.5 s (a whole read timeout past it)."""
    with socket.socket() as silent:  # connects, takes the request, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/artifact"
        out = probe.cli("pull", url, "-o", probe.root / "pulled", "--deadline", 1)
    refused(out, 2)
    match = re.search(r"passed its deadline of 1 s \(0 bytes in ([\d.]+) s\)", out.error_line)
    assert match is not None and float(match[1]) < 2.5, out.describe()
    assert not (probe.root / "pulled").exists()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["serve", "ART", "--idle-timeout", "0"], {}, "--idle-timeout must be a finite number of seconds > 0"),
        (["serve", "ART", "--max-queue", "0"], {}, "--max-queue must be a positive integer"),
        (["serve", "ART", "--block-size", "100000"], {}, "--block-size 100000 is more than the context of"),
        (["pull", "http://127.0.0.1:9/a", "--min-rate", "-1"], {}, "min_rate (--min-rate) must be a finite number"),
        (["pull", "http://127.0.0.1:9/a"], {"SQUEEZE_PULL_DEADLINE": "soon"}, "$SQUEEZE_PULL_DEADLINE must be a"),
    ],
)
def test_serve_and_pull_refusals_carry_a_hint(probe: Probe, args: list[str], env: dict, message: str) -> None:
    """Item 12: each of these was an Error line without a Hint."""
    probe.env = {**probe.env, **env}
    command = [probe.base if arg == "ART" else arg for arg in args]
    out = probe.cli(*command, *(["--port", 0] if args[0] == "serve" else ["-o", probe.root / "out"]))
    refused(out, 2)
    assert message in out.error_line and out.hint, out.describe()
