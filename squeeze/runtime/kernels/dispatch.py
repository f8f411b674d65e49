"""The one hook between SqueezeLinear and the Triton kernels.

SqueezeLinear prepares its kernel layout (layout.PreparedLut) when its buffers are set or moved
(:func:`prepare_module`, from its ``_apply`` / ``rebind``), never in ``forward``; ``forward`` calls
:func:`lut_forward` on CUDA inputs and falls back to its reference path when that returns None.

Memory: the prepared copy holds the codes again (tile-permuted), a float32 LUT and the residual, on its
device, next to the module's own buffers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from squeeze.runtime.kernels import triton_available
from squeeze.runtime.kernels.layout import PreparedLut, prepare
from squeeze.runtime.kernels.triton_lut import lut_linear

_CACHE_ATTR = "_squeeze_triton_prepared"
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernels_apply(module: nn.Module) -> bool:
    """The module's weight format declares the LUT kernels, and triton can run."""
    return getattr(getattr(module, "qweight", None), "kernel", None) == "lut" and triton_available()


def lut_forward(x: Tensor, module: nn.Module, *, allow_cpu: bool = False) -> Tensor | None:
    """``x (..., N) @ W^T + bias`` by the Triton kernels, or None when they do not apply.

    They apply when x is on CUDA (or ``allow_cpu``, for TRITON_INTERPRET=1 runs), triton is importable,
    the module's weight format declares ``kernel = "lut"``, x is float16/bfloat16/float32, and no gradient
    is wanted (the kernels have no backward). The result has x's dtype and shape (..., R).
    """
    if not (x.is_cuda or allow_cpu) or x.dtype not in _SUPPORTED_DTYPES:
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    prepared = prepared_for(module, x.device)
    if prepared is None:
        return None
    return lut_linear(x, prepared, getattr(module, "bias", None))


def prepare_module(module: nn.Module, device: torch.device) -> PreparedLut | None:
    """Build and cache the module's PreparedLut on ``device`` from its current weight (None if no kernel applies)."""
    if not _kernels_apply(module):
        return None
    prepared = prepare(module.qweight, device)  # type: ignore[arg-type]
    cache = dict(getattr(module, _CACHE_ATTR, None) or {})
    cache[str(device)] = prepared
    # a plain attribute (not a buffer): never saved in state_dict, dropped with the module
    object.__setattr__(module, _CACHE_ATTR, cache)
    return prepared


def prepared_for(module: nn.Module, device: torch.device) -> PreparedLut | None:
    """The module's PreparedLut on ``device``: the one prepared when its buffers were set or moved there.

    A device the buffers were never moved to (CPU inputs under TRITON_INTERPRET=1) is prepared on first use.
    """
    cache = getattr(module, _CACHE_ATTR, None) or {}
    prepared = cache.get(str(device))
    return prepared if prepared is not None else prepare_module(module, device)


def drop_prepared(module: nn.Module) -> None:
    """Forget every prepared layout of ``module`` (its buffers changed)."""
    object.__setattr__(module, _CACHE_ATTR, None)


__all__ = ["lut_forward", "prepared_for", "prepare_module", "drop_prepared"]
