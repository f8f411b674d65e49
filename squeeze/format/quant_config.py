"""The two constants every reader and writer of ``config.json``'s ``quantization_config`` agrees on."""

from __future__ import annotations

#: Version of the layout of ``quantization_config`` and the tensors it names; readers refuse any other.
FORMAT_VERSION = 1
#: ``quantization_config.quant_method`` of every squeeze artifact: what transformers dispatches on.
QUANT_METHOD = "squeeze"

__all__ = ["FORMAT_VERSION", "QUANT_METHOD"]
