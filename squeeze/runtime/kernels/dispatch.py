"""The one hook between SqueezeLinear and the Triton kernels: :func:`lut_forward`.

SqueezeLinear.forward calls ``lut_forward(x, self)`` first and falls back to its torch reference path
when it returns None. The prepared weight (layout.PreparedLut) is cached on the module, keyed by the
device and by the identity and version counter of every weight buffer, so ``module.to(...)``, a
``load_state_dict`` (in-place copy: bumps the version) or a buffer swap all prepare again.

Memory: the prepared copy holds the codes again (tile-permuted), a float32 LUT and the residual, on x's
device, next to the module's own buffers. To keep a single copy of the codes on the GPU, leave the
module's buffers on the CPU and let the prepared copy be the only one on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from squeeze.quant.qweight import LutWeight
from squeeze.runtime.kernels.layout import PreparedLut, prepare

_CACHE_ATTR = "_squeeze_triton_prepared"
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def lut_forward(x: Tensor, module: nn.Module, *, allow_cpu: bool = False) -> Tensor | None:
    """``x (..., N) @ W^T + bias`` by the Triton kernels, or None when they do not apply.

    They apply when x is on CUDA (or ``allow_cpu``, for TRITON_INTERPRET=1 runs), triton is importable,
    ``module.qweight`` is a LutWeight, x is float16/bfloat16/float32, and no gradient is wanted (the
    kernels have no backward). The result has x's dtype and shape (..., R).
    """
    from squeeze.runtime.kernels import triton_available
    from squeeze.runtime.kernels.triton_lut import lut_linear

    if not (x.is_cuda or allow_cpu) or x.dtype not in _SUPPORTED_DTYPES:
        return None
    if not isinstance(getattr(module, "qweight", None), LutWeight):
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    if not triton_available():
        return None
    bias = getattr(module, "bias", None)
    return lut_linear(x, prepared_for(module, x.device), bias)


def prepared_for(module: nn.Module, device: torch.device) -> PreparedLut:
    """The module's PreparedLut on ``device``, built from its live buffers on first use and cached."""
    buffers = dict(module.named_buffers(recurse=False))
    key = (str(device),) + tuple(
        (name, buf.data_ptr(), buf._version, str(buf.device)) for name, buf in sorted(buffers.items())
    )
    cached = getattr(module, _CACHE_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    qweight: LutWeight = module.qweight  # type: ignore[assignment]
    # rebuild from the live buffers (they may have moved or been reloaded), with every tensor checked
    live = LutWeight.from_tensors(
        {f".{name}": buf for name, buf in buffers.items()}, "", bits=qweight.bits,
        in_features=qweight.in_features,
    )
    prepared = prepare(live, device)
    # a plain attribute (not a buffer): never saved in state_dict, dropped with the module
    object.__setattr__(module, _CACHE_ATTR, (key, prepared))
    return prepared


__all__ = ["lut_forward", "prepared_for"]
