"""The serve verbs: an artifact loaded into a serving engine, the OpenAI-compatible app over it, and the
uvicorn server ``squeeze serve`` runs it under."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from squeeze.api.artifact import local_artifact
from squeeze.runtime.options import LoadOptions, split_keywords
from squeeze.serve.http.connection_limits import DEFAULT_IDLE_TIMEOUT as SERVE_IDLE_TIMEOUT
from squeeze.serve.types import EngineConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from squeeze.serve.engine.engine import Engine
    from squeeze.serve.types import EngineClient


def serve_engine(
    path: str | os.PathLike[str],
    *,
    config: EngineConfig | None = None,
    load: LoadOptions | None = None,
    model_name: str | None = None,
    **load_options: Any,
) -> Engine:
    """Load an artifact (verified unless ``verify=False``) into a serving engine: continuous batching over a
    paged KV cache (squeeze.serve). Start it with ``engine.start()``, or hand it to
    ``squeeze.serve.http.app.create_app`` (what ``squeeze serve`` does).

    ``config``: the KV cache and batching options (EngineConfig; checked before anything loads, ConfigError).
    Its ``kv_bits`` None takes the artifact's calibrated KV cache when it has one, else full precision;
    4 / 8 need calibrated scales unless ``kv_dynamic``. ``model_name``: what the API reports (default: the
    artifact directory's name). ConfigError when the KV memory cannot hold one full-context sequence.
    ``load``: the :class:`LoadOptions` (or its keywords: ``verify``, ``dense_cache``, ``low_memory``,
    ``public_key``, ``activations``), as in :func:`load`.
    """
    from pathlib import Path

    from squeeze.runtime.loader import load_or_place
    from squeeze.runtime.memory import allocation_refused
    from squeeze.serve.engine.engine import Engine

    config = config if config is not None else EngineConfig()
    check_engine_config(config)
    load = LoadOptions.build(load, split_keywords(load_options, LoadOptions)[0])
    # a URL or repo id names the model by its last part, not by its directory in the cache
    name = model_name or Path(os.fspath(path).rstrip("/")).resolve().name
    source = local_artifact(path, public_key=load.public_key)  # a URL or hf:// id pulled into the cache first
    loaded, _ = load_or_place(source, load)
    kv_spec = config.kv.spec_for(loaded.model, loaded.kv_spec)  # the KV options were checked when built
    try:
        return Engine(loaded.model, loaded.tokenizer, config, kv_spec, model_name=name)
    except (RuntimeError, MemoryError) as exc:  # the preflight cannot see every limit (overcommit, other processes)
        refused = allocation_refused(exc, config.kv_memory_bytes)
        if refused is None:
            raise
        raise refused from None


def check_engine_config(config: EngineConfig) -> None:
    """ResourceError when ``config``'s KV pool is more than the memory available now: what :func:`serve_engine`
    checks before anything loads. (The options themselves were checked when the EngineConfig was built:
    ConfigError naming the ``squeeze serve`` flag.)"""
    from squeeze.runtime.memory import check_kv_memory_available

    check_kv_memory_available(config.kv_memory_bytes)


def create_serve_app(
    engine: EngineClient,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    shutdown_grace_seconds: float = 10.0,
    max_request_bytes: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible HTTP app over ``engine`` (:func:`squeeze.serve.http.app.create_app`; needs the
    ``serve`` extra: fastapi, uvicorn, prometheus-client). ``max_request_bytes``: the body cap (default: from
    the engine's context, squeeze.serve.http.connection_limits.default_max_request_bytes)."""
    from squeeze.serve.http.app import create_app

    return create_app(
        engine,
        api_key=api_key,
        served_model_name=served_model_name,
        shutdown_grace_seconds=shutdown_grace_seconds,
        max_request_bytes=max_request_bytes,
    )


def serve_uvicorn_config(
    app: Any,
    *,
    shutdown_grace: float,
    max_connections: int | None = None,
    idle_timeout: float = SERVE_IDLE_TIMEOUT,
) -> Any:
    """The ``uvicorn.Config`` squeeze serve runs ``app`` under
    (:func:`squeeze.serve.http.uvicorn_server.uvicorn_config`): a connection that sends no whole request head
    within ``idle_timeout`` seconds is closed (a body that does not follow its head within as long plus 1 s per
    64 KiB is answered 408 and closed), connections past ``max_connections``
    (default: the open-file limit less 64) are answered 503."""
    from squeeze.serve.http.uvicorn_server import uvicorn_config

    return uvicorn_config(
        app, shutdown_grace=shutdown_grace, max_connections=max_connections, idle_timeout=idle_timeout
    )


def serve_uvicorn_server(
    app: Any,
    *,
    shutdown_grace: float,
    max_connections: int | None = None,
    idle_timeout: float = SERVE_IDLE_TIMEOUT,
) -> Any:
    """The ``uvicorn.Server`` squeeze serve runs: :func:`serve_uvicorn_config`'s, on an event loop that logs
    failed accepts (out of open files) as one line per 10 s rather than a traceback per try. ConfigError when
    ``max_connections`` is more than the open-file limit less 64 allows."""
    from squeeze.serve.http.uvicorn_server import uvicorn_server

    config = serve_uvicorn_config(
        app, shutdown_grace=shutdown_grace, max_connections=max_connections, idle_timeout=idle_timeout
    )
    return uvicorn_server(config)


__all__ = ["serve_engine", "check_engine_config", "create_serve_app", "serve_uvicorn_config", "serve_uvicorn_server"]
