"""The native dense float32 kernel from Python: ``y = x @ W^T + b`` with every row's result independent of its batch.

torch's float32 GEMM picks its kernel by shape: one activation row (decoding one sequence) takes a GEMV,
several take a GEMM, and the two sum in different orders, so the same row's outputs differ in the last
bits with the batch it came in. cpu_lut.cpp's ``sq_dense_linear`` computes each output as one dot product
in a fixed order (SIMD lanes along the input, then a fixed horizontal sum), 8 activation rows per pass over
the weight: the same bits at every batch size, at about the speed of torch's GEMV for one row (the weight is
read once per 8 rows either way) and faster than its GEMM for a few rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from squeeze.runtime.kernels.cpu_build import CpuKernels
from squeeze.runtime.kernels.cpu_w8 import bias_f32

#: Weight dtypes the dense kernel reads as stored (cpu_lut.cpp's SQ_DENSE_* numbering).
DENSE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def cpu_dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None, kernels: CpuKernels) -> Tensor:
    """(..., R) float32: ``x (..., N) float32 @ weight (R, N) ^T + bias``; weight contiguous on the CPU, float32,
    float16 or bfloat16 (read as stored, each element converted exactly: the bits of the float32 weight)."""
    rows, n = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), n)  # (B, N)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    batch = int(x2.shape[0])
    y = torch.empty(batch, rows, dtype=torch.float32)  # (B, R)
    if batch and rows:
        b32 = bias_f32(bias)
        kernels.lib.sq_dense_linear_typed(
            weight.data_ptr(),
            DENSE_DTYPES[weight.dtype],
            rows,
            n,
            x2.data_ptr(),
            batch,
            y.data_ptr(),
            b32.data_ptr() if b32 is not None else None,
            kernels.isa_code,
            torch.get_num_threads(),
        )
    return y.reshape(*lead, rows)


__all__ = ["DENSE_DTYPES", "cpu_dense_linear"]
