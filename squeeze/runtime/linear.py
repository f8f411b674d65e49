"""SqueezeLinear: an nn.Linear stand-in that holds a quantized weight (LUT or RTN) and its reference path.

The reference path dequantizes in torch (``LutWeight.dequantize`` / ``RtnWeight.dequantize``): exact, and
the oracle every kernel is tested against. By default the dequantized weight is cached densely on first
use (fast CPU decode); ``dense_cache=False`` dequantizes on every call (low memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from squeeze.quant.qweight import LutWeight, QuantizedWeight, RtnWeight


class SqueezeLinear(nn.Module):
    """y = x @ W^T + b with W stored quantized. Buffers are named as in the artifact (``weight_packed`` ...)."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None, *, dense_cache: bool = True):
        super().__init__()
        self.in_features = qweight.in_features
        self.out_features = qweight.packed.shape[0]
        self.dense_cache = dense_cache
        self._qweight = qweight
        for name, tensor in qweight.to_tensors("").items():
            self.register_buffer(name.lstrip("."), tensor)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._dense: torch.Tensor | None = None

    @property
    def qweight(self) -> QuantizedWeight:
        return self._qweight

    @property
    def method(self) -> str:
        return "rtn" if isinstance(self._qweight, RtnWeight) else "squeeze"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (out_features, in_features) in ``dtype``, by the exact torch reference path."""
        return self._current_qweight().dequantize(dtype)

    def _current_qweight(self) -> QuantizedWeight:
        # buffers may have moved (``.to(device)``): rebuild the container from the live buffers
        tensors = {f".{name}": buf for name, buf in self.named_buffers(recurse=False)}
        kind = LutWeight if isinstance(self._qweight, LutWeight) else RtnWeight
        extra = {"group_size": self._qweight.group_size} if isinstance(self._qweight, RtnWeight) else {}
        return kind.from_tensors(tensors, "", bits=self._qweight.bits, in_features=self.in_features, **extra)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features)
        if not self.dense_cache:
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        if self._dense is None or self._dense.dtype != x.dtype or self._dense.device != x.device:
            self._dense = self.dequantize(x.dtype).to(x.device)
        return F.linear(x, self._dense, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}, "
                f"bits={self._qweight.bits}, bias={self.bias is not None}")
