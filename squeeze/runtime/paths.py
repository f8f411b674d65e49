"""Which path a model's quantized linears run (``SqueezeLinear.weight_path``), counted and said in one line.

``squeeze run`` ends with it and ``api.generate``'s result carries it, so a run says whether its weights
stayed compressed (``native-avx512``, ``triton``) or ran dequantized (``dense``, ``chunked``).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from squeeze.runtime.linear import SqueezeLinear

NO_QUANTIZED = "no quantized linears"


def weight_paths(model: nn.Module) -> dict[str, int]:
    """SqueezeLinear modules of ``model`` per ``weight_path``, in the order each path first appears."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, SqueezeLinear):
            path = module.weight_path
            counts[path] = counts.get(path, 0) + 1
    return counts


def describe_weight_paths(counts: Mapping[str, int]) -> str:
    """``native-avx512 (210 linears)``, ``native-avx512 (168 linears), dense (42 linears)``, or
    ``no quantized linears`` when ``counts`` is empty."""
    if not counts:
        return NO_QUANTIZED
    return ", ".join(f"{path} ({n} linear{'s' if n != 1 else ''})" for path, n in counts.items())


__all__ = ["weight_paths", "describe_weight_paths", "NO_QUANTIZED"]
