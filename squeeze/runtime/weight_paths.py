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


#: Appended to a path whose kernels multiply int8 activations (``native-avx512 int8``): the W4A8 form that
#: ``activations="int8"`` asks for, which only the native kernels of 3- and 4-bit LUT weights have.
INT8_SUFFIX = " int8"


def weight_paths(model: nn.Module) -> dict[str, int]:
    """SqueezeLinear modules of ``model`` per ``weight_path``, in the order each path first appears; quantized
    expert parameters (SqueezeExperts) per ``f"{weight_path}:experts"``. A path running int8 activations
    carries :data:`INT8_SUFFIX` (``native-avx512 int8``); every other path multiplies float activations."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, SqueezeLinear):
            path = module.weight_path + (INT8_SUFFIX if _runs_int8(module) else "")
        elif isinstance(module, SqueezeExperts):
            path = module.weight_path + (INT8_SUFFIX if _runs_int8(module) else "") + EXPERTS_SUFFIX
        else:
            continue
        counts[path] = counts.get(path, 0) + 1
    return counts


def _runs_int8(module: SqueezeLinear | SqueezeExperts) -> bool:
    """Whether ``module``'s forward runs the W4A8 kernel: its native CPU form holds the int8 weights (prepared
    only for ``activations="int8"`` on 3/4-bit LUT weights, and only where the native kernels run at all)."""
    if not module.weight_path.startswith("native-"):
        return False
    prepared = module._cpu
    forms = prepared if isinstance(prepared, list) else [prepared]
    return bool(forms) and all(getattr(form, "w8", None) is not None for form in forms)


def activation_precision(counts: Mapping[str, int]) -> str:
    """The activation precision a model's quantized linears ran in, from :func:`weight_paths`' counts: ``int8``,
    ``float32`` or ``int8 (N of M quantized modules), float32 (the rest)``."""
    total = sum(counts.values())
    int8 = sum(n for key, n in counts.items() if key.partition(EXPERTS_SUFFIX)[0].endswith(INT8_SUFFIX))
    if int8 == 0:
        return "float32"
    if int8 == total:
        return "int8"
    return f"int8 ({int8} of {total} quantized modules), float32 (the rest)"


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


__all__ = [
    "weight_paths",
    "describe_weight_paths",
    "activation_precision",
    "set_activations",
    "NO_QUANTIZED",
    "INT8_SUFFIX",
]
