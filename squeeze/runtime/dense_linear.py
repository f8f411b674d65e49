"""RowStableLinear: an artifact's unquantized linears (the LM head) on the CPU, each row's result independent of
its batch, so that ``squeeze serve``, which batches requests, gives the text ``squeeze run`` gives each alone.

The module is an ``nn.Linear`` (same parameters, tied weights stay tied) whose forward runs the native dense
kernel (:mod:`squeeze.runtime.kernels.cpu_dense`, the LUT kernels' one matmul: one summation order at every
number of rows) for float32 inference on the CPU. Elsewhere it is ``F.linear``: another device or dtype,
gradients, no C++ compiler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from squeeze.runtime.kernels.cpu_build import cpu_kernels
from squeeze.runtime.kernels.cpu_dense import DENSE_DTYPES, cpu_dense_linear

#: float32 elements of one upcast tile of a stored-dtype weight on the F.linear path (4 MiB).
UPCAST_TILE_ELEMENTS = 1 << 20


class RowStableLinear(nn.Linear):
    """``nn.Linear`` whose CPU float32 inference path gives every row the same bits at any batch size.

    Its weight may be kept in float16 / bfloat16 (squeeze.runtime.stored_dtype) while activations are float32:
    the kernel reads it as stored; F.linear gets it upcast one tile of rows at a time (never whole)."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - nn.Linear's own parameter name
        weight = self.weight
        if (
            input.device.type == "cpu"
            and input.dtype == torch.float32
            and weight.dtype in DENSE_DTYPES
            and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))
        ):
            kernels = cpu_kernels()
            if kernels is not None:
                return cpu_dense_linear(input, weight, self.bias, kernels)
        if weight.dtype != input.dtype and input.dtype == torch.float32:
            return _upcast_tiles_linear(input, weight, self.bias)
        return F.linear(input, weight, self.bias)


def _upcast_tiles_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """(..., R) float32: ``x (..., N) float32 @ weight (R, N) ^T + bias`` with ``weight`` in another dtype,
    upcast UPCAST_TILE_ELEMENTS at a time, so no float32 copy of the whole weight ever exists."""
    rows, n = weight.shape
    tile = max(1, UPCAST_TILE_ELEMENTS // max(n, 1))
    parts = [
        F.linear(
            x,
            weight[start : start + tile].to(torch.float32),
            None if bias is None else bias[start : start + tile].to(torch.float32),
        )
        for start in range(0, rows, tile)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def stabilise_dense_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`RowStableLinear` in place; how many there were.

    The class is swapped on the existing modules (RowStableLinear adds no state), so parameters, tied weights
    and hooks stay exactly as they are.
    """
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowStableLinear
            count += 1
    return count


__all__ = ["RowStableLinear", "stabilise_dense_linears"]
