"""SqueezeLLM quantization of one weight matrix: dense-and-sparse split + sensitivity-weighted LUT.

1. Optionally move the most sensitive (largest Fisher) and largest-magnitude weights to a sparse part that
   stores them exactly (:func:`squeeze.quant.sparse.select_sparse`).
2. Per output row, fit ``2**bits`` centroids by 1-D k-means weighted by the Fisher (uniform weights when
   there is none), with ZERO weight at the sparse positions so outliers do not drag centroids.
3. Store the centroids as a float16 LUT; every code is the nearest *stored* (float16) centroid.
"""

from __future__ import annotations

import torch
from torch import Tensor

from squeeze.limits import LUT_DTYPES, LutDtype
from squeeze.quant.kmeans import nearest_codes, weighted_kmeans_1d
from squeeze.quant.packing import check_bits, pack_codes
from squeeze.quant.qweight import LUT_DTYPE, SCALE_DTYPE, LutWeight
from squeeze.quant.sparse import SparseCSR, select_sparse


def quantize_lut(
    weight: Tensor,
    fisher: Tensor | None,
    bits: int,
    sensitive_fraction: float = 0.0,
    outlier_fraction: float = 0.0,
    *,
    seed: int = 0,
    mask: Tensor | None = None,
    lut_dtype: LutDtype = "float16",
) -> LutWeight:
    """Quantize weight (R, N) to a LutWeight.

    Args:
        weight: float (R, N), any float dtype; clustered in float32, sparse values kept in its own dtype.
        fisher: float (R, N) nonnegative sensitivities (diagonal Fisher), or None for plain k-means. With
            None the sensitive part of the split is empty (see :func:`select_sparse`).
        bits: 2, 3, 4 or 8.
        sensitive_fraction, outlier_fraction: fractions of all weights kept exactly in the sparse part.
        seed: passed to the k-means (which is deterministic; kept for API stability).
        lut_dtype: "float16" stores each centroid in 16 bits (SqueezeLLM); "int8" stores 8-bit levels on a
            per-row affine grid (fp16 scale and zero), halving the LUT's share of the bits; codes are
            re-assigned to the nearest value of the grid as stored.
        mask: bool (R, N), a precomputed ``select_sparse`` result for these fractions (lets callers time
            or reuse the split); computed here when None.

    Returns:
        LutWeight with lut float16 (R, 2**bits), packed codes, and the sparse part (None when it is empty).
    """
    # contract checks (ValueError): recipes were validated against squeeze.limits at the boundary
    check_bits(bits)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        found = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D floating-point tensor, found {found}")
    if fisher is not None:
        if not isinstance(fisher, Tensor) or fisher.shape != weight.shape or not fisher.is_floating_point():
            found = f"{fisher.dtype} {tuple(fisher.shape)}" if isinstance(fisher, Tensor) else type(fisher).__name__
            raise ValueError(f"fisher must be a floating-point tensor of shape {tuple(weight.shape)}, found {found}")
    if lut_dtype not in LUT_DTYPES:
        raise ValueError(f"lut_dtype must be one of {list(LUT_DTYPES)}, found {lut_dtype!r}")
    weight = weight.detach()
    w32 = weight.to(torch.float32)

    if mask is None and (sensitive_fraction > 0 or outlier_fraction > 0):
        mask = select_sparse(weight, fisher, sensitive_fraction, outlier_fraction)
    elif mask is not None and (mask.shape != weight.shape or mask.dtype != torch.bool):
        raise ValueError(f"mask must be a bool tensor of shape {tuple(weight.shape)}, found {mask.dtype} {tuple(mask.shape)}")
    sensitivity = fisher.detach().to(torch.float32) if fisher is not None else torch.ones_like(w32)
    if mask is not None:
        sensitivity = sensitivity.masked_fill(mask, 0.0)  # sparse weights are stored exactly: ignore them

    # centroid_dtype: centroids are rounded to float16 before the codes are assigned, so each code is the
    # nearest entry of the LUT as stored.
    centroids, codes = weighted_kmeans_1d(
        w32, sensitivity, 1 << bits, seed=seed, centroid_dtype=LUT_DTYPE, codes_dtype=torch.uint8
    )
    lut, lut_scale, lut_zero = centroids.to(LUT_DTYPE), None, None
    if lut_dtype == "int8":
        lut, lut_scale, lut_zero = affine_lut8(centroids)
        stored = lut.to(torch.float32) * lut_scale.to(torch.float32) + lut_zero.to(torch.float32)  # (R, K)
        codes = nearest_codes(w32, stored).to(torch.uint8)
    sparse = None
    if mask is not None and bool(mask.any()):
        sparse = SparseCSR.from_mask(mask, weight)
    return LutWeight(
        bits=bits,
        in_features=int(weight.shape[1]),
        packed=pack_codes(codes, bits),
        lut=lut,
        sparse=sparse,
        lut_scale=lut_scale,
        lut_zero=lut_zero,
    )


def affine_lut8(centroids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Centroids float (R, K) ascending -> (levels uint8 (R, K), scale float16 (R, 1), zero float16 (R, 1)).

    The grid spans each row's [min, max] in 255 steps; scale and zero are rounded to float16 first and the
    levels computed against the rounded values, so value = level * scale + zero is what gets stored.
    """
    c = centroids.to(torch.float32)
    lo, hi = c.min(dim=1, keepdim=True).values, c.max(dim=1, keepdim=True).values  # (R, 1)
    zero = lo.to(SCALE_DTYPE)
    span = (hi - zero.to(torch.float32)).clamp_min(0.0)
    scale = (span / 255.0).to(SCALE_DTYPE)
    scale = torch.where(scale.to(torch.float32) > 0, scale, torch.ones_like(scale))  # constant rows
    levels = ((c - zero.to(torch.float32)) / scale.to(torch.float32)).round().clamp(0, 255).to(torch.uint8)
    return levels, scale, zero


__all__ = ["quantize_lut", "affine_lut8"]
