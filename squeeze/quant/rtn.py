"""Round-to-nearest (RTN) baseline: asymmetric min/max quantization per output channel or per group.

For each group: the range [min(w_min, 0), max(w_max, 0)] is split into 2**bits - 1 steps, so
``w ~ (q - zero) * scale`` with an integer ``zero`` in [0, 2**bits - 1]. Including 0 in the range (as
GPTQ-style RTN does) keeps ``zero`` a small integer, exactly representable in the float16 it is stored in.

The scale is rounded UP to float16 before quantizing, and quantization uses that stored scale, so the
dequantized round trip matches what a loader computes and every error is at most scale / 2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from squeeze.errors import ModelError
from squeeze.quant.packing import check_bits, pack_codes
from squeeze.quant.qweight import SCALE_DTYPE, RtnWeight, rtn_groups


def rtn_quantize(weight: Tensor, bits: int, group_size: int | None = None) -> RtnWeight:
    """Quantize weight float (R, N) with ``bits``-bit asymmetric RTN; ``group_size=None`` = one group per row.

    Returns an RtnWeight with scales and zeros float16 (R, G), G = ceil(N / group_size) (the last group may
    be partial). Groups whose range is 0 (all zeros) get scale 1 and zero 0, so they reconstruct exactly.
    """
    # contract checks (ValueError): recipes were validated against squeeze.limits at the boundary
    check_bits(bits)
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

    scale = (hi - lo) / qmax
    scale16 = scale.to(SCALE_DTYPE)
    # round up, so [-zero * s, (qmax - zero) * s] still covers [lo, hi] with the stored scale
    up = torch.nextafter(scale16, torch.full_like(scale16, float("inf")))
    scale16 = torch.where(scale16.to(torch.float32) < scale, up, scale16)
    if not bool(torch.isfinite(scale16).all()):
        raise ModelError("weight range too large for float16 scales (|w| beyond ~65504 * (2**bits - 1))")
    scale16 = torch.where(scale16 > 0, scale16, torch.ones_like(scale16))  # all-zero group
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
        zeros=zero.to(SCALE_DTYPE),
    )


__all__ = ["rtn_quantize"]
