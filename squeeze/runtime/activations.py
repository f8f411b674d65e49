"""The ``activations`` load option: which precision the native CPU LUT kernels multiply activations in.

* ``"int8"``: 3- and 4-bit LUT weights run the W4A8 kernel (squeeze/runtime/kernels/cpu_w8.cpp):
  activations quantized to int8 per group of 64 columns (a scale per row and group), each weight row's LUT
  held as int8 levels with its own scale, exact int32 sums per group. Fast at every row count, and a row's
  result never depends on its batch.
* ``"float32"`` (the default): the exact LUT values multiplied in float32 (cpu_lut.cpp's one matmul).
* ``"bfloat16"``: the one matmul's bfloat16 form where the CPU has AVX-512 BF16 (``vdpbf16ps``: weights and
  activations rounded to bfloat16, float32 sums; twice float32's products per instruction), float32 elsewhere.
  Batch-invariant like float32. Emulated in torch on SmolLM2-135M (its linears' weights rounded to float16
  then bfloat16, activations to bfloat16; WikiText-2, 8 x 512 tokens, 2026-12-07): 30.629 vs 30.642 (-0.04 %),
  while activations per 64 columns in int8 alone gave 30.764 (+0.40 %). Not measured on a compressed artifact
  with the kernel itself yet, so float32 stays the default until then.

Why float32 stays the default (measured on SmolLM2-135M w4, WikiText-2, 40 x 512 tokens; docs/benchmarks.md):
int8 with per-ROW activation scales shifted perplexity by +3.3 % (33.55 vs 32.47), far above the 0.3 % the
fast path may cost; emulated in torch, per-row int8 activations alone cost +3.6 %, int8 LUT levels alone
+0.6 %, activations with one scale per 64 columns +0.5 % (the kernel's groups now): the int8 LUT levels alone
exceed the bound. int8 is the option for throughput under load where that shift is acceptable.

Torch-free, so ``squeeze.api`` can check the option before anything heavy is imported.
"""

from __future__ import annotations

from typing import Literal

from squeeze.errors import ConfigError

Activations = Literal["int8", "float32", "bfloat16"]
ACTIVATIONS: tuple[Activations, ...] = ("int8", "float32", "bfloat16")
DEFAULT_ACTIVATIONS: Activations = "float32"


def check_activations(value: object) -> Activations:
    """``value`` as an :data:`Activations` (ConfigError naming the choices otherwise)."""
    if value not in ACTIVATIONS:
        raise ConfigError(
            f"activations must be one of {', '.join(repr(a) for a in ACTIVATIONS)}, found {value!r}",
            hint="float32 (the default) multiplies the exact LUT values; int8 is the faster W4A8 kernel",
        )
    return value


__all__ = ["Activations", "ACTIVATIONS", "DEFAULT_ACTIVATIONS", "check_activations"]
