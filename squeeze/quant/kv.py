"""KV-cache quantization math: int8 / int4 codes on per-token grids, int4 packing, key normalisation, codebooks.

Every quantized K/V element is a code ``q`` on a per-token grid (one fp16 ``scale`` per batch row, head and
token): symmetric grids read back ``q * scale`` with int8 codes in [-qmax - 1, qmax]; asymmetric ones
``offset + q * scale`` with uint8 codes in [0, 2**bits - 1] and an fp16 ``offset`` per token too.

- Values, int8: the token's own range, shrunk by a clipping ratio per head calibrated offline (KVQuant:
  values per token). Values, int4: a calibrated codebook of 16 levels per layer (KVQuant's non-uniform
  "nuq" datatype) on the token's absmax-scaled values, ``levels[code] * scale``: the levels are a weighted
  1-D k-means of the calibration values, so they sit where values are dense instead of evenly spaced.
- Keys: keys have a few channels far larger than the rest (KVQuant), so they are first normalised per
  channel with a calibrated ``k_scale`` and centre ``k_zero`` (H, D), ``(k - k_zero) / k_scale``, and the
  normalised vector gets symmetric per-token grids (one per ``k_group`` channels: at int4 32, or half the
  head under 64 channels; squeeze.quant.kv_bytes.default_key_group). A purely static per-channel grid
  (KVQuant without its sparse outliers) clamps every key outside the calibrated range: on stories260K,
  calibrated on 500 tokens, one key of another text came back off by 18 (its range is +-24). Normalising
  per channel and then scaling per token keeps the calibrated channel balance and adapts to every token.
- A rotating key centre (:class:`KeyRotation`): post-RoPE keys of many models carry a large, nearly constant
  pre-RoPE component that RoPE turns, channel pair by pair, into a slowly rotating one (stories260K: channels 3
  and 7 at 1e-3 rad per position, mean up to 17.7 against an RMS of 0.5-4 elsewhere). A static per-channel
  centre cannot follow it, and it sets every token's grid. So each calibrated key channel may also subtract
  ``cos_amp * cos(p * freq) + sin_amp * sin(p * freq)`` at the token's cache position ``p`` (its least-squares
  fit on the calibration keys), before the normaliser; dequantization adds it back at the same position.
- The uncalibrated baseline: symmetric per-token absmax grids for keys and values, no normalisation.
- fp8 (vLLM's ``kv_cache_dtype="fp8"``): no grid at all. Every element is stored as float8_e4m3fn of
  ``x / scale`` with one float32 scale per layer for keys and one for values, read back as ``code * scale``.

int4 codes are packed two per byte along the head dimension (their low 4 bits, two's complement for
signed codes; codebook indices unsigned), the even channel in the low nibble.

Fitting the calibrated parameters from activations is squeeze.calibrate.kv_fit; the spec that carries them
(per-layer layout, artifact form, byte accounting) is squeeze.quant.kv_spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: Per-token grid parameters are stored in fp16: 2 bytes per scale / offset.
PARAM_BYTES = 2

#: Largest finite float8_e4m3fn value: a calibrated fp8 scale maps the calibration absmax to it.
FP8_E4M3_MAX = 448.0


def levels(bits: int) -> int:
    """Largest unsigned code: 2**bits - 1."""
    return (1 << bits) - 1


def qmax(bits: int) -> int:
    """The scale divisor of a symmetric grid: 2**(bits-1) - 1 (127, 7); absmax maps to +-qmax.

    Codes span [-qmax - 1, qmax]: the extra negative level costs nothing and catches clipped values (with a
    clipping ratio < 1 the range ends past +-qmax); measured on SmolLM2, dropping it made the int4 value
    grids worse (+4.16% vs +3.81% perplexity).
    """
    return (1 << (bits - 1)) - 1


def token_grid(x: Tensor, bits: int, clip: Tensor | float, symmetric: bool) -> tuple[Tensor, Tensor | None]:
    """Per-token grid (scale, offset) of ``x (..., D)`` over its last dim, range shrunk by ``clip``: (..., 1).

    Symmetric: ``x ~ q * scale``, q in [-qmax - 1, qmax], offset None. Asymmetric: ``x ~ offset + q * scale``,
    q in [0, 2**bits - 1], offset the (clipped) minimum. ``clip`` broadcasts against ``x[..., :1]`` (e.g. a
    per-head (H, 1, 1) tensor). Scale and offset are rounded to fp16 first, as they are stored, so
    quantization and dequantization agree exactly.
    """
    tiny = torch.finfo(torch.float16).tiny
    if symmetric:
        factor = clip / qmax(bits)
        absmax = x.abs().amax(dim=-1, keepdim=True)  # 30x faster on CPU than vector_norm(ord=inf) (torch 2.13)
        return (absmax * factor).clamp_(min=tiny).half().float(), None
    lo, hi = torch.aminmax(x, dim=-1, keepdim=True)
    mid, half = (hi + lo) / 2, (hi - lo) / 2 * clip
    scale = (2 * half / levels(bits)).clamp_(min=tiny).half().float()
    return scale, (mid - half).half().float()


def quantize(x: Tensor, scale: Tensor, offset: Tensor | None, bits: int) -> Tensor:
    """Codes of ``x`` on a grid (see :func:`token_grid`): int8 in [-qmax - 1, qmax] when ``offset`` is None
    (symmetric), else uint8 in [0, 2**bits - 1]. ``scale`` / ``offset`` broadcast against ``x``."""
    if offset is None:
        return torch.round(x / scale).clamp_(-qmax(bits) - 1, qmax(bits)).to(torch.int8)
    return torch.round((x - offset) / scale).clamp_(0, levels(bits)).to(torch.uint8)


def dequantize(codes: Tensor, scale: Tensor, offset: Tensor | None, *, out: Tensor | None = None) -> Tensor:
    """``codes * scale (+ offset)`` in ``scale``'s dtype, or written into ``out`` (may be a strided view).

    One pass converts and scales (torch's mixed-dtype mul); int4 codes must be unpacked first.
    """
    result = torch.mul(codes, scale) if out is None else torch.mul(codes, scale, out=out)
    return result if offset is None else result.add_(offset)


def pack_int4(codes: Tensor) -> Tensor:
    """int8 / uint8 codes (..., D) in [-8, 15], D even -> uint8 (..., D/2): each code's low 4 bits (two's
    complement for signed codes), channel 2i in the low nibble, 2i+1 in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 KV packing needs an even head dimension, found {codes.shape[-1]}")
    pairs = (codes.view(torch.uint8) & 0x0F).unflatten(-1, (-1, 2))  # (..., D/2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_int4(packed: Tensor, *, signed: bool) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`pack_int4`, as (even channels, odd channels), each (..., D/2): int8 sign-extended
    when ``signed``, else uint8."""
    if signed:
        as_int8 = packed.view(torch.int8)
        return (as_int8 << 4) >> 4, as_int8 >> 4  # arithmetic shifts sign-extend the nibbles
    return packed & 0x0F, packed >> 4


def interleave(even: Tensor, odd: Tensor) -> Tensor:
    """(..., D/2) x 2 -> (..., D) with channel 2i from ``even`` and 2i+1 from ``odd``."""
    return torch.stack((even, odd), dim=-1).flatten(-2)


def key_channel_params(lo: Tensor, hi: Tensor, symmetric: bool) -> tuple[Tensor, Tensor]:
    """Per-channel key normaliser (scale, centre) fp32 from the calibrated range [lo, hi] (H, D).

    Symmetric: centre 0, scale = absmax; asymmetric: centre = midpoint, scale = half the range.
    """
    tiny = torch.finfo(torch.float32).tiny
    center = torch.zeros_like(lo) if symmetric else (hi + lo) / 2
    scale = torch.maximum((lo - center).abs(), (hi - center).abs()).clamp(min=tiny)
    return scale, center


def normalize_keys(keys: Tensor, scale: Tensor, center: Tensor) -> Tensor:
    """``(keys - center) / scale``: what the per-token key grid quantizes."""
    return (keys - center) / scale


def denormalize_keys_(values: Tensor, scale: Tensor, center: Tensor) -> Tensor:
    """In place: ``values * scale + center`` (one fused pass)."""
    return torch.addcmul(center, values, scale, out=values)


def rope_trig(positions: Tensor, freq: Tensor) -> tuple[Tensor, Tensor]:
    """``cos(p * freq)``, ``sin(p * freq)`` fp32 (T, D) on the CPU for int ``positions (T,)`` and ``freq (D,)``.

    Computed in float64 and rounded once to fp32, so every caller (runtime cache, paged pool, reference) gets
    the same bits for a position however the positions are batched.
    """
    angle = positions.detach().cpu().double()[:, None] * freq.detach().cpu().double()[None, :]
    return angle.cos().float(), angle.sin().float()


@dataclass(frozen=True)
class KeyRotation:
    """A rotating key centre of one layer: per channel ``cos_amp * cos(p * freq) + sin_amp * sin(p * freq)`` at
    cache position ``p``. ``freq (D,)`` fp32 >= 0 (rad per position, the channel's RoPE frequency; 0 for a
    channel RoPE leaves alone), ``cos_amp`` / ``sin_amp (H, D)`` fp32."""

    freq: Tensor
    cos_amp: Tensor
    sin_amp: Tensor

    def center(self, cos: Tensor, sin: Tensor) -> Tensor:
        """The centre (H, T, D) fp32 from :func:`rope_trig`'s ``cos`` / ``sin (T, D)`` (on the device wanted)."""
        cos_amp, sin_amp = (t.to(cos.device, torch.float32)[:, None, :] for t in (self.cos_amp, self.sin_amp))
        return cos_amp * cos[None] + sin_amp * sin[None]

    def at(self, positions: Tensor) -> Tensor:
        """The centre (H, T, D) fp32 at int ``positions (T,)``, on ``positions``' device."""
        cos, sin = (t.to(positions.device) for t in rope_trig(positions, self.freq))
        return self.center(cos, sin)


