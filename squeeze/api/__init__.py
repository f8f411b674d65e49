"""The public face of squeeze: every verb of the CLI is one function here, one module per verb family.

- :mod:`squeeze.api.artifact`: verify, sign, inspect, pull, push (and ``local_artifact``);
- :mod:`squeeze.api.compress`: compress, plan_compress, calibrate_kv;
- :mod:`squeeze.api.run`: load, generate, and ``register`` (transformers / lm-eval integration);
- :mod:`squeeze.api.serve`: serve_engine and the HTTP app and server over it;
- :mod:`squeeze.api.eval`: evaluate (perplexity), evaluate_tasks (lm-evaluation-harness);
- :mod:`squeeze.api.support`: what a front end needs beyond the verbs (options objects, constants, checks).

Heavier stages (models, calibration, quantization, runtime) are imported inside the verbs that need them, so
``import squeeze`` stays light and verify works without loading transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from squeeze.api.artifact import inspect, local_artifact, pull, push, sign, verify_model_integrity
from squeeze.api.compress import (
    builtin_calibration_specs,
    builtin_recipes,
    calibrate_kv,
    check_calibrate_kv_options,
    compress,
    compress_world,
    plan_compress,
)
from squeeze.api.eval import evaluate, evaluate_tasks
from squeeze.api.run import check_generate_options, check_prompts, generate, load, loading, register, set_activations
from squeeze.api.serve import (
    check_engine_config,
    create_serve_app,
    serve_engine,
    serve_uvicorn_config,
    serve_uvicorn_server,
)

# Every name of squeeze.api.support: its __all__ is the one list of them, imported and re-exported from it. mypy
# does not follow `*support.__all__`; it takes support's names as exported from `import __all__ as __all__` (which
# binds support's list: the assignment below builds a new one, so support.__all__ is never changed).
from squeeze.api.support import *  # noqa: F403
from squeeze.api.support import __all__ as __all__

__all__ = [
    # the verbs (squeeze/__init__ exports them too)
    "verify_model_integrity",
    "sign",
    "inspect",
    "pull",
    "push",
    "local_artifact",
    "compress",
    "plan_compress",
    "compress_world",
    "calibrate_kv",
    "check_calibrate_kv_options",
    "builtin_recipes",
    "builtin_calibration_specs",
    "load",
    "loading",
    "set_activations",
    "generate",
    "check_generate_options",
    "check_prompts",
    "register",
    "serve_engine",
    "check_engine_config",
    "create_serve_app",
    "serve_uvicorn_config",
    "serve_uvicorn_server",
    "evaluate",
    "evaluate_tasks",
    # squeeze.api.support: what a front end needs beyond the verbs
    *__all__,
]

if TYPE_CHECKING:  # `X as X`: the result types, for type checkers (squeeze.api.support holds them too)
    from squeeze.compression.plan import CompressPlan as CompressPlan
    from squeeze.compression.runner import CompressResult as CompressResult
    from squeeze.format.signature import SignatureInfo as SignatureInfo
    from squeeze.format.signature import SignResult as SignResult
    from squeeze.runtime.generation_result import GenerationResult as GenerationResult
