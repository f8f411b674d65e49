"""SqueezeLLM's formats: per-row LUT codes plus an exact sparse part (fp16 LUT, and the compact 8-bit LUT).

Quantization (SqueezeLLM): each row's weights are clustered by a sensitivity-weighted 1-D k-means into
2**bits centroids (the row's LUT); each weight stores the index of its centroid. A small fraction of
weights (the most sensitive and the largest outliers, :func:`squeeze.quant.sparse.select_sparse`) leaves
the clustering and is stored exactly in a CSR part that replaces the dense value at its position.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from squeeze.errors import FormatError
from squeeze.quant.ec import DEFAULT_DAMP, compensated_codes, refit_lut, refitted_codes
from squeeze.quant.kmeans import nearest_codes, weighted_kmeans_1d
from squeeze.quant.packing import check_bits, pack_codes
from squeeze.quant.schemes.base import QuantOptions, Timer, WeightFormat, no_timer
from squeeze.quant.schemes.lut_parts import (
    SPARSE_ROLES,
    affine_lut8,
    check_quantize_inputs,
    sparse_from_roles,
    sparse_rows,
    sparse_tensors,
)
from squeeze.quant.schemes.roles import HALF, Role
from squeeze.quant.sparse import SparseCSR, select_sparse

#: dtype of fp16 LUT entries (also the centroids' rounding before codes are assigned).
LUT_DTYPE = HALF
#: dtype of the 8-bit LUT's levels.
LUT8_DTYPE = torch.uint8


@dataclass(frozen=True, kw_only=True)
class LutWeight(WeightFormat):
    """SqueezeLLM weight. packed uint8 (R, ceil(N * bits / 8)): codes (see :mod:`squeeze.quant.packing`);
    lut float16 (R, 2**bits): each row's centroids, ascending; sparse: exact weights replacing the dense
    value at their positions, or None."""

    name: ClassVar[str] = "lut"
    method: ClassVar[str] = "squeeze"
    recipe_match: ClassVar[Mapping[str, object]] = {"lut_dtype": "float16"}
    recipe_options: ClassVar[frozenset[str]] = frozenset(
        {
            "sensitive_fraction",
            "outlier_fraction",
            "lut_dtype",
            "error_compensation",
            "damp",
            "refit_lut",
            "refit_rounds",
            "generated_samples",
            "lnq_rounds",
            "lnq_ridge",
            "lnq_shrink",
            "lnq_held_out",
        }
    )
    uses_fisher: ClassVar[bool] = True
    uses_hessian: ClassVar[bool] = True
    kernel: ClassVar[str | None] = "lut"
    tunable: ClassVar[bool] = True
    roles: ClassVar[tuple[Role, ...]] = (
        Role("weight_packed", torch.uint8, ("rows", "packed")),
        Role("weight_lut", LUT_DTYPE, ("rows", "levels")),
        *SPARSE_ROLES,
    )

    lut: Tensor
    sparse: SparseCSR | None = None

    def lut_values(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(R, 2**bits) centroid values in ``dtype``."""
        return self.lut.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(R, N) in ``dtype``: lut[r, code[r, c]], then the sparse values replace theirs (exact in their dtype)."""
        dense = self.lut_values().gather(1, self.codes().to(torch.int64)).to(dtype)  # (R, N)
        if self.sparse is not None:
            self.sparse.scatter_into(dense)
        return dense

    def tensors_by_role(self) -> dict[str, Tensor]:
        return {"weight_packed": self.packed, "weight_lut": self.lut} | sparse_tensors(self.sparse)

    def with_levels(self, values: Tensor) -> LutWeight:
        """``values`` float (R, 2**bits) as this format stores them (float16; the 8-bit LUT: its affine grid),
        re-sorted ascending with the codes following their levels (every weight keeps its value's slot). A
        level that would not be finite as stored (NaN, or past float16's range) keeps its current value."""
        current = self.lut_values()
        stored = _stored_levels(type(self), values.detach().to(torch.float32).cpu())
        stored = torch.where(torch.isfinite(stored), stored, current)
        levels, order = stored.sort(dim=1, stable=True)
        k = levels.shape[1]
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(k).expand_as(order))  # old index -> new
        packed = pack_codes(rank.gather(1, self.codes().to(torch.int64)).to(torch.uint8), self.bits)
        if isinstance(self, Lut8Weight):
            lut, scale, zero = affine_lut8(levels)
            return replace(self, lut=lut, lut_scale=scale, lut_zero=zero, packed=packed)
        return replace(self, lut=levels.to(LUT_DTYPE), packed=packed)

    @classmethod
    def from_roles(
        cls, bits: int, in_features: int, params: Mapping[str, Any], found: Mapping[str, Tensor]
    ) -> LutWeight:
        return cls(
            bits=bits,
            in_features=in_features,
            packed=found["weight_packed"],
            lut=found["weight_lut"],
            sparse=sparse_from_roles(found, in_features),
        )

    def check_values(self, prefix: str) -> None:
        if self.sparse is not None:
            try:
                self.sparse.validate(self.out_features, self.in_features)
            except FormatError as exc:
                raise FormatError(f"{prefix}: {exc.message}") from exc

    def row_slice(self, start: int, stop: int) -> LutWeight:
        return type(self)(
            bits=self.bits,
            in_features=self.in_features,
            packed=self.packed[start:stop],
            lut=self.lut[start:stop],
            sparse=sparse_rows(self.sparse, start, stop),
        )

    def _col_slice(self, start: int, stop: int) -> LutWeight:
        # the LUT (and the 8-bit LUT's scale / zero) is per row: every column keeps it; replace() keeps them
        return replace(
            self,
            in_features=stop - start,
            packed=self.packed_cols(start, stop),
            sparse=self.sparse.col_slice(start, stop) if self.sparse is not None else None,
        )

    @classmethod
    def expected_nnz(cls, rows: int, cols: int, options: QuantOptions) -> int:
        return round(options.sensitive_fraction * rows * cols) + round(options.outlier_fraction * rows * cols)

    @classmethod
    def quantize(
        cls,
        weight: Tensor,
        fisher: Tensor | None,
        options: QuantOptions,
        timer: Timer = no_timer,
        *,
        hessian: Tensor | None = None,
        held_out: Tensor | None = None,
        lnq_report: dict[str, float] | None = None,
    ) -> LutWeight:
        """As the base; with ``options.error_compensation`` the codes are chosen against ``hessian`` (float
        (N, N), the layer inputs' ``sum x x^T``; required then, ValueError without it): squeeze.quant.ec. With
        ``options.lnq_rounds`` the compensated pair is then refitted against the Fisher-weighted loss
        (squeeze.quant.lnq), each row's iterate chosen on ``held_out`` (float (N, N), the held-out calibration
        windows' ``sum x x^T``; required then); ``lnq_report`` (a dict) then gets the layer's held-out and
        fitted objective before / after and the share of rows that changed."""
        mask = None
        if options.sensitive_fraction or options.outlier_fraction:
            with timer("sparse"):
                mask = select_sparse(weight, fisher, options.sensitive_fraction, options.outlier_fraction)
        with timer("kmeans"):
            plain = quantize_lut(weight, fisher, options.bits, mask=mask, lut_dtype=options.lut_dtype)
        if not getattr(options, "error_compensation", False):
            return plain
        if hessian is None:
            raise ValueError("error compensation needs the layer's input Hessian, found none")
        with timer("ec"):
            compensated = compensate_lut(
                plain,
                weight,
                hessian,
                mask=mask,
                damp=getattr(options, "damp", DEFAULT_DAMP),
                refit=getattr(options, "refit_lut", False),
                act_order=getattr(options, "act_order", False),
                refit_rounds=getattr(options, "refit_rounds", 0),
            )
        rounds = getattr(options, "lnq_rounds", 0)
        if not rounds:
            return compensated
        if held_out is None:
            raise ValueError("lnq_rounds needs the held-out windows' input Hessian, found none")
        from squeeze.quant.schemes.lut_lnq import DEFAULT_RIDGE, DEFAULT_SHRINK, layer_report, refit_against_loss

        with timer("lnq"):
            refitted, report = refit_against_loss(
                compensated,
                weight,
                None if fisher is None else fisher if mask is None else fisher.masked_fill(mask, 0.0),
                hessian,
                held_out,
                rounds=rounds,
                ridge=getattr(options, "lnq_ridge", DEFAULT_RIDGE),
                shrink=getattr(options, "lnq_shrink", DEFAULT_SHRINK),
                mask=mask,
            )
        if lnq_report is not None:
            lnq_report.update(layer_report(report))
        return refitted


@dataclass(frozen=True, kw_only=True)
class Lut8Weight(LutWeight):
    """The compact 8-bit LUT: lut uint8 (R, 2**bits) levels on a per-row affine grid,
    value = level * lut_scale + lut_zero, with lut_scale / lut_zero float16 (R, 1): half the LUT's bits."""

    name: ClassVar[str] = "lut8"
    recipe_match: ClassVar[Mapping[str, object]] = {"lut_dtype": "int8"}
    roles: ClassVar[tuple[Role, ...]] = (
        Role("weight_packed", torch.uint8, ("rows", "packed")),
        Role("weight_lut", LUT8_DTYPE, ("rows", "levels")),
        Role("weight_lut_scale", HALF, ("rows", 1)),
        Role("weight_lut_zero", HALF, ("rows", 1)),
        *SPARSE_ROLES,
    )

    lut_scale: Tensor
    lut_zero: Tensor

    def lut_values(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(R, 2**bits) centroid values in ``dtype``, expanded in float32 first."""
        values = self.lut.to(torch.float32) * self.lut_scale.to(torch.float32) + self.lut_zero.to(torch.float32)
        return values.to(dtype)

    def tensors_by_role(self) -> dict[str, Tensor]:
        out = {
            "weight_packed": self.packed,
            "weight_lut": self.lut,
            "weight_lut_scale": self.lut_scale,
            "weight_lut_zero": self.lut_zero,
        }
        return out | sparse_tensors(self.sparse)

    @classmethod
    def from_roles(
        cls, bits: int, in_features: int, params: Mapping[str, Any], found: Mapping[str, Tensor]
    ) -> Lut8Weight:
        return cls(
            bits=bits,
            in_features=in_features,
            packed=found["weight_packed"],
            lut=found["weight_lut"],
            lut_scale=found["weight_lut_scale"],
            lut_zero=found["weight_lut_zero"],
            sparse=sparse_from_roles(found, in_features),
        )

    def check_values(self, prefix: str) -> None:
        if not bool(torch.isfinite(self.lut_scale).all() & torch.isfinite(self.lut_zero).all()):
            raise FormatError(f"{prefix}.weight_lut_scale / weight_lut_zero must be finite")
        super().check_values(prefix)

    def row_slice(self, start: int, stop: int) -> Lut8Weight:
        return Lut8Weight(
            bits=self.bits,
            in_features=self.in_features,
            packed=self.packed[start:stop],
            lut=self.lut[start:stop],
            lut_scale=self.lut_scale[start:stop],
            lut_zero=self.lut_zero[start:stop],
            sparse=sparse_rows(self.sparse, start, stop),
        )


def _stored_levels(cls: type[LutWeight], values: Tensor) -> Tensor:
    """float32 (R, K) ``values`` rounded as ``cls`` stores them (an 8-bit LUT's grid spans the finite ones)."""
    if issubclass(cls, Lut8Weight):
        finite = torch.isfinite(values)
        safe = torch.where(finite, values, values.masked_fill(~finite, 0.0).mean(dim=1, keepdim=True))
        lut, scale, zero = affine_lut8(safe)
        grid = lut.to(torch.float32) * scale.to(torch.float32) + zero.to(torch.float32)
        return torch.where(finite, grid, values)
    return values.to(LUT_DTYPE).to(torch.float32)


def quantize_lut(
    weight: Tensor,
    fisher: Tensor | None,
    bits: int,
    sensitive_fraction: float = 0.0,
    outlier_fraction: float = 0.0,
    *,
    mask: Tensor | None = None,
    lut_dtype: str = "float16",
) -> LutWeight:
    """Quantize weight (R, N) to a LutWeight (``lut_dtype="int8"``: a Lut8Weight).

    weight: float (R, N), any float dtype; clustered in float32, sparse values kept in its own dtype.
    fisher: float (R, N) nonnegative sensitivities (diagonal Fisher), or None for plain k-means (then the
    sensitive part of the split is empty, see :func:`select_sparse`). bits: 2, 3, 4 or 8.
    sensitive_fraction, outlier_fraction: fractions of all weights kept exactly in the sparse part; or
    mask: bool (R, N), the sparse positions already chosen (then the fractions must be left at 0).
    lut_dtype: "float16" stores each centroid in 16 bits (SqueezeLLM); "int8" stores 8-bit levels on a
    per-row affine grid, and codes are re-assigned to the nearest value of the grid as stored.
    """
    # contract checks (ValueError): recipes were validated against squeeze.limits at the boundary
    check_bits(bits)
    check_quantize_inputs(weight, fisher, mask, lut_dtype)
    if mask is not None and (sensitive_fraction or outlier_fraction):
        raise ValueError("give either the sparse fractions or a precomputed mask, not both")
    weight = weight.detach()
    w32 = weight.to(torch.float32)
    if mask is None and (sensitive_fraction > 0 or outlier_fraction > 0):
        mask = select_sparse(weight, fisher, sensitive_fraction, outlier_fraction)
    sensitivity = fisher.detach().to(torch.float32) if fisher is not None else torch.ones_like(w32)
    if mask is not None:
        sensitivity = sensitivity.masked_fill(mask, 0.0)  # sparse weights are stored exactly: ignore them
    # centroids are rounded to float16 before the codes are assigned: each code is the nearest LUT entry as stored
    centroids, codes = weighted_kmeans_1d(
        w32, sensitivity, 1 << bits, centroid_dtype=LUT_DTYPE, codes_dtype=torch.uint8
    )
    sparse = SparseCSR.from_mask(mask, weight) if mask is not None and bool(mask.any()) else None
    if lut_dtype == "int8":
        levels, scale, zero = affine_lut8(centroids)
        stored = levels.to(torch.float32) * scale.to(torch.float32) + zero.to(torch.float32)  # (R, K)
        return Lut8Weight(
            bits=bits,
            in_features=int(weight.shape[1]),
            sparse=sparse,
            lut=levels,
            lut_scale=scale,
            lut_zero=zero,
            packed=pack_codes(nearest_codes(w32, stored).to(torch.uint8), bits),
        )
    return LutWeight(
        bits=bits,
        in_features=int(weight.shape[1]),
        packed=pack_codes(codes, bits),
        lut=centroids.to(LUT_DTYPE),
        sparse=sparse,
    )


def compensate_lut(
    plain: LutWeight,
    weight: Tensor,
    hessian: Tensor,
    *,
    mask: Tensor | None = None,
    damp: float = DEFAULT_DAMP,
    refit: bool = False,
    act_order: bool = False,
    refit_rounds: int = 0,
) -> LutWeight:
    """``plain`` (the k-means LUT weight of float (R, N) ``weight``) with its codes re-chosen column by column
    with GPTQ error compensation against float (N, N) ``hessian`` (squeeze.quant.ec). Same LUT, sparse part
    and format; with ``refit`` the LUT is refitted once to the compensated codes (least squares under H),
    rounded as stored and re-sorted ascending (the codes follow their entries). ``refit_rounds`` > 0 instead
    alternates refit and compensation that many rounds (squeeze.quant.ec.refitted_codes), each row keeping its
    best pair under H. ``mask``: the sparse positions ``plain`` was built with (exact, never updated).
    ``act_order``: columns in descending diag(H) order (GPTQ's act-order)."""
    w32 = weight.detach().to(torch.float32)
    k = 1 << plain.bits
    if refit_rounds > 0:
        return _refitted(plain, w32, hessian, mask=mask, damp=damp, act_order=act_order, rounds=refit_rounds)
    codes = compensated_codes(w32, plain.lut_values(), hessian, mask=mask, damp=damp, act_order=act_order)
    result = replace(plain, packed=pack_codes(codes.to(torch.uint8), plain.bits))
    if not refit:
        return result
    fitted = refit_lut(w32, codes, hessian, k, mask=mask, damp=damp)
    # entries no weight uses keep theirs, and so does a row whose system was singular (NaN)
    used = torch.nn.functional.one_hot(codes, k).sum(dim=1) > 0  # (R, K)
    centroids = torch.where(used & torch.isfinite(fitted), fitted, plain.lut_values()).to(LUT_DTYPE).to(torch.float32)
    # keep the codes the LUT was fitted to (least squares: no worse than before), re-sorted ascending
    centroids, order = centroids.sort(dim=1, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(k).expand_as(order))  # old index -> new
    codes = rank.gather(1, codes)
    if isinstance(plain, Lut8Weight):
        levels, scale, zero = affine_lut8(centroids)
        return replace(
            plain, lut=levels, lut_scale=scale, lut_zero=zero, packed=pack_codes(codes.to(torch.uint8), plain.bits)
        )
    return replace(plain, lut=centroids.to(LUT_DTYPE), packed=pack_codes(codes.to(torch.uint8), plain.bits))


def _refitted(
    plain: LutWeight, w32: Tensor, hessian: Tensor, *, mask: Tensor | None, damp: float, act_order: bool, rounds: int
) -> LutWeight:
    """compensate_lut with ``refit_rounds``: the levels rounded as this format stores them at every round (the
    codes are chosen against the stored values), rows that kept round 0 keep ``plain``'s LUT bit for bit."""
    if isinstance(plain, Lut8Weight):

        def store(levels: Tensor) -> Tensor:
            q, scale, zero = affine_lut8(levels)
            return q.to(torch.float32) * scale.to(torch.float32) + zero.to(torch.float32)

    else:

        def store(levels: Tensor) -> Tensor:
            return levels.to(LUT_DTYPE).to(torch.float32)

    best = refitted_codes(
        w32, plain.lut_values(), hessian, store, rounds=rounds, mask=mask, damp=damp, act_order=act_order
    )
    packed = pack_codes(best.codes.to(torch.uint8), plain.bits)
    new = (best.round > 0)[:, None]  # (R, 1): rows whose levels changed
    if isinstance(plain, Lut8Weight):
        q, scale, zero = affine_lut8(best.levels)
        return replace(
            plain,
            packed=packed,
            lut=torch.where(new, q, plain.lut),
            lut_scale=torch.where(new, scale, plain.lut_scale),
            lut_zero=torch.where(new, zero, plain.lut_zero),
        )
    return replace(plain, packed=packed, lut=torch.where(new, best.levels.to(LUT_DTYPE), plain.lut))


__all__ = [
    "LutWeight",
    "Lut8Weight",
    "quantize_lut",
    "compensate_lut",
    "affine_lut8",
    "LUT_DTYPE",
    "LUT8_DTYPE",
    "SPARSE_ROLES",
]
