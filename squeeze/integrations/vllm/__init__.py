"""The out-of-tree vLLM plugin: ``vllm serve ARTIFACT`` and ``LLM(model=ARTIFACT)`` run squeeze artifacts.

vLLM calls :func:`register` in every process it starts (entry point ``vllm.general_plugins``, installed with
squeeze). It registers the quantization method "squeeze" (picked from config.json's
``quantization_config.quant_method``) and the load format "squeeze" (``--load-format squeeze``: vLLM loads
exactly the bytes squeeze verified). Without vLLM installed, registering does nothing.
"""

from __future__ import annotations

import importlib.util

_registered = False


def register() -> None:
    """Register squeeze's quantization method and load format with vLLM (idempotent; no-op without vLLM)."""
    global _registered
    if _registered or importlib.util.find_spec("vllm") is None:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.model_loader import register_model_loader

    from squeeze.format.quant_config import QUANT_METHOD
    from squeeze.integrations.vllm.load_format import LOAD_FORMAT, SqueezeModelLoader
    from squeeze.integrations.vllm.quant_method import SqueezeVllmConfig
    from squeeze.runtime import hf_hook

    hf_hook.install()  # squeeze.register()'s transformers half: `import squeeze` registers nothing by itself
    register_quantization_config(QUANT_METHOD)(SqueezeVllmConfig)
    register_model_loader(LOAD_FORMAT)(SqueezeModelLoader)
    _registered = True


__all__ = ["register"]
