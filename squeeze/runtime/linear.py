"""SqueezeLinear: an nn.Linear stand-in that holds a quantized weight (LUT or RTN) and its reference path.

The reference path dequantizes in torch (``LutWeight.dequantize`` / ``RtnWeight.dequantize``): exact, and
the oracle every kernel is tested against. By default the dequantized weight is cached densely on first
use (fast CPU decode); ``dense_cache=False`` dequantizes on every call (low memory), ``chunk_rows``
output rows at a time, so the full dense weight never exists: peak extra memory is one
(chunk_rows, in_features) slice instead of (out_features, in_features).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from squeeze.quant.packing import unpack_codes
from squeeze.quant.qweight import LutWeight, QuantizedWeight, RtnWeight
from squeeze.quant.sparse import SparseCSR

#: Output rows dequantized at a time on the low-memory path (1024 x 4096 fp32 = 16 MiB per slice).
DEFAULT_CHUNK_ROWS = 1024


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
        #: rows per slice on the low-memory path (``dense_cache=False``)
        self.chunk_rows = DEFAULT_CHUNK_ROWS

    @property
    def qweight(self) -> QuantizedWeight:
        return self._qweight

    @property
    def method(self) -> str:
        return "rtn" if isinstance(self._qweight, RtnWeight) else "squeeze"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (out_features, in_features) in ``dtype``, by the exact torch reference path."""
        return self._current_qweight().dequantize(dtype)

    def rebind(self, name: str = "") -> None:
        """Rebuild the quantized weight from the live buffers, with every format check (FormatError).

        For loaders that fill the buffers in place after construction (transformers' ``from_pretrained``
        builds this module with meta buffers, then assigns the checkpoint's tensors by name). ``name``:
        the module's name, so errors name the tensor (``{name}.weight_lut: expected ...``).
        """
        self._qweight = self._current_qweight(name)
        self._dense = None

    def _current_qweight(self, prefix: str = "") -> QuantizedWeight:
        # buffers may have moved (``.to(device)``): rebuild the container from the live buffers
        tensors = {f"{prefix}.{name}": buf for name, buf in self.named_buffers(recurse=False)}
        kind = LutWeight if isinstance(self._qweight, LutWeight) else RtnWeight
        extra = {"group_size": self._qweight.group_size} if isinstance(self._qweight, RtnWeight) else {}
        return kind.from_tensors(tensors, prefix, bits=self._qweight.bits, in_features=self.in_features, **extra)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features)
        if x.is_cuda:  # Triton LUT kernels (GEMV for decode, tiled GEMM for prefill) when available
            from squeeze.runtime.kernels.dispatch import lut_forward

            y = lut_forward(x, self)
            if y is not None:
                return y
        if not self.dense_cache:
            return self.chunked_forward(x)
        if self._dense is None or self._dense.dtype != x.dtype or self._dense.device != x.device:
            # the fast unpacking, bit-identical to ``dequantize`` (tested): the reference path's general
            # unpacker took 12 s of a SmolLM2 first forward, this one well under a second
            self._dense = self.dequantize_rows(0, self.out_features, x.dtype).to(x.device)
        return F.linear(x, self._dense, self.bias)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [start, stop) of the weight, (stop - start, in_features) in ``dtype``.

        Bit-identical to ``self.dequantize(dtype)[start:stop]``: the same arithmetic as the reference
        ``dequantize``, on a row slice of the live buffers (codes, LUT or scales, and the sparse part
        re-based to the slice), with a faster unpacking of 2/4/8-bit codes (see :func:`_unpack_fast`).
        """
        return _dequantize_fast(_row_slice(self._live_buffers(), self._qweight, start, stop), dtype)

    def chunked_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features), dequantizing ``chunk_rows`` output rows at a time.

        Each slice of output columns is ``x @ W[rows]^T`` (+ bias[rows]); the slices are concatenated, so
        only one (chunk_rows, in_features) piece of the dense weight is alive at any moment.
        """
        buffers = self._live_buffers()
        step = max(1, int(self.chunk_rows))
        outs = []
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            w = _dequantize_fast(_row_slice(buffers, self._qweight, start, stop), x.dtype).to(x.device)
            b = self.bias[start:stop] if self.bias is not None else None
            outs.append(F.linear(x, w, b))
            del w  # free the slice before the next one is built
        return torch.cat(outs, dim=-1) if len(outs) != 1 else outs[0]

    def _live_buffers(self) -> dict[str, torch.Tensor]:
        # read the buffers every call: ``.to(device)`` / ``load_state_dict`` may have replaced them
        return dict(self.named_buffers(recurse=False))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}, "
                f"bits={self._qweight.bits}, bias={self.bias is not None}")


