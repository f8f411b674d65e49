"""The listening side of ``squeeze serve``: bind its socket before the model loads, announce the server in
one line, and run uvicorn (and the engine's loop) until SIGINT or SIGTERM."""

from __future__ import annotations

import errno
import signal
import socket
import threading
from typing import Any

from squeeze import api
from squeeze.api import support
from squeeze.errors import ConfigError

#: uvicorn's default listen backlog.
BACKLOG = 2048


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (SO_REUSEADDR: a restart need not wait for TIME_WAIT);
    ConfigError when the port is taken or the address cannot be used."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"cannot listen on host {host!r}: {exc.strerror}", hint="pass --host 127.0.0.1, 0.0.0.0 or ::"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is already in use",
                hint="stop the process that holds it, or pass another --port (0 picks a free one)",
            ) from None
        raise ConfigError(
            f"cannot listen on {host} port {port}: {exc.strerror or exc}",
            hint="ports below 1024 need privileges; --host must be an address of this machine",
        ) from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def startup_info(engine: Any, *, url: str, model: str, kv_dynamic: bool, verified: bool) -> dict[str, Any]:
    """What the startup line (or ``--json``) tells: where, what model, and how the KV cache is laid out."""
    stats = engine.stats()
    return {
        "url": f"{url}/v1",
        "model": model,
        "max_model_len": engine.max_model_len,
        "kv_bits": stats.kv_bits,
        "kv_cache": stats.kv_cache or ("16-bit" if stats.kv_bits == 16 else f"int{stats.kv_bits}"),
        "kv_bytes_per_token": stats.kv_bytes_per_token,
        "kv_dynamic": kv_dynamic,
        "kv_blocks": stats.kv_blocks_total,
        "block_size": stats.block_size,
        "kv_pool_bytes": stats.kv_pool_bytes,
        "verified": verified,
    }


def startup_line(info: dict[str, Any], *, api_key: bool) -> str:
    """``Serving stories on http://127.0.0.1:8000/v1 | KV cache int8, 4096 blocks x 16 tokens (1.00 GiB) | ...``"""
    kv = info["kv_cache"] + (" dynamic" if info["kv_dynamic"] else "")
    return (
        f"Serving {info['model']} on {info['url']} | KV cache {kv} ({info['kv_bytes_per_token']} B/token), "
        f"{info['kv_blocks']} blocks x "
        f"{info['block_size']} tokens ({_size(info['kv_pool_bytes'])}) | context {info['max_model_len']} | "
        f"API key {'required' if api_key else 'off'} | Ctrl-C or SIGTERM stops"
    )


def run_server(
    app: Any,
    sock: socket.socket,
    shutdown_grace: float,
    *,
    engine: Any = None,
    max_connections: int | None = None,
    idle_timeout: float = support.SERVE_IDLE_TIMEOUT,
) -> bool:
    """Serve ``app`` on ``sock`` until SIGINT / SIGTERM; False when the app failed to start (uvicorn logged why).

    With an ``engine`` that can run its loop in the calling thread (squeeze.serve.engine.engine.Engine.run), the
    engine runs here, in the main thread, and uvicorn in a second thread (the engine steps ~1.5x faster in
    the thread that loaded the model: see Engine.run); the signals then stop uvicorn, whose shutdown stops
    the engine. Otherwise uvicorn runs here, and re-raises the signal that stopped it once it has restored
    the handlers it found: pointing those at its own (now idle) handler keeps a graceful stop an exit 0
    instead of a death by SIGTERM / a KeyboardInterrupt.
    """
    server = api.serve_uvicorn_server(
        app, shutdown_grace=shutdown_grace, max_connections=max_connections, idle_timeout=idle_timeout
    )
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if callable(getattr(engine, "run", None)):
            engine.claim_loop()  # before uvicorn's lifespan calls engine.start()
            http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="squeeze-http")
            http.start()
            try:
                engine.run(until=lambda: not http.is_alive())  # uvicorn gone (failed start): stop too
            finally:
                server.should_exit = True
                http.join()
        else:
            server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.started


__all__ = ["BACKLOG", "bind_socket", "run_server", "startup_info", "startup_line", "url_of"]
