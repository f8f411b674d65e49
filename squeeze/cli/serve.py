"""``squeeze serve``: an OpenAI-compatible HTTP server over an artifact (continuous batching, paged KV cache).

Order: the options are checked, then the listening socket is bound (a port in use fails in a second, not
after the model has loaded), then the artifact is verified and loaded, then uvicorn serves until SIGINT or
SIGTERM: it stops accepting, lets open requests finish for up to --shutdown-grace seconds, and the app's
shutdown gives the engine the same grace before the process exits 0.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import socket
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from squeeze import api
from squeeze.api import support
from squeeze.cli.common import PublicKey, cli_errors, err_console
from squeeze.cli.run import (  # the options squeeze run has too, declared once
    UNVERIFIED_WARNING,
    ActivationsOpt,
    Dense,
    KvBits,
    KvDynamic,
    LowMemory,
    NoVerify,
    SpeculateOpt,
)
from squeeze.cli.server import bind_socket, run_server, startup_info, startup_line, url_of
from squeeze.errors import ConfigError

#: What ``squeeze serve`` imports beyond squeeze's own dependencies (the ``serve`` extra).
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def check_serve_dependencies() -> None:
    """ConfigError naming the extra to install when fastapi, uvicorn or prometheus_client is missing."""
    for name in SERVE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(
                "squeeze serve needs fastapi, uvicorn and prometheus-client",
                hint=f'pip install "squeeze[serve]" ({name} is not importable: {exc})',
            ) from exc


def engine_config(
    *,
    kv_bits: int | None,
    kv_dynamic: bool,
    kv_memory: str,
    block_size: int,
    max_num_seqs: int,
    max_batch_tokens: int,
    max_model_len: int | None,
    max_queue: int,
    prefix_cache: bool = True,
    speculate: str = "off",
) -> Any:
    """The engine's options as an ``EngineConfig``, checked (api.check_engine_config); ConfigError naming the
    flag for a bad one."""
    try:
        kv_memory_bytes = support.parse_size(kv_memory)
    except ConfigError as exc:
        raise ConfigError(f"--kv-memory: {exc.message}", hint=exc.hint or "e.g. --kv-memory 1GiB") from None
    config = support.EngineConfig(
        kv=support.KVOptions(kv_bits, kv_dynamic),
        kv_memory_bytes=kv_memory_bytes,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_batch_tokens=max_batch_tokens,
        max_model_len=max_model_len,
        max_queue=max_queue,
        prefix_cache=prefix_cache,
        speculation=support.SpeculationOptions.parse(speculate),
    )
    api.check_engine_config(config)
    return config


def check_server_options(
    *,
    port: int,
    shutdown_grace: float,
    api_key: str | None,
    max_connections: int | None = None,
    idle_timeout: float = support.SERVE_IDLE_TIMEOUT,
    threads: int | None = None,
) -> None:
    """ConfigError for a port outside 0-65535, a negative or infinite grace, an empty API key, a connection cap
    below 1, an idle timeout that is not a positive finite number of seconds, or fewer than one thread."""
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be at least 1, found {threads}", hint="leave it out to use every core")
    if max_connections is not None:
        support.check_serve_max_connections(max_connections)  # at least 1, and below the open-file limit
    if not (math.isfinite(idle_timeout) and idle_timeout > 0):
        raise ConfigError(
            f"--idle-timeout must be a finite number of seconds > 0, found {idle_timeout}",
            hint=f"e.g. --idle-timeout {support.SERVE_IDLE_TIMEOUT:g} (the default)",
        )
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be in 0-65535, found {port}", hint="0 picks a free port")
    if not (math.isfinite(shutdown_grace) and shutdown_grace >= 0):
        raise ConfigError(
            f"--shutdown-grace must be a finite number of seconds >= 0, found {shutdown_grace}",
            hint="e.g. --shutdown-grace 10 (the default; 0 cuts open requests at once)",
        )
    if api_key is not None and not api_key.strip():
        raise ConfigError(
            "the API key (--api-key or SQUEEZE_API_KEY) is empty",
            hint="pass a non-empty key, or unset SQUEEZE_API_KEY to serve without one",
        )


def request_bytes(text: str | None) -> int | None:
    """``--max-request-bytes`` as bytes (None: the default from the context); ConfigError naming the flag."""
    if text is None:
        return None
    try:
        value = support.parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"--max-request-bytes: {exc.message}", hint=exc.hint or "e.g. 4MB") from None
    if value < 1024:
        raise ConfigError(f"--max-request-bytes must be at least 1KB, found {value} bytes", hint="e.g. 4MB")
    return value


def contention_hint(threads: int | None) -> str | None:
    """A line for a machine already busy when the server starts (its 1-minute load average): torch's OpenMP
    threads spin while they wait for each other, and one that another process deschedules stalls every
    parallel region (measured: docs/benchmarks.md, "Serving"). None when it is quiet, or OMP_WAIT_POLICY is set."""
    if "OMP_WAIT_POLICY" in os.environ or not hasattr(os, "getloadavg"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = round(os.getloadavg()[0])
    if busy < 1 or (threads or cores) + busy <= cores:
        return None
    return (
        f"other processes keep {min(busy, cores)} of {cores} cores busy (load average {os.getloadavg()[0]:.1f}): "
        f"waiting kernel threads spin and stall each step; start squeeze serve with OMP_WAIT_POLICY=PASSIVE in "
        f"its environment, or pass --threads {max(1, cores - busy)}"
    )


# The options as Annotated aliases, so that the command's signature is one short line per option.
Artifact = Annotated[Path, typer.Argument(help="The artifact directory (written by squeeze compress).")]
Host = Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")]
Port = Annotated[int, typer.Option("--port", help="TCP port (0 picks a free one).")]
KvMemory = Annotated[
    str, typer.Option("--kv-memory", help="Memory of the paged KV pool, all layers (e.g. 1GiB, 512MB).")
]
BlockSize = Annotated[int, typer.Option("--block-size", help="Tokens per KV block.")]
MaxNumSeqs = Annotated[int, typer.Option("--max-num-seqs", help="Sequences in one batch at most.")]
MaxBatchTokens = Annotated[
    int, typer.Option("--max-batch-tokens", help="Tokens one model step takes at most (decode first, then prompts).")
]
MaxModelLen = Annotated[
    Optional[int],
    typer.Option("--max-model-len", help="Context a request may use: prompt + max_tokens (default: the model's)."),
]
MaxQueue = Annotated[int, typer.Option("--max-queue", help="Requests waiting at most; more get HTTP 429.")]
NoPrefixCache = Annotated[
    bool,
    typer.Option(
        "--no-prefix-cache", help="Compute every prompt in full (default: reuse the KV blocks of shared prefixes)."
    ),
]
ApiKey = Annotated[
    Optional[str],
    typer.Option(
        "--api-key",
        envvar="SQUEEZE_API_KEY",
        show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics (/health stays open).",
    ),
]
ServedModelName = Annotated[
    Optional[str], typer.Option("--served-model-name", help="The model name clients use (default: the artifact's).")
]
ShutdownGrace = Annotated[
    float,
    typer.Option("--shutdown-grace", help="Seconds open requests may run on after SIGINT/SIGTERM before they are cut."),
]
MaxRequestBytes = Annotated[
    Optional[str],
    typer.Option(
        "--max-request-bytes",
        help="Largest request body (e.g. 4MB); bigger ones get HTTP 413 unread (default: 32 bytes per token of "
        "context + 1 MiB).",
    ),
]
MaxConnections = Annotated[
    Optional[int],
    typer.Option(
        "--max-connections",
        help="Open connections at most; more get HTTP 503 (default: the open-file limit less 64).",
    ),
]
IdleTimeout = Annotated[
    float,
    typer.Option(
        "--idle-timeout",
        help="Seconds a connection may stay open without sending a whole request head; a request body gets as "
        "long plus 1 s per 64 KiB (then HTTP 408).",
    ),
]
Threads = Annotated[
    Optional[int],
    typer.Option(
        "--threads",
        help="Threads of the model's kernels (default: every core). Beside other CPU-bound processes, the cores "
        "left free (their thread pools wait for a descheduled thread at every parallel region).",
    ),
]
JsonOut = Annotated[
    bool, typer.Option("--json", help="Print the startup information as one JSON line on stdout (not stderr).")
]


def serve(
    ctx: typer.Context,
    artifact: Artifact,
    host: Host = "127.0.0.1",
    port: Port = 8000,
    kv_bits: KvBits = None,
    kv_dynamic: KvDynamic = False,
    kv_memory: KvMemory = "1GiB",
    block_size: BlockSize = 16,
    max_num_seqs: MaxNumSeqs = 32,
    max_batch_tokens: MaxBatchTokens = 512,
    max_model_len: MaxModelLen = None,
    max_queue: MaxQueue = 256,
    no_prefix_cache: NoPrefixCache = False,
    api_key: ApiKey = None,
    served_model_name: ServedModelName = None,
    no_verify: NoVerify = False,
    shutdown_grace: ShutdownGrace = 10.0,
    dense: Dense = False,
    low_memory: LowMemory = False,
    activations: ActivationsOpt = support.DEFAULT_ACTIVATIONS,
    speculate: SpeculateOpt = "off",
    threads: Threads = None,
    json_out: JsonOut = False,
    public_key: PublicKey = None,
    max_request_bytes: MaxRequestBytes = None,
    max_connections: MaxConnections = None,
    idle_timeout: IdleTimeout = support.SERVE_IDLE_TIMEOUT,
) -> None:
    """Serve an artifact over OpenAI's HTTP API: /v1/completions, /v1/chat/completions (streaming or not; n,
    logprobs, echo), /v1/models, vLLM's /tokenize, /detokenize and /tokenizer_info, /health and /metrics.

    Requests share the model through continuous batching over a paged KV cache (int8/int4 with --kv-bits).
    SIGINT or SIGTERM stops the server gracefully (exit 0).
    """
    options = ctx.params  # every parameter by name, as parsed
    with cli_errors():
        load, config, body_cap = _checked(options)
        sock = bind_socket(host, port)  # before the model loads: a port in use fails at once
        if threads is not None:
            import torch

            torch.set_num_threads(threads)  # the native kernels run torch.get_num_threads() threads too
        hint = contention_hint(threads)  # measured before loading adds to the load average; shown once it loaded
        try:
            engine, app, info = _start(options, sock, load, config, body_cap)
        except BaseException:
            sock.close()
            raise
        _announce(info, hint, json_out=json_out, api_key=api_key)
        try:
            started = run_server(
                app, sock, shutdown_grace, engine=engine, max_connections=max_connections, idle_timeout=idle_timeout
            )
        finally:
            sock.close()
        if not started:
            err_console.print("[bold red]Error:[/] the server did not start: the engine failed (see the log above)")
            raise typer.Exit(1)


def _checked(options: dict[str, Any]) -> tuple[support.LoadOptions, Any, int | None]:
    """Every option checked before the socket is bound (each options object once, when built: api.serve_engine
    and the loader take them as they are): (load options, engine config, --max-request-bytes or None)."""
    load = support.LoadOptions(
        verify=not options["no_verify"],
        dense_cache=options["dense"],
        low_memory=options["low_memory"],
        public_key=options["public_key"],
        activations=options["activations"],
    )
    config = engine_config(
        kv_bits=options["kv_bits"],
        kv_dynamic=options["kv_dynamic"],
        kv_memory=options["kv_memory"],
        block_size=options["block_size"],
        max_num_seqs=options["max_num_seqs"],
        max_batch_tokens=options["max_batch_tokens"],
        max_model_len=options["max_model_len"],
        max_queue=options["max_queue"],
        prefix_cache=not options["no_prefix_cache"],
        speculate=options["speculate"],
    )
    check_server_options(
        port=options["port"],
        shutdown_grace=options["shutdown_grace"],
        api_key=options["api_key"],
        max_connections=options["max_connections"],
        idle_timeout=options["idle_timeout"],
        threads=options["threads"],
    )
    body_cap = request_bytes(options["max_request_bytes"])
    check_serve_dependencies()
    return load, config, body_cap


def _start(
    options: dict[str, Any], sock: socket.socket, load: support.LoadOptions, config: Any, body_cap: int | None
) -> tuple[Any, Any, dict[str, Any]]:
    """The engine loaded (verified unless --no-verify), its app, and the startup information."""
    if options["no_verify"]:
        err_console.print(UNVERIFIED_WARNING, style="yellow", soft_wrap=True, markup=False)
    engine = api.serve_engine(options["artifact"], config=config, load=load)
    served_model_name = options["served_model_name"]
    app = _app(engine, options["api_key"], served_model_name, options["shutdown_grace"], body_cap)
    model = served_model_name or engine.model_name
    info = startup_info(
        engine, url=url_of(sock), model=model, kv_dynamic=options["kv_dynamic"], verified=not options["no_verify"]
    )
    return engine, app, info


def _app(
    engine: Any, api_key: str | None, served_model_name: str | None, shutdown_grace: float, body_cap: int | None
) -> Any:
    """The OpenAI-compatible app over ``engine``; ``body_cap``: --max-request-bytes (None: from the context)."""
    # only when given: api.create_serve_app stand-ins predate the option
    app_options: dict[str, Any] = {"max_request_bytes": body_cap} if body_cap is not None else {}
    return api.create_serve_app(
        engine,
        api_key=api_key,
        served_model_name=served_model_name,
        shutdown_grace_seconds=shutdown_grace,
        **app_options,
    )


def _announce(info: dict[str, Any], hint: str | None, *, json_out: bool, api_key: str | None) -> None:
    """The load-average note, then the startup information: one JSON line on stdout, or a line on stderr."""
    if hint is not None:  # after every refusal: an error stays the one line it is
        err_console.print(f"Note: {hint}", style="yellow", soft_wrap=True, markup=False)
    if json_out:
        sys.stdout.write(json.dumps(info) + "\n")
        sys.stdout.flush()
    else:
        err_console.print(startup_line(info, api_key=api_key is not None), soft_wrap=True, markup=False)


__all__ = ["serve", "check_serve_dependencies", "engine_config", "bind_socket", "run_server"]
