"""A toy weight format, registered by the tests that use it: symmetric per-row absmax integers.

w ~ code * scale with code in [-(2**(bits-1) - 1), 2**(bits-1) - 1] stored offset by 2**(bits-1) as
unsigned codes, one float16 scale per row. Nothing in squeeze names it: it exists to show that a format
is one class (the registry issue's acceptance test).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from squeeze.errors import FormatError
from squeeze.quant.packing import pack_codes
from squeeze.quant.schemes.base import QuantOptions, Timer, WeightFormat, no_timer
from squeeze.quant.schemes.roles import HALF, Role


@dataclass(frozen=True, kw_only=True)
class ToyAbsmaxWeight(WeightFormat):
    name: ClassVar[str] = "toy-absmax"
    method: ClassVar[str] = "toy"
    roles: ClassVar[tuple[Role, ...]] = (
        Role("weight_packed", torch.uint8, ("rows", "packed")),
        Role("weight_row_scale", HALF, ("rows", 1)),
    )

    row_scale: Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        offset = 1 << (self.bits - 1)
        return ((self.codes().to(torch.float32) - offset) * self.row_scale.to(torch.float32)).to(dtype)

    def tensors_by_role(self) -> dict[str, Tensor]:
        return {"weight_packed": self.packed, "weight_row_scale": self.row_scale}

    @classmethod
    def from_roles(
        cls, bits: int, in_features: int, params: Mapping[str, Any], found: Mapping[str, Tensor]
    ) -> ToyAbsmaxWeight:
        return cls(
            bits=bits, in_features=in_features, packed=found["weight_packed"], row_scale=found["weight_row_scale"]
        )

    def check_values(self, prefix: str) -> None:
        if not bool(torch.isfinite(self.row_scale).all()):
            raise FormatError(f"{prefix}.weight_row_scale must be finite")

    def row_slice(self, start: int, stop: int) -> ToyAbsmaxWeight:
        return ToyAbsmaxWeight(
            bits=self.bits,
            in_features=self.in_features,
            packed=self.packed[start:stop],
            row_scale=self.row_scale[start:stop],
        )

    @classmethod
    def quantize(
        cls, weight: Tensor, fisher: Tensor | None, options: QuantOptions, timer: Timer = no_timer
    ) -> ToyAbsmaxWeight:
        with timer("toy"):
            top = (1 << (options.bits - 1)) - 1
            w = weight.detach().to(torch.float32)
            scale = (w.abs().amax(dim=1, keepdim=True) / top).to(HALF)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes = (w / scale.to(torch.float32)).round().clamp(-top, top) + (1 << (options.bits - 1))
            return cls(
                bits=options.bits,
                in_features=int(w.shape[1]),
                packed=pack_codes(codes.to(torch.uint8), options.bits),
                row_scale=scale,
            )
