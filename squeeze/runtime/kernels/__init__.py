"""LUT kernels for SqueezeLinear: torch references, the kernels' code layout, and Triton kernels for CUDA.

* :mod:`.reference` - exact torch ops every kernel is tested against, and the additive sparse residual.
* :mod:`.layout` - :func:`prepare`: a LutWeight -> :class:`PreparedLut` (tile-permuted codes, float32
  LUT, additive CSR residual) on one device, derived once at load time.
* :mod:`.triton_lut` - :func:`lut_linear` (GEMV for <= 8 rows of x, GEMM or dequantize + matmul above)
  and :func:`lut_dequantize`; :mod:`.configs` holds their tiling; :mod:`._triton_kernels` the kernels.
* :mod:`.dispatch` - :func:`lut_forward`, the hook SqueezeLinear.forward calls.

Triton is optional: this package imports without it, :func:`triton_available` says whether the kernels
can run, and triton itself is imported by the first kernel launch.
"""

from __future__ import annotations

import functools
import importlib.util

from squeeze.runtime.kernels.configs import GemmConfig, GemvConfig
from squeeze.runtime.kernels.layout import DEFAULT_TILE, PreparedLut, prepare, tile_pack, tile_unpack
from squeeze.runtime.kernels.reference import (
    csr_spmv_reference,
    dense_lut_values,
    lut_matmul_reference,
    sparse_residual,
)
from squeeze.runtime.kernels.triton_lut import lut_dequantize, lut_linear


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (the kernels also need a CUDA device, or
    ``TRITON_INTERPRET=1`` for CPU tensors)."""
    try:
        if importlib.util.find_spec("triton") is None:
            return False
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken or blocked install (missing shared libraries, ...) counts as absent
        return False
    return True


__all__ = [
    "triton_available",
    "DEFAULT_TILE",
    "PreparedLut",
    "prepare",
    "tile_pack",
    "tile_unpack",
    "lut_matmul_reference",
    "dense_lut_values",
    "sparse_residual",
    "csr_spmv_reference",
    "GemvConfig",
    "GemmConfig",
    "lut_linear",
    "lut_dequantize",
]
