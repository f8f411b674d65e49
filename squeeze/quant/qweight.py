"""Quantized-weight containers shared by the quantizers, the file format and the runtime.

Each container knows its tensors' on-disk names (``{prefix}.weight_*``), rebuilds itself from a mapping
of loaded tensors with every shape and dtype checked (FormatError naming the tensor, what was expected and
what was found), counts its exact storage in bits, and dequantizes in plain torch. That ``dequantize`` is
the reference every kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.errors import FormatError
from squeeze.limits import check_group_size, check_weight_bits
from squeeze.quant.packing import packed_row_bytes, unpack_codes
from squeeze.quant.sparse import SparseCSR

LUT_DTYPE = torch.float16
LUT8_DTYPE = torch.uint8
SCALE_DTYPE = torch.float16

PACKED = "weight_packed"
LUT = "weight_lut"
LUT_SCALE = "weight_lut_scale"
LUT_ZERO = "weight_lut_zero"
SPARSE_ROWPTR = "weight_sparse_rowptr"
SPARSE_COLS = "weight_sparse_cols"
SPARSE_VALS = "weight_sparse_vals"
SCALES = "weight_scales"
ZEROS = "weight_zeros"


@dataclass(frozen=True)
class LutWeight:
    """SqueezeLLM weight: per-row LUT codes plus an optional exact sparse part.

    bits: code width; in_features: N (codes per row).
    packed uint8 (R, ceil(N * bits / 8)): codes, see :mod:`squeeze.quant.packing`.
    lut (R, 2**bits): each row's centroids (ascending), either float16 values, or uint8 levels on a
    per-row affine grid: value = level * lut_scale + lut_zero, with lut_scale / lut_zero float16 (R, 1)
    (the compact 8-bit LUT, half the LUT's bits).
    sparse: original weights that replace the dense value at their positions, or None.
    """

    bits: int
    in_features: int
    packed: Tensor
    lut: Tensor
    sparse: SparseCSR | None = None
    lut_scale: Tensor | None = None
    lut_zero: Tensor | None = None

    def lut_values(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(R, 2**bits) centroid values in ``dtype`` (8-bit LUTs are expanded in float32 first)."""
        if self.lut_scale is None or self.lut_zero is None:
            return self.lut.to(dtype)
        values = self.lut.to(torch.float32) * self.lut_scale.to(torch.float32) + self.lut_zero.to(torch.float32)
        return values.to(dtype)

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0])

    def codes(self) -> Tensor:
        """uint8 (R, N): the unpacked codes."""
        return unpack_codes(self.packed, self.bits, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(R, N) in ``dtype``: lut[r, code[r, c]], then the sparse values replace theirs (exact in their dtype)."""
        dense = self.lut_values().gather(1, self.codes().to(torch.int64)).to(dtype)  # (R, N)
        if self.sparse is not None:
            self.sparse.scatter_into(dense)
        return dense

    def storage_bits(self) -> int:
        """Exact stored size: packed codes + LUT + sparse part (rowptr, cols, vals)."""
        lut_parts = [t for t in (self.lut, self.lut_scale, self.lut_zero) if t is not None]
        bits = self.packed.numel() * 8 + sum(t.numel() * t.element_size() * 8 for t in lut_parts)
        return bits + (self.sparse.storage_bits() if self.sparse is not None else 0)

    def to_tensors(self, prefix: str) -> dict[str, Tensor]:
        """The tensors to store, named ``{prefix}.weight_packed`` etc."""
        out = {f"{prefix}.{PACKED}": self.packed, f"{prefix}.{LUT}": self.lut}
        if self.lut_scale is not None and self.lut_zero is not None:
            out[f"{prefix}.{LUT_SCALE}"] = self.lut_scale
            out[f"{prefix}.{LUT_ZERO}"] = self.lut_zero
        if self.sparse is not None:
            out[f"{prefix}.{SPARSE_ROWPTR}"] = self.sparse.rowptr
            out[f"{prefix}.{SPARSE_COLS}"] = self.sparse.cols
            out[f"{prefix}.{SPARSE_VALS}"] = self.sparse.vals
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor], prefix: str, bits: int, in_features: int) -> LutWeight:
        """Rebuild from loaded tensors, checking every name, dtype and shape (FormatError otherwise)."""
        _check_meta(bits, in_features, prefix)
        packed = _get(tensors, prefix, PACKED)
        rows = _check_packed(packed, f"{prefix}.{PACKED}", bits, in_features)
        lut = _get(tensors, prefix, LUT)
        scale = zero = None
        if lut.dtype == LUT8_DTYPE:  # the compact 8-bit LUT carries its per-row affine grid
            _check(lut, f"{prefix}.{LUT}", LUT8_DTYPE, (rows, 1 << bits))
            scale, zero = _get(tensors, prefix, LUT_SCALE), _get(tensors, prefix, LUT_ZERO)
            _check(scale, f"{prefix}.{LUT_SCALE}", SCALE_DTYPE, (rows, 1))
            _check(zero, f"{prefix}.{LUT_ZERO}", SCALE_DTYPE, (rows, 1))
            if not bool(torch.isfinite(scale).all() & torch.isfinite(zero).all()):
                raise FormatError(f"{prefix}.{LUT_SCALE} / {LUT_ZERO} must be finite")
        else:
            _check(lut, f"{prefix}.{LUT}", LUT_DTYPE, (rows, 1 << bits))
        sparse = _sparse_from_tensors(tensors, prefix, rows, in_features)
        return cls(bits=bits, in_features=in_features, packed=packed, lut=lut, sparse=sparse, lut_scale=scale,
                   lut_zero=zero)


@dataclass(frozen=True)
class RtnWeight:
    """Round-to-nearest baseline weight: asymmetric per group, w ~ (q - zero) * scale.

    group_size: columns per group, or None for one group per row. G = ceil(N / group_size) (last may be
    partial). packed uint8 (R, ceil(N * bits / 8)); scales float16 (R, G) > 0; zeros float16 (R, G),
    integer-valued in [0, 2**bits - 1].
    """

    bits: int
    in_features: int
    group_size: int | None
    packed: Tensor
    scales: Tensor
    zeros: Tensor

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0])

    @property
    def n_groups(self) -> int:
        return rtn_groups(self.in_features, self.group_size)

    def codes(self) -> Tensor:
        """uint8 (R, N): the unpacked codes."""
        return unpack_codes(self.packed, self.bits, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(R, N) in ``dtype``: (q - zero) * scale of each column's group, computed in float32."""
        gs = self.group_size or max(1, self.in_features)
        scales = self.scales.to(torch.float32).repeat_interleave(gs, dim=1)[:, : self.in_features]
        zeros = self.zeros.to(torch.float32).repeat_interleave(gs, dim=1)[:, : self.in_features]
        return ((self.codes().to(torch.float32) - zeros) * scales).to(dtype)

    def storage_bits(self) -> int:
        """Exact stored size: packed codes + scales + zeros."""
        return self.packed.numel() * 8 + sum(t.numel() * t.element_size() * 8 for t in (self.scales, self.zeros))

    def to_tensors(self, prefix: str) -> dict[str, Tensor]:
        """The tensors to store: ``{prefix}.weight_packed``, ``.weight_scales``, ``.weight_zeros``."""
        return {f"{prefix}.{PACKED}": self.packed, f"{prefix}.{SCALES}": self.scales, f"{prefix}.{ZEROS}": self.zeros}

    @classmethod
    def from_tensors(
        cls, tensors: Mapping[str, Tensor], prefix: str, bits: int, in_features: int, group_size: int | None
    ) -> RtnWeight:
        """Rebuild from loaded tensors, checking every name, dtype, shape and the zero points."""
        _check_meta(bits, in_features, prefix)
        check_group_size(group_size, f"{prefix}: group_size", FormatError, hint=None)
        packed = _get(tensors, prefix, PACKED)
        rows = _check_packed(packed, f"{prefix}.{PACKED}", bits, in_features)
        groups = rtn_groups(in_features, group_size)
        scales = _get(tensors, prefix, SCALES)
        _check(scales, f"{prefix}.{SCALES}", SCALE_DTYPE, (rows, groups))
        zeros = _get(tensors, prefix, ZEROS)
        _check(zeros, f"{prefix}.{ZEROS}", SCALE_DTYPE, (rows, groups))
        if not bool(torch.isfinite(scales).all()):
            raise FormatError(f"{prefix}.{SCALES} must be finite")
        z = zeros.to(torch.float32)
        if zeros.numel() and not bool(((z == z.round()) & (z >= 0) & (z <= (1 << bits) - 1)).all()):
            raise FormatError(f"{prefix}.{ZEROS} must hold integers in [0, {(1 << bits) - 1}]")
        return cls(bits=bits, in_features=in_features, group_size=group_size, packed=packed, scales=scales, zeros=zeros)


QuantizedWeight = LutWeight | RtnWeight


def rtn_groups(in_features: int, group_size: int | None) -> int:
    """Groups per row: 1 for per-channel (None), else ceil(in_features / group_size) (0 for empty rows)."""
    if group_size is None:
        return 1
    return -(-in_features // group_size)


# ------------------------------------------------------------------------------------------------------
# Validation helpers (file data -> FormatError with the tensor's name, what was expected, what was found)


def _check_meta(bits: int, in_features: int, prefix: str) -> None:
    check_weight_bits(bits, f"{prefix}: bits", FormatError, hint=None)
    if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features < 0:
        raise FormatError(f"{prefix}: in_features must be an integer >= 0, found {in_features!r}")


def _get(tensors: Mapping[str, Tensor], prefix: str, role: str) -> Tensor:
    name = f"{prefix}.{role}"
    if name not in tensors:
        raise FormatError(f"missing tensor {name}")
    value = tensors[name]
    if not isinstance(value, Tensor):
        raise FormatError(f"{name} must be a tensor, found {type(value).__name__}")
    return value


def _check(t: Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise FormatError(f"{name}: expected {dtype} {shape}, found {t.dtype} {tuple(t.shape)}")


def _check_packed(packed: Tensor, name: str, bits: int, in_features: int) -> int:
    """Validate packed codes and return the row count."""
    width = packed_row_bytes(in_features, bits)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != width:
        raise FormatError(
            f"{name}: expected uint8 (rows, {width}) for {in_features} {bits}-bit codes per row, "
            f"found {packed.dtype} {tuple(packed.shape)}"
        )
    return int(packed.shape[0])


def _sparse_from_tensors(tensors: Mapping[str, Tensor], prefix: str, rows: int, cols: int) -> SparseCSR | None:
    roles = (SPARSE_ROWPTR, SPARSE_COLS, SPARSE_VALS)
    present = [f"{prefix}.{r}" in tensors for r in roles]
    if not any(present):
        return None
    if not all(present):
        missing = [f"{prefix}.{r}" for r, p in zip(roles, present) if not p]
        raise FormatError(f"incomplete sparse part: missing tensor(s) {', '.join(missing)}")
    rowptr, col, vals = (_get(tensors, prefix, r) for r in roles)
    want_cols = SparseCSR.col_dtype(cols)
    if rowptr.dtype != torch.int32 or rowptr.dim() != 1 or rowptr.numel() != rows + 1:
        raise FormatError(
            f"{prefix}.{SPARSE_ROWPTR}: expected torch.int32 ({rows + 1},), found {rowptr.dtype} {tuple(rowptr.shape)}"
        )
    if col.dtype != want_cols or col.dim() != 1:
        raise FormatError(f"{prefix}.{SPARSE_COLS}: expected {want_cols} (nnz,), found {col.dtype} {tuple(col.shape)}")
    if not vals.is_floating_point() or vals.dim() != 1 or vals.numel() != col.numel():
        raise FormatError(
            f"{prefix}.{SPARSE_VALS}: expected a floating-point ({col.numel()},) tensor, "
            f"found {vals.dtype} {tuple(vals.shape)}"
        )
    sparse = SparseCSR(rowptr=rowptr, cols=col, vals=vals, shape=(rows, cols))
    try:
        sparse.validate(rows, cols)
    except FormatError as exc:
        raise FormatError(f"{prefix}: {exc.message}") from exc
    return sparse


__all__ = ["LutWeight", "RtnWeight", "QuantizedWeight", "rtn_groups", "LUT_DTYPE", "SCALE_DTYPE"]
