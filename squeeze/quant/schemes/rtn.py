"""Round-to-nearest (RTN) baseline: asymmetric min/max quantization per output channel or per group.

For each group: the range [min(w_min, 0), max(w_max, 0)] is split into 2**bits - 1 steps, so
``w ~ (q - zero) * scale`` with an integer ``zero`` in [0, 2**bits - 1]. Including 0 in the range (as
GPTQ-style RTN does) keeps ``zero`` a small integer, exactly representable in the float16 it is stored in.

The scale is rounded UP to float16 before quantizing, and quantization uses that stored scale, so the
dequantized round trip matches what a loader computes and every error is at most scale / 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from squeeze.errors import FormatError, ModelError
from squeeze.limits import CODE_BITS, check_group_size
from squeeze.quant.packing import check_code_bits, pack_codes
from squeeze.quant.schemes.base import QuantOptions, Timer, WeightFormat, no_timer
from squeeze.quant.schemes.roles import HALF, Role


@dataclass(frozen=True, kw_only=True)
class RtnWeight(WeightFormat):
    """RTN weight, w ~ (q - zero) * scale per group. group_size: columns per group, or None for one group
    per row; G = ceil(N / group_size) (the last may be partial). packed uint8 (R, ceil(N * bits / 8));
    scales float16 (R, G) > 0; zeros float16 (R, G), integer-valued in [0, 2**bits - 1]."""

    name: ClassVar[str] = "rtn"
    method: ClassVar[str] = "rtn"
    recipe_options: ClassVar[frozenset[str]] = frozenset({"group_size"})
    module_params: ClassVar[tuple[str, ...]] = ("group_size",)
    #: 6-bit codes too: the format of 6-bit embedding rows (weights.embedding_bits: 6); linears keep to
    #: WEIGHT_BITS, checked where a recipe is read.
    widths: ClassVar[tuple[int, ...]] = CODE_BITS
    roles: ClassVar[tuple[Role, ...]] = (
        Role("weight_packed", torch.uint8, ("rows", "packed")),
        Role("weight_scales", HALF, ("rows", "groups")),
        Role("weight_zeros", HALF, ("rows", "groups")),
    )

    group_size: int | None
    scales: Tensor
    zeros: Tensor

    @property
    def n_groups(self) -> int:
        return rtn_groups(self.in_features, self.group_size)

    def spec_params(self) -> dict[str, Any]:
        # artifacts spell per-channel as one group of the whole row
        return {"group_size": self.group_size or self.in_features}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(R, N) in ``dtype``: (q - zero) * scale of each column's group, computed in float32."""
        gs = self.group_size or max(1, self.in_features)
        scales = self.scales.to(torch.float32).repeat_interleave(gs, dim=1)[:, : self.in_features]
        zeros = self.zeros.to(torch.float32).repeat_interleave(gs, dim=1)[:, : self.in_features]
        return ((self.codes().to(torch.float32) - zeros) * scales).to(dtype)

    def tensors_by_role(self) -> dict[str, Tensor]:
        return {"weight_packed": self.packed, "weight_scales": self.scales, "weight_zeros": self.zeros}

    @classmethod
    def extra_dims(cls, in_features: int, params: Mapping[str, Any]) -> dict[str, int]:
        return {"groups": rtn_groups(in_features, params.get("group_size"))}

    @classmethod
    def normalise_params(cls, params: dict[str, Any], in_features: int) -> dict[str, Any]:
        return {"group_size": params.get("group_size") or in_features}

    @classmethod
    def from_roles(
        cls, bits: int, in_features: int, params: Mapping[str, Any], found: Mapping[str, Tensor]
    ) -> RtnWeight:
        return cls(
            bits=bits,
            in_features=in_features,
            group_size=params.get("group_size"),
            packed=found["weight_packed"],
            scales=found["weight_scales"],
            zeros=found["weight_zeros"],
        )

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, Tensor],
        prefix: str,
        *,
        bits: int,
        in_features: int,
        check_values: bool = True,
        **params: Any,
    ) -> RtnWeight:
        check_group_size(params.get("group_size"), f"{prefix}: group_size", FormatError, hint=None)
        return super().from_tensors(
            tensors, prefix, bits=bits, in_features=in_features, check_values=check_values, **params
        )

    def check_values(self, prefix: str) -> None:
        if not bool(torch.isfinite(self.scales).all()):
            raise FormatError(f"{prefix}.weight_scales must be finite")
        z = self.zeros.to(torch.float32)
        top = (1 << self.bits) - 1
        if z.numel() and not bool(((z == z.round()) & (z >= 0) & (z <= top)).all()):
            raise FormatError(f"{prefix}.weight_zeros must hold integers in [0, {top}]")

    def row_slice(self, start: int, stop: int) -> RtnWeight:
        return RtnWeight(
            bits=self.bits,
            in_features=self.in_features,
            group_size=self.group_size,
            packed=self.packed[start:stop],
            scales=self.scales[start:stop],
            zeros=self.zeros[start:stop],
        )

    def _col_slice(self, start: int, stop: int) -> RtnWeight:
        gs = self.group_size
        if gs is None or gs >= self.in_features:  # one group per row: its scale / zero serve any columns
            scales, zeros = self.scales, self.zeros
        else:
            # a group cut in two would need its scale twice: the range must start and stop on group boundaries
            if start % gs:
                raise ValueError(
                    f"an RTN column slice must start on a group boundary (a multiple of group_size {gs}), "
                    f"found start {start}"
                )
            if stop % gs and stop != self.in_features:
                raise ValueError(
                    f"an RTN column slice must stop on a group boundary (a multiple of group_size {gs}) or at "
                    f"in_features {self.in_features}, found stop {stop}"
                )
            groups = slice(start // gs, -(-stop // gs))
            scales, zeros = self.scales[:, groups].contiguous(), self.zeros[:, groups].contiguous()
        return RtnWeight(
            bits=self.bits,
            in_features=stop - start,
            group_size=gs,
            packed=self.packed_cols(start, stop),
            scales=scales,
            zeros=zeros,
        )

    @classmethod
    def quantize(
        cls, weight: Tensor, fisher: Tensor | None, options: QuantOptions, timer: Timer = no_timer
    ) -> RtnWeight:
        with timer("rtn"):
            return rtn_quantize(weight, options.bits, options.group_size)


def rtn_groups(in_features: int, group_size: int | None) -> int:
    """Groups per row: 1 for per-channel (None), else ceil(in_features / group_size) (0 for empty rows)."""
    if group_size is None:
        return 1
    return -(-in_features // group_size)


def rtn_quantize(weight: Tensor, bits: int, group_size: int | None = None) -> RtnWeight:
    """Quantize weight float (R, N) with ``bits``-bit asymmetric RTN; ``group_size=None`` = one group per row.

    Returns an RtnWeight with scales and zeros float16 (R, G), G = ceil(N / group_size) (the last group may
    be partial). Groups whose range is 0 (all zeros) get scale 1 and zero 0, so they reconstruct exactly.
    """
    # contract checks (ValueError): recipes were validated against squeeze.limits at the boundary
    check_code_bits(bits)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        found = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D floating-point tensor, found {found}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size must be a positive integer or None, found {group_size!r}")
    w = weight.detach().to(torch.float32)
    if not bool(torch.isfinite(w).all()):  # the model's own weights: not squeeze's bug, not a usage error
        raise ModelError("weight contains NaN or infinite values")
    R, N = w.shape
    qmax = (1 << bits) - 1
    G = rtn_groups(N, group_size)
    gs = group_size if group_size is not None else max(N, 1)

    # (R, G, gs) view with the partial last group padded by zeros: 0 is inside every range anyway.
    padded = torch.zeros(R, G * gs, dtype=torch.float32, device=w.device)
    padded[:, :N] = w
    groups = padded.view(R, G, gs)
    lo = groups.amin(2).clamp(max=0)  # (R, G)
    hi = groups.amax(2).clamp(min=0)
    scale16 = _scale_up(hi, lo, qmax)
    s = scale16.to(torch.float32)
    zero = (-lo / s).round().clamp(0, qmax)  # (R, G), integer-valued

    q = (groups / s[:, :, None]).round() + zero[:, :, None]
    codes = q.clamp(0, qmax).to(torch.uint8).view(R, G * gs)[:, :N]
    return RtnWeight(
        bits=bits,
        in_features=N,
        group_size=group_size,
        packed=pack_codes(codes.contiguous(), bits),
        scales=scale16,
        zeros=zero.to(HALF),
    )


def _scale_up(hi: Tensor, lo: Tensor, qmax: int) -> Tensor:
    """float16 (R, G) scales, rounded up so [-zero * s, (qmax - zero) * s] still covers [lo, hi]; 1 for empty."""
    scale = (hi - lo) / qmax
    scale16 = scale.to(HALF)
    up = torch.nextafter(scale16, torch.full_like(scale16, float("inf")))
    scale16 = torch.where(scale16.to(torch.float32) < scale, up, scale16)
    if not bool(torch.isfinite(scale16).all()):
        raise ModelError("weight range too large for float16 scales (|w| beyond ~65504 * (2**bits - 1))")
    return torch.where(scale16 > 0, scale16, torch.ones_like(scale16))  # all-zero group


__all__ = ["RtnWeight", "rtn_quantize", "rtn_groups"]
