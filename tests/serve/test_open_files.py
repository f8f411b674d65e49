"""squeeze serve and the open-file limit (issue 50 item 6): a connection cap the limit cannot hold is refused,
and failed accepts are logged as one line per interval, not a traceback per try."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource

import pytest

from squeeze.errors import ConfigError
from squeeze.serve.http import open_files
from squeeze.serve.http.open_files import AcceptErrorLimiter, check_max_connections, default_max_connections


def with_limits(monkeypatch: pytest.MonkeyPatch, soft: int, hard: int) -> None:
    monkeypatch.setattr(open_files.resource, "getrlimit", lambda which: (soft, hard))


def test_the_cap_may_reach_the_limit_less_the_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    with_limits(monkeypatch, 1024, 4096)
    assert default_max_connections() == 1024 - open_files.RESERVED_FILES
    check_max_connections(1024 - open_files.RESERVED_FILES)  # accepted


def test_a_cap_above_the_open_file_limit_is_refused_with_the_ulimit_to_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    with_limits(monkeypatch, 1024, 4096)
    with pytest.raises(ConfigError) as caught:
        check_max_connections(2000)
    assert "--max-connections 2000" in caught.value.message and "is 1024" in caught.value.message
    assert caught.value.hint is not None
    assert "--max-connections 960 or less" in caught.value.hint and "ulimit -n 2064" in caught.value.hint


def test_past_the_hard_limit_the_hint_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    with_limits(monkeypatch, 1024, 1024)
    with pytest.raises(ConfigError) as caught:
        check_max_connections(1100)
    assert caught.value.hint is not None and "the hard limit is 1024" in caught.value.hint


def test_without_a_limit_any_cap_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    infinity = resource.RLIM_INFINITY
    with_limits(monkeypatch, infinity, infinity)
    check_max_connections(10**6)
    assert default_max_connections() == open_files.UNLIMITED_MAX_CONNECTIONS


@pytest.mark.parametrize("value", [0, -3])
def test_a_cap_below_one_is_refused_with_a_hint(value: int) -> None:
    with pytest.raises(ConfigError, match="at least 1") as caught:
        check_max_connections(value)
    assert caught.value.hint


def test_the_connection_config_refuses_it_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from squeeze.serve.http.uvicorn_server import uvicorn_config

    with_limits(monkeypatch, 256, 256)
    with pytest.raises(ConfigError, match="open-file limit"):
        uvicorn_config(object(), shutdown_grace=1, max_connections=500, configure_logging=False)


def accept_failure() -> dict:
    return {
        "message": "socket.accept() out of system resource",
        "exception": OSError(errno.EMFILE, "Too many open files"),
    }


def test_failed_accepts_are_logged_once_per_interval_without_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    limiter = AcceptErrorLimiter(interval=10.0, clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger="squeeze.serve"):
            for _ in range(2048):  # what asyncio's accept loop reports in one tick (its backlog)
                limiter(loop, accept_failure())
            now[0] += 9.9
            limiter(loop, accept_failure())
            now[0] += 0.2
            limiter(loop, accept_failure())
    finally:
        loop.close()
    lines = [r for r in caplog.records if r.name == "squeeze.serve"]
    assert len(lines) == 2
    assert all(r.exc_info is None for r in lines)
    assert "Too many open files" in lines[0].getMessage() and "--max-connections" in lines[0].getMessage()
    assert "(2048 more since the last report)" in lines[1].getMessage()


def test_other_loop_errors_go_to_the_previous_handler() -> None:
    seen: list[dict] = []
    limiter = AcceptErrorLimiter(lambda loop, context: seen.append(context))
    loop = asyncio.new_event_loop()
    try:
        other = {"message": "Task exception was never retrieved", "exception": RuntimeError("boom")}
        not_out_of_files = {"message": "socket.accept() failed", "exception": OSError(errno.EBADF, "Bad fd")}
        limiter(loop, other)
        limiter(loop, not_out_of_files)
    finally:
        loop.close()
    assert seen == [other, not_out_of_files]


def test_the_server_s_loop_limits_accept_errors() -> None:
    from squeeze.serve.http.uvicorn_server import uvicorn_config, uvicorn_server

    class App:
        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})

    server = uvicorn_server(uvicorn_config(App(), shutdown_grace=0, max_connections=1, configure_logging=False))
    handlers: list = []

    async def serve_briefly() -> None:
        server.should_exit = True  # serve starts, sees it, and stops
        await server.serve(sockets=[])
        handlers.append(asyncio.get_running_loop().get_exception_handler())

    asyncio.run(serve_briefly())
    assert isinstance(handlers[0], AcceptErrorLimiter)


CHILD = """
import os, resource, sys
from squeeze.serve.http.uvicorn_server import uvicorn_config, uvicorn_server

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})

import socket
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(2048)
server = uvicorn_server(uvicorn_config(app, shutdown_grace=0, max_connections=60, idle_timeout=30))
filler = []
try:  # leave 8 descriptors free: the connections then run the process out of files well below the cap
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    for fd in filler[-8:]:
        os.close(fd)
print(sock.getsockname()[1], flush=True)
server.run(sockets=[sock])
"""


def test_a_server_out_of_files_logs_a_line_not_a_flood(tmp_path) -> None:
    """The reproduction in small: more idle clients than the process has files left. asyncio's accept loop
    reported each failed accept with a traceback, up to the listen backlog per tick."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    stderr = tmp_path / "stderr"
    with open(stderr, "w") as errors:
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=errors, text=True)
    clients: list[socket.socket] = []
    try:
        port = int(child.stdout.readline())
        time.sleep(0.5)  # the server starts
        for _ in range(40):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(2.5)  # the accepts fail, and are retried, for a while
    finally:
        for client in clients:
            client.close()
        child.send_signal(signal.SIGTERM)
        child.wait(20)
    log = stderr.read_text()
    assert 1 <= log.count("cannot accept a connection: Too many open files") <= 2, log[-2000:]
    assert "Traceback" not in log and "out of system resource" not in log, log[-2000:]
