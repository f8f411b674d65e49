"""Which path a model's quantized linears run (``SqueezeLinear.weight_path``), counted and said in one line.

Quantized MoE expert parameters (``SqueezeExperts.weight_path``) are counted apart, under ``<path>:experts``.

``squeeze run`` ends with it and ``api.generate``'s result carries it, so a run says whether its weights
stayed compressed (``native-avx512``, ``triton``) or ran dequantized (``dense``, ``chunked``).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from squeeze.runtime.activations import Activations, check_activations
from squeeze.runtime.experts import SqueezeExperts
from squeeze.runtime.linear import SqueezeLinear

NO_QUANTIZED = "no quantized linears"
EXPERTS_SUFFIX = ":experts"


def weight_paths(model: nn.Module) -> dict[str, int]:
    """SqueezeLinear modules of ``model`` per ``weight_path``, in the order each path first appears; quantized
    expert parameters (SqueezeExperts) per ``f"{weight_path}:experts"``."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, SqueezeLinear):
            path = module.weight_path
        elif isinstance(module, SqueezeExperts):
            path = module.weight_path + EXPERTS_SUFFIX
        else:
            continue
        counts[path] = counts.get(path, 0) + 1
    return counts


def set_activations(model: nn.Module, activations: Activations) -> int:
    """Switch every quantized linear and expert parameter of ``model`` to ``activations`` (``"int8"`` or
    ``"float32"``, squeeze.runtime.activations; ConfigError else) and prepare their kernels again; how many.

    For models built elsewhere (``AutoModelForCausalLM.from_pretrained``): :func:`squeeze.load` takes the
    option directly.
    """
    activations = check_activations(activations)
    count = 0
    for module in model.modules():
        if isinstance(module, (SqueezeLinear, SqueezeExperts)):
            module.activations = activations
            module.prepare_layout()
            count += 1
    return count


def describe_weight_paths(counts: Mapping[str, int]) -> str:
    """``native-avx512 (210 linears)``, ``native-avx512 (168 linears), dense (42 linears)``,
    ``native-avx512 (8 linears), native-avx512 (4 expert parameters)``, or ``no quantized linears`` when
    ``counts`` is empty."""
    if not counts:
        return NO_QUANTIZED
    parts = []
    for key, n in counts.items():
        path, experts, _ = key.partition(EXPERTS_SUFFIX)
        unit = "expert parameter" if experts else "linear"
        parts.append(f"{path} ({n} {unit}{'s' if n != 1 else ''})")
    return ", ".join(parts)


__all__ = ["weight_paths", "describe_weight_paths", "set_activations", "NO_QUANTIZED"]
