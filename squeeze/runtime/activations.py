"""The ``activations`` load option: which precision the native CPU LUT kernels multiply activations in.

* ``"int8"`` (the default): 3- and 4-bit LUT weights run the W4A8 kernel (squeeze/runtime/kernels/cpu_w8.cpp):
  each activation row quantized to int8 with its own scale, each weight row's LUT held as int8 levels with its
  own scale, exact int32 sums. Fast at every row count, and a row's result never depends on its batch.
* ``"float32"``: the exact LUT values multiplied in float32 (cpu_lut.cpp's GEMV and tile paths).

Torch-free, so ``squeeze.api`` can check the option before anything heavy is imported.
"""

from __future__ import annotations

from typing import Literal

from squeeze.errors import ConfigError

Activations = Literal["int8", "float32"]
ACTIVATIONS: tuple[Activations, ...] = ("int8", "float32")
DEFAULT_ACTIVATIONS: Activations = "int8"


def check_activations(value: object) -> Activations:
    """``value`` as an :data:`Activations` (ConfigError naming the choices otherwise)."""
    if value not in ACTIVATIONS:
        raise ConfigError(
            f"activations must be one of {', '.join(repr(a) for a in ACTIVATIONS)}, found {value!r}",
            hint="int8 is the fast W4A8 kernel (the default); float32 multiplies the exact LUT values",
        )
    return value


__all__ = ["Activations", "ACTIVATIONS", "DEFAULT_ACTIVATIONS", "check_activations"]
