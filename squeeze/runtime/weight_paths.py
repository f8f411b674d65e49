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
#: Appended to a path whose kernels multiply bfloat16 operands (``native-avx512 bfloat16``): the one matmul's
#: bfloat16 form, which ``activations="bfloat16"`` asks for and only AVX-512 BF16 CPUs run.
BF16_SUFFIX = " bfloat16"


def weight_paths(model: nn.Module) -> dict[str, int]:
    """SqueezeLinear modules of ``model`` per ``weight_path``, in the order each path first appears; quantized
    expert parameters (SqueezeExperts) per ``f"{weight_path}:experts"``. A path running int8 activations
    carries :data:`INT8_SUFFIX` (``native-avx512 int8``); every other path multiplies float activations."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, SqueezeLinear):
            path = module.weight_path + _suffix(module)
        elif isinstance(module, SqueezeExperts):
            path = module.weight_path + _suffix(module) + EXPERTS_SUFFIX
        else:
            continue
        counts[path] = counts.get(path, 0) + 1
    return counts


def _suffix(module: SqueezeLinear | SqueezeExperts) -> str:
    """:data:`INT8_SUFFIX`, :data:`BF16_SUFFIX` or "" (float32): the activations ``module``'s kernels run."""
    if _runs_int8(module):
        return INT8_SUFFIX
    forms = module._cpu if isinstance(module._cpu, list) else [module._cpu]
    if module.weight_path.startswith("native-") and forms and all(getattr(f, "bf16", False) for f in forms):
        return BF16_SUFFIX
    return ""


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
    ``bfloat16``, ``float32`` or a mix (``int8 (N of M quantized modules), float32 (the rest)``)."""
    total = sum(counts.values())
    by_suffix = {
        name: sum(n for key, n in counts.items() if key.partition(EXPERTS_SUFFIX)[0].endswith(suffix))
        for name, suffix in (("int8", INT8_SUFFIX), ("bfloat16", BF16_SUFFIX))
    }
    ran = {name: n for name, n in by_suffix.items() if n}
    if not ran:
        return "float32"
    if len(ran) == 1 and sum(ran.values()) == total:
        return next(iter(ran))
    parts = [f"{name} ({n} of {total} quantized modules)" for name, n in ran.items()]
    return ", ".join(parts) + ", float32 (the rest)"


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
