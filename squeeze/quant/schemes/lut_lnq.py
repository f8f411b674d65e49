"""A LUT weight refitted against the loss (squeeze.quant.lnq) in its own format: the glue between the solver and
:class:`~squeeze.quant.schemes.lut.LutWeight` / ``Lut8Weight`` (levels rounded as stored, sorted ascending with
the codes following them; rows that kept the starting pair keep its LUT bit for bit)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from squeeze.quant.lnq import LnqRefit, lnq_refit
from squeeze.quant.packing import pack_codes
from squeeze.quant.schemes.lut_parts import affine_lut8

if TYPE_CHECKING:  # lut.py imports this module when a recipe asks for the refit: no import back at run time
    from squeeze.quant.schemes.lut import LutWeight

#: Defaults of the recipe knobs (squeeze.weights_config): the ridge toward the k-means levels and the fit's
#: shrinkage of the input correlation toward the identity (the k-means objective).
DEFAULT_RIDGE = 0.1
DEFAULT_SHRINK = 0.1


def store_for(plain: LutWeight) -> object:
    """float32 (R, K) -> float32 (R, K): levels rounded as ``plain``'s format stores them."""
    if _is_lut8(plain):

        def store8(levels: Tensor) -> Tensor:
            q, scale, zero = affine_lut8(levels.sort(dim=1).values)
            grid = q.to(torch.float32) * scale.to(torch.float32) + zero.to(torch.float32)  # ascending
            # back to the caller's (unsorted) order: each level takes its sorted slot's stored value
            order = levels.argsort(dim=1, stable=True)
            return torch.empty_like(grid).scatter_(1, order, grid)

        return store8

    def store16(levels: Tensor) -> Tensor:
        return levels.to(plain.lut.dtype).to(torch.float32)

    return store16


def refit_against_loss(
    plain: LutWeight,
    weight: Tensor,
    fisher: Tensor | None,
    hessian: Tensor,
    held_out: Tensor,
    *,
    rounds: int,
    ridge: float = DEFAULT_RIDGE,
    shrink: float = DEFAULT_SHRINK,
    mask: Tensor | None = None,
) -> tuple[LutWeight, LnqRefit]:
    """(``plain`` with each row's LUT and codes from squeeze.quant.lnq.lnq_refit, its report). ``plain``: the
    k-means (or compensated) LUT weight of float (R, N) ``weight``; fisher float (R, N) or None; hessian /
    held_out float (N, N): the fitted and the held-out tokens' ``sum x x^T``; mask: the sparse positions
    ``plain`` was built with. Same format, same sparse part."""
    store = store_for(plain)
    result = lnq_refit(
        weight.detach().to(torch.float32),
        plain.lut_values(),
        plain.codes().to(torch.int64),
        fisher,
        hessian,
        held_out,
        store,  # type: ignore[arg-type]
        rounds=rounds,
        ridge=ridge,
        shrink=shrink,
        mask=mask,
    )
    k = result.levels.shape[1]
    levels, order = result.levels.sort(dim=1, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(k).expand_as(order))  # old index -> new
    codes = rank.gather(1, result.codes)
    new = (result.round > 0)[:, None]  # (R, 1): rows whose pair changed
    codes = torch.where(new, codes, plain.codes().to(torch.int64))
    packed = pack_codes(codes.to(torch.uint8), plain.bits)
    if _is_lut8(plain):
        q, scale, zero = affine_lut8(levels)
        eight: Any = plain  # a Lut8Weight (lut.py is not imported here at run time)
        out: LutWeight = replace(
            eight,
            packed=packed,
            lut=torch.where(new, q, eight.lut),
            lut_scale=torch.where(new, scale, eight.lut_scale),
            lut_zero=torch.where(new, zero, eight.lut_zero),
        )
    else:
        out = replace(plain, packed=packed, lut=torch.where(new, levels.to(plain.lut.dtype), plain.lut))
    return out, result


def _is_lut8(weight: LutWeight) -> bool:
    """Whether ``weight`` is the 8-bit LUT format (its levels on a per-row affine grid: lut_scale / lut_zero)."""
    return hasattr(weight, "lut_scale")


def layer_report(report: LnqRefit) -> dict[str, float]:
    """The layer's line of the compress report: held-out and fitted objective before / after, rows changed."""
    return {
        "held_out_before": report.before,
        "held_out_after": report.after,
        "fit_before": report.fit_before,
        "fit_after": report.fit_after,
        "rows_changed": float((report.round > 0).float().mean()),
    }


__all__ = ["DEFAULT_RIDGE", "DEFAULT_SHRINK", "layer_report", "refit_against_loss"]
