"""The contract of a weight format: one class per on-disk format of a quantized linear weight.

A format class is a frozen dataclass holding one matrix's quantized tensors. It declares, once:

* ``name`` (registry key), ``method`` (the ``quantization_config.modules[*].method`` it writes and reads)
  and ``recipe_match`` / ``recipe_options`` (which recipe selects it, which recipe keys it uses);
* ``roles``: every tensor it stores as ``{module}.{role}``, with dtype and symbolic shape. The generic
  ``from_tensors`` checks presence, dtype and shape from this description alone, ``estimate_bytes`` sums
  it, inspect and both loaders read role names from it;
* the math: ``quantize`` (classmethod), ``dequantize`` (the reference every kernel is tested against),
  ``row_slice`` (rows of the weight, for the runtime's chunked paths), ``col_slice`` (columns of the weight,
  for tensor-parallel row-parallel layers; optional: a format without it raises NotImplementedError) and
  ``check_values``.

The runtime builds one generic module (``SqueezeLinear``) for every format; ``kernel`` names the kernel
family that may replace its reference path ("lut": the Triton LUT kernels), or None.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import Tensor

from squeeze.errors import FormatError
from squeeze.limits import WEIGHT_BITS, check_weight_bits, is_int
from squeeze.quant.packing import pack_codes, packed_row_bytes, unpack_codes
from squeeze.quant.schemes.roles import (
    Role,
    check_meta,
    check_role,
    dtype_bytes,
    present_roles,
)

Timer = Callable[[str], contextlib.AbstractContextManager[Any]]
W = TypeVar("W", bound="WeightFormat")


class QuantOptions(Protocol):
    """What a quantizer reads from a recipe (``squeeze.config.WeightsConfig`` has these attributes)."""

    @property
    def bits(self) -> int: ...
    @property
    def group_size(self) -> int | None: ...
    @property
    def sensitive_fraction(self) -> float: ...
    @property
    def outlier_fraction(self) -> float: ...
    @property
    def lut_dtype(self) -> str: ...


def no_timer(_name: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass(frozen=True, kw_only=True)
class WeightFormat:
    """Base of every format: bits per code and codes per row; subclasses add their tensors as fields."""

    name: ClassVar[str]
    method: ClassVar[str]
    roles: ClassVar[tuple[Role, ...]]
    #: Recipe values that select this format among those sharing its method (e.g. lut_dtype: int8).
    recipe_match: ClassVar[Mapping[str, object]] = {}
    #: Recipe keys (besides bits) this format uses; others must keep their defaults.
    recipe_options: ClassVar[frozenset[str]] = frozenset()
    #: Whether ``quantize`` uses the Fisher sensitivities (then compress calibrates unless the recipe's
    #: sensitivity is "uniform"); formats that ignore ``fisher`` need no calibration text.
    uses_fisher: ClassVar[bool] = False
    #: Whether ``quantize`` takes ``hessian=`` (the layer inputs' ``sum x x^T``) for error compensation, used
    #: when the recipe's ``weights.error_compensation`` is on (then compress accumulates it while calibrating).
    uses_hessian: ClassVar[bool] = False
    #: Kernel family that may run this format instead of the reference path ("lut"), or None.
    kernel: ClassVar[str | None] = None
    #: Whether the weight is levels gathered by fixed codes (``lut_values()``, ``codes()``, ``sparse``) whose
    #: levels ``with_levels`` can replace: what ``weights.tuning`` trains (squeeze.quant.tuning).
    tunable: ClassVar[bool] = False
    #: Per-module parameters beyond bits / in_features that the artifact's module entry carries; each is also
    #: the recipe option (``weights.<name>``) it is quantized with.
    module_params: ClassVar[tuple[str, ...]] = ()
    #: Code widths an artifact may store in this format: the linears' (squeeze.limits.WEIGHT_BITS), or more
    #: for a format that also stores embedding rows (RTN: squeeze.limits.CODE_BITS, with 6-bit rows).
    widths: ClassVar[tuple[int, ...]] = WEIGHT_BITS

    bits: int
    in_features: int
    packed: Tensor

    # -- what subclasses implement -------------------------------------------------------------------

    @classmethod
    def quantize(
        cls: type[W], weight: Tensor, fisher: Tensor | None, options: QuantOptions, timer: Timer = no_timer
    ) -> W:
        """Quantize float (R, N) ``weight`` (``fisher``: (R, N) sensitivities or None)."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(R, N) in ``dtype``: the reference arithmetic."""
        raise NotImplementedError

    def tensors_by_role(self) -> dict[str, Tensor]:
        """role name -> tensor, for every role stored (optional parts only when present)."""
        raise NotImplementedError

    @classmethod
    def from_roles(
        cls: type[W], bits: int, in_features: int, params: Mapping[str, Any], found: Mapping[str, Tensor]
    ) -> W:
        """Build from checked tensors (role name -> tensor) and the module parameters."""
        raise NotImplementedError

    def row_slice(self: W, start: int, stop: int) -> W:
        """Rows [start, stop) as a weight of the same format, sharing storage (rows are packed apart)."""
        raise NotImplementedError

    def _col_slice(self: W, start: int, stop: int) -> W:
        """``col_slice`` past its range check (0 <= start <= stop <= in_features holds)."""
        raise NotImplementedError(
            f"the {self.name!r} weight format ({type(self).__qualname__}) cannot be sliced by columns"
        )

    def check_values(self, prefix: str) -> None:
        """FormatError when stored values break the format (non-finite scales...); shapes are checked already."""

    def with_levels(self: W, values: Tensor) -> W:
        """A tunable format (``tunable``): this weight with each row's levels replaced by float (R, 2**bits)
        ``values`` as the format stores them; same code assignment and sparse part."""
        raise NotImplementedError(f"the {self.name!r} weight format has no levels to replace")

    @classmethod
    def extra_dims(cls, in_features: int, params: Mapping[str, Any]) -> dict[str, int]:
        """Symbols of ``roles`` beyond the common ones (e.g. "groups")."""
        return {}

    @classmethod
    def expected_nnz(cls, rows: int, cols: int, options: QuantOptions) -> int:
        """Sparse entries a (rows, cols) matrix gets under ``options`` (0 for formats without a sparse part)."""
        return 0

    # -- generic, from the description ---------------------------------------------------------------

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0])

    def codes(self) -> Tensor:
        """uint8 (R, N): the unpacked codes."""
        return unpack_codes(self.packed, self.bits, self.in_features)

    def col_slice(self: W, start: int, stop: int) -> W:
        """Columns [start, stop) of the weight as a weight of the same format with in_features = stop - start
        (tensor-parallel row-parallel layers split their input columns across devices).

        ``dequantize()`` of the result equals ``dequantize()[:, start:stop]`` bit for bit. ValueError for a
        range outside [0, in_features] (or one the format cannot cut, e.g. RTN off a group boundary);
        NotImplementedError, naming the format, for a format without column slices.
        """
        if not (is_int(start) and is_int(stop) and 0 <= start <= stop <= self.in_features):
            raise ValueError(
                f"column slice [{start!r}, {stop!r}) must satisfy 0 <= start <= stop <= in_features = "
                f"{self.in_features}"
            )
        return self._col_slice(start, stop)

    def packed_cols(self, start: int, stop: int) -> Tensor:
        """uint8 (R, ceil((stop - start) * bits / 8)): the codes of columns [start, stop), packed as rows of
        their own (a range starting mid-byte is re-aligned to bit 0); the range is one col_slice has checked.
        Contiguous; may share the stored memory."""
        if (start * self.bits) % 8 == 0 and ((stop * self.bits) % 8 == 0 or stop == self.in_features):
            # whole bytes: the stored bytes already are the slice's packing (the tail's pad bits stay as stored)
            return self.packed[:, start * self.bits // 8 : packed_row_bytes(stop, self.bits)].contiguous()
        # unpack only the whole-byte groups of codes that hold the range (8 codes = 3 bytes at 3 bits), not the row
        group = math.lcm(self.bits, 8) // self.bits
        first = start // group * group
        lo = first * self.bits // 8
        window = self.packed[:, lo : lo + packed_row_bytes(stop - first, self.bits)]
        codes = unpack_codes(window, self.bits, stop - first)[:, start - first :]
        return pack_codes(codes.contiguous(), self.bits)

    @classmethod
    def cat_rows(cls: type[W], parts: Sequence[W]) -> W:
        """The weights ``parts`` (this format, equal bits, in_features and module parameters) stacked by rows:
        ``dequantize()`` of the result equals ``torch.cat([p.dequantize() for p in parts])``.

        Generic, from ``roles``: a role whose first dimension is "rows" is concatenated, a "rows+1" one (a CSR
        row pointer) concatenated with each part's entries offset by the entries before it, an "nnz" one
        concatenated; an optional part some of ``parts`` lack is filled in empty for them. ValueError when the
        parts do not match or a role has no row dimension.
        """
        if not parts:
            raise ValueError("cat_rows needs at least one weight")
        first = parts[0]
        for part in parts:
            if type(part) is not cls or (part.bits, part.in_features, part.params()) != (
                first.bits,
                first.in_features,
                first.params(),
            ):
                raise ValueError(f"cat_rows needs {cls.__name__} weights of equal bits, in_features and parameters")
        tensors = [part.tensors_by_role() for part in parts]
        found: dict[str, Tensor] = {}
        for role in cls.roles:
            present = [t[role.name] for t in tensors if role.name in t]
            if not present:
                continue
            dim = role.shape[0] if role.shape else None
            if dim == "rows":
                if len(present) != len(parts):
                    raise ValueError(f"cat_rows: only some parts store {role.name}")
                found[role.name] = torch.cat(present)
            elif dim == "nnz":
                found[role.name] = torch.cat(present)
            elif dim == "rows+1":
                offset, pieces = 0, [present[0].new_zeros(1)]
                for part, t in zip(parts, tensors, strict=True):
                    pointer = t.get(role.name, present[0].new_zeros(part.out_features + 1))
                    pieces.append(pointer[1:] - pointer[0] + offset)
                    offset += int(pointer[-1] - pointer[0])
                found[role.name] = torch.cat(pieces)
            else:
                raise ValueError(f"cat_rows: {cls.__name__}.{role.name} has no row dimension")
        return cls.from_roles(first.bits, first.in_features, first.params(), found)

    def params(self) -> dict[str, Any]:
        """This weight's module parameters (``module_params``), as ``from_tensors`` takes them."""
        return {key: getattr(self, key) for key in self.module_params}

    def spec_params(self) -> dict[str, Any]:
        """The module parameters as the artifact's module entry spells them (default: ``params()``)."""
        return self.params()

    def module_spec(self) -> dict[str, Any]:
        """The artifact's ``quantization_config.modules`` entry for this weight."""
        return {
            "method": self.method,
            "bits": self.bits,
            "in_features": self.in_features,
            "out_features": self.out_features,
            **self.spec_params(),
        }

    def to_tensors(self, prefix: str) -> dict[str, Tensor]:
        """The tensors to store, named ``{prefix}.{role}``."""
        return {f"{prefix}.{role}": tensor for role, tensor in self.tensors_by_role().items()}

    def storage_bits(self) -> int:
        """Exact stored size in bits of every tensor."""
        return sum(t.numel() * t.element_size() * 8 for t in self.tensors_by_role().values())

    @classmethod
    def role_names(cls) -> tuple[str, ...]:
        return tuple(role.name for role in cls.roles)

    @classmethod
    def from_tensors(
        cls: type[W],
        tensors: Mapping[str, Tensor],
        prefix: str,
        *,
        bits: int,
        in_features: int,
        check_values: bool = True,
        out_features: int | None = None,
        **params: Any,
    ) -> W:
        """Rebuild from loaded tensors, checking every name, dtype, shape (and values unless told not to).

        ``check_values=False`` for meta tensors (shapes only). FormatError names the tensor, what was
        expected and what was found. ``out_features`` (the module entry's, when known) fixes the rows every
        tensor must have; otherwise the first tensor's rows are taken, and a transposed tensor would then be
        reported against a shape made of its own wrong rows.
        """
        check_meta(bits, in_features, prefix, cls.widths)
        unknown = set(params) - set(cls.module_params)
        if unknown:
            raise TypeError(
                f"{cls.__name__} takes module parameters {list(cls.module_params)}, found {sorted(unknown)}"
            )
        found = present_roles(cls.roles, tensors, prefix)
        dims = {
            "levels": 1 << bits,
            "packed": packed_row_bytes(in_features, bits),
            **cls.extra_dims(in_features, params),
        }
        if out_features is not None:
            dims["rows"], dims["rows+1"] = out_features, out_features + 1
        for role in cls.roles:
            if role.name in found:
                check_role(role, found[role.name], f"{prefix}.{role.name}", dims, in_features)
        weight = cls.from_roles(bits, in_features, params, found)
        if check_values:
            weight.check_values(prefix)
        return weight

    @classmethod
    def from_spec(
        cls: type[W], tensors: Mapping[str, Tensor], prefix: str, spec: Mapping[str, Any], *, check_values: bool = True
    ) -> W:
        """Rebuild from tensors and the artifact's module entry (``module_spec`` of the weight written)."""
        bits, in_features = spec.get("bits"), spec.get("in_features")
        if not is_int(bits) or not is_int(in_features):
            raise FormatError(f"quantization_config.modules[{prefix!r}] lacks integer 'bits' / 'in_features'")
        where = f"quantization_config.modules[{prefix!r}].bits"
        check_weight_bits(bits, where, FormatError, hint=None, widths=cls.widths)
        params = {key: spec.get(key) for key in cls.module_params}
        out_features = spec.get("out_features")
        return cls.from_tensors(
            tensors,
            prefix,
            bits=bits,
            in_features=in_features,
            check_values=check_values,
            out_features=out_features if is_int(out_features) and out_features >= 1 else None,
            **cls.normalise_params(params, in_features),
        )

    @classmethod
    def normalise_params(cls, params: dict[str, Any], in_features: int) -> dict[str, Any]:
        """Module parameters as read from an artifact entry, with their defaults filled in."""
        return params

    @classmethod
    def estimate_bytes(cls, rows: int, cols: int, options: QuantOptions, value_bytes: int) -> int:
        """Exact stored bytes of a (rows, cols) matrix under ``options``, the sparse part by its expected size.

        ``value_bytes``: bytes per sparse value (the model's dtype).
        """
        nnz = cls.expected_nnz(rows, cols, options)
        dims = {
            "rows": rows,
            "rows+1": rows + 1,
            "nnz": nnz,
            "levels": 1 << options.bits,
            "packed": packed_row_bytes(cols, options.bits),
            **cls.extra_dims(cols, {key: getattr(options, key, None) for key in cls.module_params}),
        }
        total = 0
        for role in cls.roles:
            if role.part and not nnz:
                continue
            count = 1
            for dim in role.shape:
                count *= dim if isinstance(dim, int) else dims[dim]
            total += count * dtype_bytes(role.dtype, cols, value_bytes)
        return total


__all__ = [
    "WeightFormat",
    "Role",
    "QuantOptions",
    "Timer",
    "no_timer",
]
