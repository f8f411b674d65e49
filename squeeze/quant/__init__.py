"""The quantization core: pure functions on tensors (no I/O, no runtime).

* :func:`weighted_kmeans_1d` - sensitivity-weighted 1-D k-means for every row at once.
* :func:`select_sparse` / :class:`SparseCSR` - the dense-and-sparse split.
* :mod:`squeeze.quant.schemes` - the weight formats (LUT, 8-bit LUT, RTN), each with its quantizer
  (:func:`quantize_lut`, :func:`rtn_quantize`), its stored tensors and its reference dequantization.
* :func:`pack_codes` / :func:`unpack_codes` - exact ``bits``-bit packing of codes.
"""

from __future__ import annotations

from squeeze.quant.kmeans import nearest_codes, weighted_kmeans_1d
from squeeze.quant.packing import SUPPORTED_BITS, pack_codes, packed_row_bytes, unpack_codes
from squeeze.quant.schemes import Lut8Weight, LutWeight, QuantizedWeight, RtnWeight, WeightFormat, register_format
from squeeze.quant.schemes.lut import LUT_DTYPE, quantize_lut
from squeeze.quant.schemes.roles import HALF as SCALE_DTYPE
from squeeze.quant.schemes.rtn import rtn_groups, rtn_quantize
from squeeze.quant.sparse import SparseCSR, select_sparse

__all__ = [
    "SUPPORTED_BITS",
    "LUT_DTYPE",
    "SCALE_DTYPE",
    "weighted_kmeans_1d",
    "nearest_codes",
    "select_sparse",
    "SparseCSR",
    "quantize_lut",
    "rtn_quantize",
    "rtn_groups",
    "pack_codes",
    "unpack_codes",
    "packed_row_bytes",
    "LutWeight",
    "Lut8Weight",
    "WeightFormat",
    "register_format",
    "RtnWeight",
    "QuantizedWeight",
]
