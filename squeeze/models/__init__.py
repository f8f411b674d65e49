"""Open a checkpoint (HF directory, hub id from the local cache, GGUF file) and find its target linears."""

from __future__ import annotations

from squeeze.models.modes import eval_mode, input_device
from squeeze.models.source import (
    BUILTIN_MODELS,
    ModelSource,
    SourceKind,
    hub_cache_dir,
    load_model,
    load_tokenizer,
    model_files,
    resolve_model,
    source_digest,
)
from squeeze.models.targets import find_target_linears

__all__ = [
    "BUILTIN_MODELS",
    "ModelSource",
    "SourceKind",
    "hub_cache_dir",
    "load_model",
    "load_tokenizer",
    "model_files",
    "resolve_model",
    "source_digest",
    "find_target_linears",
    "eval_mode",
    "input_device",
]
