"""What the CLI needs beyond the verbs: the options objects it builds from its flags, the constants of its
defaults, the cheap checks it runs before a verb, and the result types it annotates with.

The verbs themselves live in squeeze.api (artifact, compress, run, serve, eval); everything here is a name
defined elsewhere in squeeze, gathered so that a front end imports the library from two places only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from squeeze.config import DEFAULT_SINK_TOKENS, parse_size
from squeeze.format.inspect import ArtifactInfo
from squeeze.format.paths import short_path
from squeeze.format.verify import VerifyReport
from squeeze.limits import MIN_SEQ_LEN
from squeeze.quant.kv_spec import KV_FP8_E4M3
from squeeze.runtime.activations import ACTIVATIONS, DEFAULT_ACTIVATIONS, Activations, check_activations
from squeeze.runtime.options import KVOptions, LoadOptions
from squeeze.runtime.sampling_params import SamplingParams
from squeeze.runtime.speculation import SpeculationOptions
from squeeze.serve.http.connection_limits import DEFAULT_IDLE_TIMEOUT as SERVE_IDLE_TIMEOUT
from squeeze.serve.http.open_files import check_max_connections as check_serve_max_connections
from squeeze.serve.types import EngineConfig

if TYPE_CHECKING:  # `X as X`: re-exported for type checkers (the CLI annotates with them); not loaded at run time
    from squeeze.compression.plan import CompressPlan as CompressPlan
    from squeeze.compression.runner import CompressResult as CompressResult
    from squeeze.eval.compare import EvalResult as EvalResult
    from squeeze.format.signature import SignatureInfo as SignatureInfo
    from squeeze.format.signature import SignResult as SignResult
    from squeeze.runtime.generation_result import GenerationResult as GenerationResult

__all__ = [
    "parse_size",
    "short_path",
    "DEFAULT_SINK_TOKENS",
    "MIN_SEQ_LEN",
    "KV_FP8_E4M3",
    "Activations",
    "ACTIVATIONS",
    "DEFAULT_ACTIVATIONS",
    "check_activations",
    "SamplingParams",
    "SpeculationOptions",
    "LoadOptions",
    "KVOptions",
    "EngineConfig",
    "SERVE_IDLE_TIMEOUT",
    "check_serve_max_connections",
    "VerifyReport",
    "ArtifactInfo",
]
