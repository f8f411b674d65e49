"""The quantized KV cache, under its public name.

``SqueezeKVCache(spec)`` is a transformers ``Cache`` storing int8 / packed int4 codes; ``spec`` is an
artifact's calibrated :class:`KVSpec` (``squeeze.load(path).kv_spec``) or ``KVSpec.dynamic(bits, names)``.
The implementation lives in squeeze.runtime.quantized_cache and squeeze.quant.kv.
"""

from squeeze.quant.kv_bytes import kv_bytes_table
from squeeze.quant.kv_spec import KVSpec
from squeeze.runtime.kv_selection import select_kv_spec
from squeeze.runtime.quantized_cache import SqueezeKVCache, SqueezeKVLayer

__all__ = ["SqueezeKVCache", "SqueezeKVLayer", "KVSpec", "select_kv_spec", "kv_bytes_table"]
