"""KV-cache calibration fits: key normalisers, value clipping ratios, value codebooks and fp8 scales.

Each fit takes one layer's calibration keys or values, ``(N, H, D)`` fp32 (N tokens, the sink excluded; see
squeeze.calibrate.kv_capture for how they are captured), and returns the quantizer parameters a
squeeze.quant.kv_spec.LayerKV holds plus the squared error they leave on those samples. The quantizers
themselves are squeeze.quant.kv's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.quant.kmeans import weighted_kmeans_1d
from squeeze.quant.kv import (
    FP8_E4M3_MAX,
    PARAM_BYTES,
    KeyRotation,
    codebook_scale,
    dequantize,
    dequantize_codebook,
    fake_quantize_fp8,
    fake_quantize_keys,
    key_channel_params,
    quantize,
    quantize_codebook,
    rope_trig,
    token_grid,
)
from squeeze.quant.kv_bytes import default_value_group

#: Multipliers tried on each channel's key scale by :func:`refine_key_scale` (1.0, the calibrated range, is the
#: start).
KEY_SCALE_STEPS = (0.5, 0.7, 0.85, 1.2, 1.4, 2.0)
#: Key elements (tokens x heads x channels) :func:`refine_key_scale` scores on, the tokens evenly strided: bounds
#: its cost (about F x tokens x heads x group^2 per channel) on wide heads while small heads keep every sample.
KEY_SEARCH_ELEMENTS = 2**19

#: Clipping ratios tried for per-token value grids (range shrunk to ``ratio * range``); 1.0 = plain min-max.
CLIP_GRID = tuple(round(0.5 + 0.025 * i, 3) for i in range(21))


def asymmetric_gain_needed(group: int) -> float:
    """Error ratio an asymmetric value grid must beat to pay for its per-token offset.

    The offset adds 16 bits per grid of ``group`` channels, i.e. 16 / group bits per value; one more bit per
    value cuts the squared error of a uniform grid by 4x, so the offset is worth it only when it cuts the
    error by more than 4 ** (16 / group) (1.41x for 64 channels): a rate-distortion rule, the same at 8 and
    4 bits.
    """
    return float(4.0 ** (-PARAM_BYTES * 8 / group))


@dataclass(frozen=True)
class KeyFit:
    """Key normaliser of one layer: scale / centre fp32 (H, D), a rotating centre or None; the squared error it
    had on calibration."""

    scale: Tensor
    zero: Tensor
    symmetric: bool
    sse: float
    rotation: KeyRotation | None = None


@dataclass(frozen=True)
class ValueFit:
    """Per-token value quantizer of one layer, grids of ``group`` channels: a clipping ratio per head, fp32
    (H,), or a codebook ``levels`` fp32 (2**bits,) (then ``clip`` is all ones and ``symmetric`` True)."""

    clip: Tensor
    symmetric: bool
    sse: float
    group: int
    levels: Tensor | None = None


def fit_keys(
    samples: Tensor,
    bits: int,
    group: int | None = None,
    *,
    positions: Tensor | None = None,
    rope_freq: Tensor | None = None,
    query_moments: Tensor | None = None,
) -> KeyFit:
    """Fit the per-channel key normaliser on ``samples (N, H, D)`` fp32 (N calibration tokens, sink excluded),
    for per-token grids of ``group`` channels (default: the whole head).

    With the samples' cache ``positions (N,)`` int64 and the model's RoPE frequencies ``rope_freq (D/2,)``
    (transformers' ``inv_freq``, rotate-half layout), a rotating centre (:func:`fit_rotation`) is tried too.
    Centred (asymmetric) vs not, and rotating centre vs none, are chosen per layer by the total squared error
    of :func:`fake_quantize_keys`. With the layer's ``query_moments (H, D, D)`` fp32 (``E[q q^T]`` per KV head,
    squeeze.calibrate.queries), the chosen scale is then refined by :func:`refine_key_scale` for the least
    error of the attention scores.
    """
    rotations: list[KeyRotation | None] = [None]
    if positions is not None and rope_freq is not None:
        rotations.append(fit_rotation(samples, positions, rope_freq))
    best: KeyFit | None = None
    best_moving: Tensor | None = None  # the chosen fit's centre at each sample's position, for the search
    for rotation in rotations:
        # (N, H, D) in the sample layout: the centre at each sample's position
        moving = None if rotation is None else rotation.at(positions).transpose(0, 1)  # type: ignore[arg-type]
        centred = samples if moving is None else samples - moving
        lo, hi = centred.amin(dim=0), centred.amax(dim=0)  # (H, D)
        for symmetric in (True, False):
            scale, center = key_channel_params(lo, hi, symmetric)
            fake = fake_quantize_keys(samples, scale, center, bits, group, moving)
            sse = float((fake - samples).square().sum())
            if best is None or sse < best.sse:
                best, best_moving = KeyFit(scale, center, symmetric, sse, rotation), moving
    assert best is not None  # the loops run at least twice
    if query_moments is not None:
        scale = refine_key_scale(samples, best.scale, best.zero, bits, group, query_moments, best_moving)
        fake = fake_quantize_keys(samples, scale, best.zero, bits, group, best_moving)
        best = KeyFit(scale, best.zero, best.symmetric, float((fake - samples).square().sum()), best.rotation)
    return best


def refine_key_scale(
    samples: Tensor,
    scale: Tensor,
    center: Tensor,
    bits: int,
    group: int | None,
    query_moments: Tensor,
    moving: Tensor | None = None,
) -> Tensor:
    """The per-channel key ``scale (H, D)`` fp32 searched channel by channel (:data:`KEY_SCALE_STEPS` times the
    calibrated scale, each head apart, one pass) for the least attention-score error ``sum_n dk_n^T S dk_n``
    of :func:`fake_quantize_keys` on ``samples (N, H, D)`` (at most :data:`KEY_SEARCH_ELEMENTS` elements, the
    tokens evenly strided), ``S = query_moments (H, D, D)`` the queries' ``E[q q^T]`` per KV head;
    ``moving (N, H, D)``: a rotating centre at each sample's position, or None.

    Why: the range normaliser balances the channels by their extremes, which a few tokens set; within a
    per-token grid the balance that matters is the error the scores see. Against the keys' plain squared
    error the same search made perplexity worse (stories260K, seed 0: +1.25% -> +2.21%); weighted by the
    queries it makes calibrating on the evaluated domain pay off (stories260K over 5 seeds: in-domain +2.16% ->
    +0.99%, other text +1.31% -> +1.43%; docs/benchmarks.md).
    """
    step = -(-samples.numel() // KEY_SEARCH_ELEMENTS)
    keys = samples[::step]  # (N, H, D)
    rotation = None if moving is None else moving[::step]
    center = center.expand_as(keys) if rotation is None else center + rotation  # (N, H, D)
    weight = query_moments.to(torch.float32)  # (H, D, D)
    scale = scale.clone()
    heads, dim = scale.shape
    width = group or dim
    factors = torch.tensor((1.0, *KEY_SCALE_STEPS))  # (F,): 1.0 first, so a tie keeps the scale
    error = fake_quantize_keys(keys, scale, center, bits, group) - keys  # (N, H, D)
    weighted = torch.einsum("nhd,hde->nhe", error, weight)  # (N, H, D): S dk per token
    for channel in range(dim):
        # a channel's scale moves only its own grid's codes: score the change of that grid's error alone,
        # sum_n (e + d)^T S (e + d) - e^T S e = sum_n 2 d^T (S e) + d^T S d, d nonzero in the grid only
        grid = slice(channel - channel % width, channel - channel % width + width)
        trials = scale[:, grid].repeat(len(factors), 1, 1)  # (F, H, g)
        trials[:, :, channel % width] = factors[:, None] * scale[:, channel]
        keys_g = keys[:, :, grid]  # (N, H, g)
        fake = fake_quantize_keys(keys_g, trials[:, None], center[:, :, grid], bits, width)  # (F, N, H, g)
        delta = fake - keys_g - error[:, :, grid]  # (F, N, H, g)
        change = 2 * torch.einsum("fnhg,nhg->fh", delta, weighted[:, :, grid])
        per_head = delta.permute(2, 0, 1, 3).flatten(1, 2)  # (H, F * N, g): d^T S d as one batched matmul
        quadratic = (torch.bmm(per_head, weight[:, grid, grid]) * per_head).sum(-1)  # (H, F * N)
        change += quadratic.view(heads, len(factors), -1).sum(-1).T  # (F, H)
        best = change.argmin(dim=0)  # (H,): 0 (keep) unless a factor cuts the error
        chosen = delta[best, :, torch.arange(heads)].transpose(0, 1)  # (N, H, g)
        scale[:, channel] *= factors[best]
        error[:, :, grid] += chosen
        weighted += torch.einsum("nhg,hgd->nhd", chosen, weight[:, grid, :])
    return scale


def fit_rotation(samples: Tensor, positions: Tensor, rope_freq: Tensor) -> KeyRotation:
    """The rotating key centre of one layer: RoPE at each position applied to the mean pre-RoPE key.

    ``samples (N, H, D)`` fp32 post-RoPE keys at cache ``positions (N,)``; ``rope_freq (D/2,)``: channel ``j`` and
    ``j + D/2`` rotate together at ``rope_freq[j]`` (transformers' rotate_half). Un-rotating every key and
    averaging gives the pre-RoPE mean ``mu``, the least-squares centre of that form (the rotations are
    orthogonal), well conditioned even where a channel turns little over the calibration windows; RoPE of ``mu``
    at position ``p`` is ``mu * cos + rotate_half(mu) * sin``, i.e. per channel ``cos_amp = mu`` and
    ``sin_amp = rotate_half(mu)``.
    """
    half = samples.shape[-1] // 2
    freq = torch.cat([rope_freq, rope_freq]).float()  # (D,) per channel
    cos, sin = rope_trig(positions, freq)  # (N, D)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated_half = torch.cat([-samples[..., half:], samples[..., :half]], dim=-1)
    mu = (samples * cos - rotated_half * sin).mean(dim=0)  # (H, D): R_p^T k, averaged
    return KeyRotation(freq, mu.contiguous(), torch.cat([-mu[..., half:], mu[..., :half]], dim=-1).contiguous())


def fit_value_codebook(samples: Tensor, bits: int, group: int | None = None) -> ValueFit:
    """Fit a codebook of ``2**bits`` levels for the values of one layer, ``samples (N, H, D)`` fp32.

    Every grid of ``group`` channels (default: the whole head) is scaled by its absmax (:func:`codebook_scale`)
    into [-1, 1]; the levels are the k-means of those scaled values weighted by scale**2, i.e. they minimise
    the squared error in value units (squeeze.quant.kmeans, the same solver as the weights' LUTs). An
    unweighted k-means (every token's relative error alike) measured the same within noise on SmolLM2-135M
    (int4 KV, 40 windows: +2.50% vs +2.62% perplexity on WikiText-2 windows 40-79, +3.03% vs +2.72% on
    windows 0-39; docs/benchmarks.md), so the objective the rest of squeeze uses stays.
    """
    group = group or samples.shape[-1]
    grouped = samples.unflatten(-1, (-1, group))  # (N, H, G, group)
    scale = codebook_scale(grouped)  # (N, H, G, 1)
    scaled = (grouped / scale).reshape(1, -1)
    weights = scale.square().expand_as(grouped).reshape(1, -1)
    levels, _ = weighted_kmeans_1d(scaled, weights, 1 << bits)
    levels = levels[0]  # (K,) ascending
    fake = dequantize_codebook(quantize_codebook(grouped, scale, levels), scale, levels)
    sse = float((fake - grouped).square().sum())
    return ValueFit(torch.ones(samples.shape[1]), True, sse, group, levels)


def fit_values(samples: Tensor, bits: int, group: int | None = None) -> ValueFit:
    """Fit the per-head clipping ratio of per-token value grids on ``samples (N, H, D)`` fp32.

    Each token's ``D`` channels get one grid per ``group`` channels (default: :func:`default_value_group`).
    Asymmetric grids (an offset per grid too, counted in the cache's bytes per token) are chosen per layer
    only when their total squared error is below :func:`asymmetric_gain_needed` times the symmetric one's.
    """
    group = group or default_value_group(bits, samples.shape[-1])
    grouped = samples.unflatten(-1, (-1, group))  # (N, H, G, group)
    fits = []
    for symmetric in (True, False):
        best_err = torch.full((samples.shape[1],), float("inf"))
        best_clip = torch.ones(samples.shape[1])
        for clip in CLIP_GRID:
            scale, offset = token_grid(grouped, bits, clip, symmetric)
            fake = dequantize(quantize(grouped, scale, offset, bits), scale, offset)
            err = (fake - grouped).square().sum(dim=(0, 2, 3))  # (H,)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_clip = torch.where(better, torch.full_like(best_clip, clip), best_clip)
        fits.append(ValueFit(best_clip, symmetric, float(best_err.sum()), group))
    symmetric_fit, asymmetric_fit = fits
    return asymmetric_fit if asymmetric_fit.sse < asymmetric_gain_needed(group) * symmetric_fit.sse else symmetric_fit


def fp8_scale(absmax: Tensor) -> Tensor:
    """vLLM's per-layer fp8 scale from the calibration ``absmax`` (0-dim, the largest |x| over every token, head
    and channel): ``absmax / 448`` as a float32 0-dim tensor, so the largest calibration value maps to e4m3's
    largest. An all-zero layer gets 1.0 (vLLM's default; any scale stores zeros exactly)."""
    absmax = absmax.float().reshape(())
    return absmax / FP8_E4M3_MAX if float(absmax) > 0 else torch.ones(())


def fp8_error(samples: Tensor, scale: Tensor | float) -> float:
    """Squared error of the fp8 cache with ``scale`` on ``samples`` (any shape)."""
    return float((fake_quantize_fp8(samples, scale) - samples.float()).square().sum())


def dynamic_error(samples: Tensor, bits: int) -> float:
    """Squared error of plain per-token absmax quantization (the uncalibrated baseline) on ``samples``."""
    scale, _ = token_grid(samples, bits, 1.0, True)
    return float((dequantize(quantize(samples, scale, None, bits), scale, None) - samples).square().sum())


__all__ = [
    "CLIP_GRID",
    "asymmetric_gain_needed",
    "KeyFit",
    "ValueFit",
    "fit_keys",
    "refine_key_scale",
    "fit_rotation",
    "fit_values",
    "fit_value_codebook",
    "fp8_scale",
    "fp8_error",
    "dynamic_error",
]
