"""The quantization core: pure functions on tensors (no I/O, no runtime).

* :func:`weighted_kmeans_1d` - sensitivity-weighted 1-D k-means for every row at once.
* :func:`select_sparse` / :class:`SparseCSR` - the dense-and-sparse split.
* :func:`quantize_lut` - SqueezeLLM quantization of one matrix -> :class:`LutWeight`.
* :func:`rtn_quantize` - round-to-nearest baseline -> :class:`RtnWeight`.
* :func:`pack_codes` / :func:`unpack_codes` - exact ``bits``-bit packing of codes.
"""

from __future__ import annotations

from squeeze.quant.kmeans import nearest_codes, weighted_kmeans_1d
from squeeze.quant.nuq import quantize_lut
from squeeze.quant.packing import SUPPORTED_BITS, pack_codes, packed_row_bytes, unpack_codes
from squeeze.quant.qweight import LUT_DTYPE, SCALE_DTYPE, LutWeight, QuantizedWeight, RtnWeight, rtn_groups
from squeeze.quant.rtn import rtn_quantize
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
    "RtnWeight",
    "QuantizedWeight",
]