def _row_slice(buffers: dict[str, torch.Tensor], template: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """The quantized weight of rows [start, stop), built from the module's buffers without copying.

    Rows are packed independently (docs/format.md), so slicing ``weight_packed`` by rows is exact. The
    containers are built directly (no ``from_tensors``): the buffers were validated once at load, and the
    checks would cost more than the slice's dequantization on every decode step.
    """
    packed = buffers["weight_packed"][start:stop]
    if isinstance(template, RtnWeight):
        return RtnWeight(bits=template.bits, in_features=template.in_features, group_size=template.group_size,
                         packed=packed, scales=buffers["weight_scales"][start:stop],
                         zeros=buffers["weight_zeros"][start:stop])
    sparse = None
    rowptr = buffers.get("weight_sparse_rowptr")
    if rowptr is not None:
        lo, hi = int(rowptr[start]), int(rowptr[stop])
        # re-base the row pointers so the slice is a well-formed CSR of its own (rowptr[0] == 0)
        sparse = SparseCSR(rowptr=rowptr[start:stop + 1] - rowptr[start], cols=buffers["weight_sparse_cols"][lo:hi],
                           vals=buffers["weight_sparse_vals"][lo:hi], shape=(stop - start, template.in_features))
    scale, zero = buffers.get("weight_lut_scale"), buffers.get("weight_lut_zero")
    return LutWeight(bits=template.bits, in_features=template.in_features, packed=packed,
                     lut=buffers["weight_lut"][start:stop], sparse=sparse,
                     lut_scale=scale[start:stop] if scale is not None else None,
                     lut_zero=zero[start:stop] if zero is not None else None)


def _unpack_fast(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 (R, n) codes from packed uint8 (R, ceil(n * bits / 8)); equal to ``unpack_codes``.

    With 2, 4 or 8 bits a byte holds whole codes, LSB first (docs/format.md), so one broadcast shift and
    mask unpacks them: several times faster than the general path, which the low-memory forward runs on
    every call. 3-bit codes straddle bytes and take the general ``unpack_codes``.
    """
    if bits == 8:
        return packed[:, :n]
    if bits not in (2, 4):
        return unpack_codes(packed, bits, n)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # code i of a byte: bits*i
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (R, W, 8 // bits)
    return codes.reshape(packed.shape[0], packed.shape[1] * (8 // bits))[:, :n]


def _dequantize_fast(qweight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """(R, N) in ``dtype``: the reference ``dequantize`` arithmetic, step for step, with fast unpacking."""
    codes = _unpack_fast(qweight.packed, qweight.bits, qweight.in_features)
    if isinstance(qweight, RtnWeight):
        gs = qweight.group_size or max(1, qweight.in_features)
        scales = qweight.scales.to(torch.float32).repeat_interleave(gs, dim=1)[:, : qweight.in_features]
        zeros = qweight.zeros.to(torch.float32).repeat_interleave(gs, dim=1)[:, : qweight.in_features]
        return ((codes.to(torch.float32) - zeros) * scales).to(dtype)
    dense = qweight.lut_values().gather(1, codes.to(torch.int64)).to(dtype)
    if qweight.sparse is not None:
        qweight.sparse.scatter_into(dense)
    return dense