def fake_quantize_keys(
    keys: Tensor,
    scale: Tensor,
    center: Tensor,
    bits: int,
    group: int | None = None,
    rotation: Tensor | None = None,
) -> Tensor:
    """The reference of the runtime key path: normalise per channel, per-token grids of ``group`` channels
    (default: the whole head), back. Shape of ``keys``.

    ``keys (..., H, T, D)`` or ``(N, H, D)`` with ``scale`` / ``center`` broadcast to it. ``rotation``: a rotating
    centre (:meth:`KeyRotation.at`) broadcast to ``keys``, added to ``center`` (in fp32) before anything else.
    """
    if rotation is not None:
        center = center + rotation
    normalized = normalize_keys(keys, scale, center).unflatten(-1, (-1, group or keys.shape[-1]))  # (..., G, g)
    t_scale, _ = token_grid(normalized, bits, 1.0, True)
    fake = dequantize(quantize(normalized, t_scale, None, bits), t_scale, None).flatten(-2)
    return denormalize_keys_(fake, scale, center)


def codebook_scale(x: Tensor) -> Tensor:
    """Per-token scale of a codebook grid: the absmax of ``x (..., g)`` over its last dim, as fp16 (..., 1)."""
    absmax = x.abs().amax(dim=-1, keepdim=True)
    return absmax.clamp_(min=torch.finfo(torch.float16).tiny).half().float()


