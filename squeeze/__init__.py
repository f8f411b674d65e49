"""squeeze: offline SqueezeLLM compression for Hugging Face causal LMs, with a verifying runtime."""

from __future__ import annotations

from squeeze.api import (  # noqa: E402
    calibrate_kv,
    compress,
    evaluate,
    evaluate_tasks,
    generate,
    inspect,
    load,
    register,
    verify_model_integrity,
)
from squeeze.errors import (  # noqa: E402
    CalibrationError,
    ConfigError,
    FormatError,
    IntegrityError,
    Interrupted,
    LockError,
    ModelError,
    ResourceError,
    ResumeError,
    SqueezeError,
    TransferError,
)
from squeeze.runtime import hf_hook as _hf_hook  # noqa: E402
from squeeze.version import __version__

# `AutoModelForCausalLM.from_pretrained(artifact_dir)` after `import squeeze`: registers the "squeeze"
# quantization method with transformers once its quantizer registry is imported (not before: seconds).
_hf_hook.install()

__all__ = [
    "__version__",
    "verify_model_integrity",
    "inspect",
    "compress",
    "calibrate_kv",
    "evaluate",
    "evaluate_tasks",
    "register",
    "generate",
    "load",
    "SqueezeError",
    "ConfigError",
    "ModelError",
    "CalibrationError",
    "FormatError",
    "IntegrityError",
    "ResourceError",
    "LockError",
    "ResumeError",
    "Interrupted",
    "TransferError",
]
