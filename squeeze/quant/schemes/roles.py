"""A weight format's stored tensors, described as roles (name, dtype, symbolic shape, optional part), and the
generic checks of loaded tensors against them (file data -> FormatError naming the tensor, what was expected and
what was found). squeeze.quant.schemes.base builds WeightFormat.from_tensors and estimate_bytes on these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.errors import FormatError
from squeeze.limits import check_weight_bits, is_int
from squeeze.quant.sparse import SparseCSR

#: dtype of fp16 LUT entries and of every per-row / per-group scale and zero point.
HALF = torch.float16
#: A role whose dtype is any floating-point type (the sparse part's exact values keep the model's dtype).
ANY_FLOAT = "float"
#: A role whose dtype follows the column count (int16 column indices up to 32767 columns, else int32).
COLUMN_INDEX = "column_index"


@dataclass(frozen=True)
class Role:
    """One stored tensor of a format: ``{module}.{name}``.

    dtype: a torch dtype, ANY_FLOAT or COLUMN_INDEX. shape: each dimension an int or a symbol: "rows",
    "rows+1", "packed" (bytes of one packed row), "levels" (2**bits), "groups", "nnz". A symbol not known
    yet is bound by the first tensor that has it ("rows" by ``weight_packed``, "nnz" by the sparse columns).
    part: roles of one optional part ("sparse") are stored all together or not at all; "" = always stored.
    """

    name: str
    dtype: torch.dtype | str
    shape: tuple[int | str, ...]
    part: str = ""


def check_meta(bits: int, in_features: int, prefix: str, widths: tuple[int, ...]) -> None:
    check_weight_bits(bits, f"{prefix}: bits", FormatError, hint=None, widths=widths)
    if not is_int(in_features) or in_features < 0:
        raise FormatError(f"{prefix}: in_features must be an integer >= 0, found {in_features!r}")


def present_roles(roles: tuple[Role, ...], tensors: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """role -> tensor for the roles present; FormatError for a missing required role or a partial part."""
    found: dict[str, Tensor] = {}
    for role in roles:
        name = f"{prefix}.{role.name}"
        if name not in tensors:
            continue
        value = tensors[name]
        if not isinstance(value, Tensor):
            raise FormatError(f"{name} must be a tensor, found {type(value).__name__}")
        found[role.name] = value
    for part in dict.fromkeys(role.part for role in roles):
        members = [role.name for role in roles if role.part == part]
        missing = [f"{prefix}.{m}" for m in members if m not in found]
        if not part and missing:
            raise FormatError(f"missing tensor {missing[0]}")
        if part and missing and len(missing) < len(members):
            raise FormatError(f"incomplete {part} part: missing tensor(s) {', '.join(missing)}")
    return found


def check_role(role: Role, tensor: Tensor, name: str, dims: dict[str, int], in_features: int) -> None:
    """Check dtype and shape; binds symbols not known yet (rows, nnz) from the tensor."""
    if isinstance(role.dtype, torch.dtype):
        dtype_ok, want_dtype = tensor.dtype == role.dtype, str(role.dtype)
    elif role.dtype == ANY_FLOAT:
        dtype_ok, want_dtype = tensor.is_floating_point(), "a floating-point"
    else:
        column_dtype = column_index_dtype(in_features)
        dtype_ok, want_dtype = tensor.dtype == column_dtype, str(column_dtype)
    shape_ok = tensor.dim() == len(role.shape)
    for dim, size in zip(role.shape, tensor.shape, strict=False):  # a rank mismatch is reported below
        if isinstance(dim, str) and dim not in dims and shape_ok:
            dims[dim] = int(size)
            if dim == "rows":
                dims["rows+1"] = int(size) + 1
        want = dim if isinstance(dim, int) else dims.get(dim)
        shape_ok = shape_ok and want == size
    if not (dtype_ok and shape_ok):
        shown = tuple(dim if isinstance(dim, int) else dims.get(dim, dim) for dim in role.shape)
        shape_text = "(" + ", ".join(map(str, shown)) + ("," if len(shown) == 1 else "") + ")"
        raise FormatError(f"{name}: expected {want_dtype} {shape_text}, found {tensor.dtype} {tuple(tensor.shape)}")


def column_index_dtype(n_cols: int) -> torch.dtype:
    """int16 column indices up to 32767 columns, int32 beyond (the sparse part's ``weight_sparse_cols``)."""
    return SparseCSR.col_dtype(n_cols)


def dtype_bytes(dtype: torch.dtype | str, cols: int, value_bytes: int) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    return value_bytes if dtype == ANY_FLOAT else column_index_dtype(cols).itemsize


__all__ = [
    "Role",
    "HALF",
    "ANY_FLOAT",
    "COLUMN_INDEX",
    "column_index_dtype",
    "check_meta",
    "present_roles",
    "check_role",
    "dtype_bytes",
]