def quantize_codebook(x: Tensor, scale: Tensor, levels: Tensor) -> Tensor:
    """uint8 index of the level nearest to ``x / scale`` (ties: the lower one); ``levels`` (K,) ascending.

    ``x / scale`` is compared with the midpoints of neighbouring levels in float32 (float64 would make ties
    exact, as in squeeze.quant.kmeans.nearest_codes, at 1.4x the time for no measurable difference).
    """
    c = levels.to(device=x.device, dtype=torch.float32)
    mids = (c[:-1] + c[1:]) * 0.5  # (K-1,)
    scaled = (x / scale).float().contiguous()  # keys / values arrive as strided views; bucketize wants dense
    return torch.bucketize(scaled, mids).to(torch.uint8)


def dequantize_codebook(codes: Tensor, scale: Tensor, levels: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``levels[codes] * scale`` in ``scale``'s dtype, or written into ``out`` (may be a strided view)."""
    table = levels.to(device=codes.device, dtype=scale.dtype)
    looked_up = table.index_select(0, codes.reshape(-1).int()).view(codes.shape)  # 3x faster than table[codes]
    return torch.mul(looked_up, scale) if out is None else torch.mul(looked_up, scale, out=out)


def quantize_fp8(x: Tensor, scale: Tensor | float) -> Tensor:
    """float8_e4m3fn codes of ``x / scale`` as their uint8 bytes, ``x``'s shape.

    ``scale``: the layer's fp32 scale (0-dim tensor or float). As vLLM's cache writes: the quotient in
    float32, saturated to +-448 (e4m3fn has no infinity; NaN stays NaN). The bytes, not a float8 tensor:
    every copy and index op handles uint8, not all of them float8.
    """
    quotient = x.float() / scale
    return quotient.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_fp8(codes: Tensor, scale: Tensor | float, *, out: Tensor | None = None) -> Tensor:
    """``code * scale`` of uint8 ``codes`` (float8_e4m3fn bytes) in float32, or written into ``out`` (any float
    dtype, may be a strided view; the product is taken in float32 and then rounded to it)."""
    values = codes.view(torch.float8_e4m3fn).float()
    return torch.mul(values, scale) if out is None else torch.mul(values, scale, out=out)


def fake_quantize_fp8(x: Tensor, scale: Tensor | float) -> Tensor:
    """``x`` as the fp8 cache reads it back (float32): the reference the runtime cache matches bit for bit."""
    return dequantize_fp8(quantize_fp8(x, scale), scale)


__all__ = [
    "PARAM_BYTES",
    "FP8_E4M3_MAX",
    "levels",
    "qmax",
    "token_grid",
    "quantize",
    "dequantize",
    "pack_int4",
    "unpack_int4",
    "interleave",
    "key_channel_params",
    "normalize_keys",
    "denormalize_keys_",
    "rope_trig",
    "KeyRotation",
    "fake_quantize_keys",
    "codebook_scale",
    "quantize_codebook",
    "dequantize_codebook",
    "quantize_fp8",
    "dequantize_fp8",
    "fake_quantize_fp8",
]
