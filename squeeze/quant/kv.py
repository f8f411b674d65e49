"""KV-cache quantization math: int8 / int4 codes, affine dequantization, int4 packing, scale fitting.

Every quantized K/V element is stored as an unsigned code ``c`` in ``[0, 2**bits - 1]`` of a per-token grid
``(c - zero) * scale`` (one fp16 ``scale``, and ``zero`` when asymmetric, per batch row, head and token).

- Values: the token's own range, shrunk by a clipping ratio per head calibrated offline (KVQuant: values
  per token).
- Keys: keys have a few channels far larger than the rest (KVQuant), so they are first normalised per
  channel with a calibrated ``k_scale`` and centre ``k_zero`` (H, D), ``(k - k_zero) / k_scale``, and the
  normalised vector gets a per-token grid. A purely static per-channel grid (KVQuant without its sparse
  outliers) clamps any key outside the calibrated range: on stories260K one such key was off by 18 (of 24)
  and perplexity on other text dropped by the hundreds of percent; the per-token grid on normalised keys
  keeps the calibrated channel balance and still adapts to every token.
- The uncalibrated baseline: per-token absmax for keys and values, no normalisation.

Symmetric grids use ``zero = 2**(bits-1)`` and codes ``[1, 2**bits - 1]`` (so +-qmax, no lone -qmax - 1).
int4 codes are packed two per byte along the head dimension, the even channel in the low nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.errors import ConfigError, FormatError

KV_BITS = (4, 8)
#: The artifact file holding the calibrated scales ({attn}.k_scale / .k_zero / .v_clip), beside the shards.
KV_FILE = "kv_cache.safetensors"
#: Clipping ratios tried for per-token value grids (range shrunk to ``ratio * range``); 1.0 = plain min-max.
CLIP_GRID = tuple(round(0.5 + 0.025 * i, 3) for i in range(21))

#: Per-token params are stored in fp16: 2 bytes per scale / zero.
PARAM_BYTES = 2


def asymmetric_gain_needed(head_dim: int) -> float:
    """Error ratio an asymmetric value grid must beat to pay for its per-token zero point.

    The zero point adds 16 bits per head, i.e. 16 / head_dim bits per value; one more bit per value cuts
    the squared error of a uniform grid by 4x, so the zero point is worth it only when it cuts the error
    by more than 4 ** (16 / head_dim) (1.41x for head_dim 64): a rate-distortion rule, the same at 8 and 4 bits.
    """
    return float(4.0 ** (-PARAM_BYTES * 8 / head_dim))


def check_kv_bits(bits: object) -> int:
    """``bits`` if it is 4 or 8, else ConfigError."""
    if isinstance(bits, bool) or bits not in KV_BITS:
        raise ConfigError(f"KV-cache bits must be 4 or 8, found {bits!r}", hint="pass --bits 8 or --bits 4")
    return int(bits)  # type: ignore[call-overload]


def levels(bits: int) -> int:
    """Largest code: 2**bits - 1."""
    return (1 << bits) - 1


def symmetric_zero(bits: int) -> float:
    """The zero point of a symmetric grid: 2**(bits-1) (128 for int8, 8 for int4)."""
    return float(1 << (bits - 1))


def quantize(x: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """Codes uint8 (same shape as ``x``) of ``x`` on the grid ``(c - zero) * scale``; ``scale`` broadcasts."""
    codes = torch.round(x / scale + zero).clamp_(0, levels(bits))
    return codes.to(torch.uint8)


def dequantize(codes: Tensor, scale: Tensor, zero: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``(codes - zero) * scale`` in ``scale``'s dtype (or into ``out``); int4 codes must be unpacked first."""
    if out is None:
        return (codes.to(scale.dtype) - zero) * scale
    torch.sub(codes.to(out.dtype), zero, out=out)
    return out.mul_(scale)


def pack_int4(codes: Tensor) -> Tensor:
    """uint8 codes (..., D) < 16, D even -> uint8 (..., D/2): channel 2i in the low nibble, 2i+1 in the high."""
    if codes.shape[-1] % 2:
        raise ConfigError(f"int4 KV packing needs an even head dimension, found {codes.shape[-1]}")
    pairs = codes.unflatten(-1, (-1, 2))  # (..., D/2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_int4`: uint8 (..., D/2) -> uint8 (..., D)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def token_params(x: Tensor, bits: int, clip: Tensor | float, symmetric: bool) -> tuple[Tensor, Tensor]:
    """Per-token (scale, zero) of ``x (..., D)`` over its last dim, range shrunk by ``clip``: each (..., 1).

    ``clip`` broadcasts against ``x[..., :1]`` (e.g. a per-head (H, 1, 1) tensor). Scales are rounded to
    fp16 before use, as they are stored, so quantize and dequantize agree exactly.
    """
    tiny = torch.finfo(torch.float16).tiny
    if symmetric:
        absmax = x.abs().amax(dim=-1, keepdim=True) * clip
        scale = (absmax / (levels(bits) // 2)).clamp_(min=tiny).half().float()
        return scale, torch.full_like(scale, symmetric_zero(bits))
    lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    mid, half = (hi + lo) / 2, (hi - lo) / 2 * clip
    scale = (2 * half / levels(bits)).clamp_(min=tiny).half().float()
    zero = (-(mid - half) / scale).half().float()
    return scale, zero


def key_channel_params(lo: Tensor, hi: Tensor, symmetric: bool) -> tuple[Tensor, Tensor]:
    """Per-channel key normaliser (scale, centre) fp32 from the calibrated range [lo, hi] (H, D).

    Symmetric: centre 0, scale = absmax; asymmetric: centre = midpoint, scale = half the range.
    """
    tiny = torch.finfo(torch.float32).tiny
    center = torch.zeros_like(lo) if symmetric else (hi + lo) / 2
    scale = torch.maximum((lo - center).abs(), (hi - center).abs()).clamp(min=tiny)
    return scale, center


def fake_quantize_keys(keys: Tensor, scale: Tensor, center: Tensor, bits: int) -> Tensor:
    """The reference of the runtime key path: normalise per channel, per-token grid, back. Shape of ``keys``.

    ``keys (..., H, T, D)`` or ``(N, H, D)`` with ``scale`` / ``center`` broadcast to it.
    """
    normalized = (keys - center) / scale
    t_scale, t_zero = token_params(normalized, bits, 1.0, True)
    return dequantize(quantize(normalized, t_scale, t_zero, bits), t_scale, t_zero) * scale + center


@dataclass(frozen=True)
class KeyFit:
    """Key normaliser of one layer: scale / centre fp32 (H, D); the squared error it had on calibration."""

    scale: Tensor
    zero: Tensor
    symmetric: bool
    sse: float


@dataclass(frozen=True)
class ValueFit:
    """Per-token value quantizer of one layer: a clipping ratio per head, fp32 (H,)."""

    clip: Tensor
    symmetric: bool
    sse: float


def fit_keys(samples: Tensor, bits: int) -> KeyFit:
    """Fit the per-channel key normaliser on ``samples (N, H, D)`` fp32 (N calibration tokens, sink excluded).

    Centred (asymmetric) vs not is chosen per layer by the total squared error of :func:`fake_quantize_keys`.
    """
    lo, hi = samples.amin(dim=0), samples.amax(dim=0)  # (H, D)
    best: KeyFit | None = None
    for symmetric in (True, False):
        scale, center = key_channel_params(lo, hi, symmetric)
        sse = float((fake_quantize_keys(samples, scale, center, bits) - samples).square().sum())
        if best is None or sse < best.sse:
            best = KeyFit(scale, center, symmetric, sse)
    assert best is not None  # the loop runs twice
    return best


def fit_values(samples: Tensor, bits: int) -> ValueFit:
    """Fit the per-head clipping ratio of per-token value scales on ``samples (N, H, D)`` fp32.

    Asymmetric grids (a zero point per token too, counted in the cache's bytes per token) are chosen per
    layer only when their total squared error is below :func:`asymmetric_gain_needed` times the
    symmetric grid's.
    """
    fits = []
    for symmetric in (True, False):
        best_err = torch.full((samples.shape[1],), float("inf"))
        best_clip = torch.ones(samples.shape[1])
        for clip in CLIP_GRID:
            scale, zero = token_params(samples, bits, clip, symmetric)
            err = (dequantize(quantize(samples, scale, zero, bits), scale, zero) - samples).square().sum(dim=(0, 2))
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_clip = torch.where(better, torch.full_like(best_clip, clip), best_clip)
        fits.append(ValueFit(best_clip, symmetric, float(best_err.sum())))
    symmetric_fit, asymmetric_fit = fits
    needed = asymmetric_gain_needed(samples.shape[-1])
    return asymmetric_fit if asymmetric_fit.sse < needed * symmetric_fit.sse else symmetric_fit


def dynamic_error(samples: Tensor, bits: int) -> float:
    """Squared error of plain per-token absmax quantization (the uncalibrated baseline) on ``samples``."""
    scale, zero = token_params(samples, bits, 1.0, True)
    return float((dequantize(quantize(samples, scale, zero, bits), scale, zero) - samples).square().sum())




@dataclass(frozen=True)
class LayerKV:
    """Calibrated quantizers of one attention layer's cache.

    ``k_scale`` / ``k_zero``: fp32 (H, D), the per-channel key normaliser (scale and centre, in key units).
    ``v_clip``: fp32 (H,), the clipping ratio of the per-token value grid per head.
    """

    k_scale: Tensor
    k_zero: Tensor
    v_clip: Tensor
    k_symmetric: bool
    v_symmetric: bool


@dataclass(frozen=True)
class KVSpec:
    """How a model's KV cache is quantized: ``bits``, the full-precision sink length, and per-layer quantizers.

    ``layers[i]`` belongs to the attention module ``names[i]`` (transformers' ``layer_idx`` i). ``None``
    layers (the uncalibrated baseline) quantize keys and values per token with plain absmax scales.
    """

    bits: int
    sink_tokens: int
    names: tuple[str, ...]
    layers: tuple[LayerKV | None, ...]

    @property
    def calibrated(self) -> bool:
        return all(layer is not None for layer in self.layers)

    @classmethod
    def dynamic(cls, bits: int, names: tuple[str, ...], sink_tokens: int = 1) -> KVSpec:
        """The uncalibrated baseline: per-token absmax keys and values, symmetric."""
        return cls(check_kv_bits(bits), sink_tokens, names, tuple(None for _ in names))

    def to_tensors(self) -> dict[str, Tensor]:
        """``{attn}.k_scale`` / ``.k_zero`` (H, D) and ``{attn}.v_clip`` (H,), fp32, for the artifact."""
        out: dict[str, Tensor] = {}
        for name, layer in zip(self.names, self.layers):
            if layer is not None:
                out[f"{name}.k_scale"] = layer.k_scale.float().contiguous()
                out[f"{name}.k_zero"] = layer.k_zero.float().contiguous()
                out[f"{name}.v_clip"] = layer.v_clip.float().contiguous()
        return out

    def to_config(self) -> dict[str, object]:
        """The ``quantization_config.kv_cache`` entry of an artifact's config.json (tensors go elsewhere)."""
        return {
            "bits": self.bits,
            "sink_tokens": self.sink_tokens,
            "keys": "per-channel normaliser (k_scale, k_zero) then per-token grid, post-RoPE",
            "values": "per-token grid, calibrated clipping ratio per head",
            "layers": [{"module": name, "k_symmetric": layer.k_symmetric, "v_symmetric": layer.v_symmetric}
                       for name, layer in zip(self.names, self.layers) if layer is not None],
        }

    @classmethod
    def from_config(cls, config: object, tensors: dict[str, Tensor], where: str = "config.json") -> KVSpec:
        """Rebuild a calibrated spec from ``to_config()``'s dict and the ``to_tensors()`` tensors (FormatError if bad)."""
        if not isinstance(config, dict):
            raise FormatError(f"{where}: quantization_config.kv_cache must be an object")
        bits, sink, entries = config.get("bits"), config.get("sink_tokens"), config.get("layers")
        if bits not in KV_BITS or isinstance(bits, bool):
            raise FormatError(f"{where}: kv_cache.bits must be 4 or 8, found {bits!r}")
        if not isinstance(sink, int) or isinstance(sink, bool) or sink < 0:
            raise FormatError(f"{where}: kv_cache.sink_tokens must be an integer >= 0, found {sink!r}")
        if not isinstance(entries, list) or not entries:
            raise FormatError(f"{where}: kv_cache.layers must be a non-empty list")
        names, layers = [], []
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("module"), str):
                raise FormatError(f"{where}: every kv_cache.layers entry needs a 'module' name")
            name = entry["module"]
            parts = [tensors.get(f"{name}.{role}") for role in ("k_scale", "k_zero", "v_clip")]
            if any(p is None for p in parts):
                raise FormatError(f"KV scales of {name} are missing (expected {name}.k_scale, .k_zero, .v_clip)",
                                  hint="re-run squeeze calibrate-kv on the artifact")
            k_scale, k_zero, v_clip = (p.float() for p in parts if p is not None)
            if k_scale.dim() != 2 or k_zero.shape != k_scale.shape or v_clip.shape != k_scale.shape[:1]:
                raise FormatError(f"KV scales of {name} have inconsistent shapes: k_scale {tuple(k_scale.shape)}, "
                                  f"k_zero {tuple(k_zero.shape)}, v_clip {tuple(v_clip.shape)}")
            names.append(name)
            layers.append(LayerKV(k_scale, k_zero, v_clip, bool(entry.get("k_symmetric")),
                                  bool(entry.get("v_symmetric"))))
        return cls(int(bits), sink, tuple(names), tuple(layers))

    def bytes_per_token(self, kv_heads: int, head_dim: int, bits: int | None = None) -> int:
        """Cache bytes one token adds over all layers: packed codes plus per-token fp16 scales / zeros.

        ``bits`` counts another width with this spec's layout (default: ``self.bits``).
        """
        return sum(
            layer_bytes_per_token(kv_heads, head_dim, bits or self.bits,
                                  asymmetric_values=layer is not None and not layer.v_symmetric)
            for layer in self.layers
        )


def layer_bytes_per_token(kv_heads: int, head_dim: int, bits: int, *, asymmetric_values: bool = False) -> int:
    """Bytes one token adds to one quantized layer: key and value codes plus fp16 per-token scales (and
    value zero points when asymmetric). Per-channel key normalisers are per layer, not per token."""
    codes = 2 * kv_heads * head_dim * bits // 8
    params = kv_heads * PARAM_BYTES * (3 if asymmetric_values else 2)
    return codes + params


def fp_bytes_per_token(n_layers: int, kv_heads: int, head_dim: int, element_bytes: int = 2) -> int:
    """Bytes one token adds to an unquantized cache (fp16 by default) over all layers."""
    return 2 * n_layers * kv_heads * head_dim * element_bytes


def kv_bytes_table(model_config: object) -> dict[str, int]:
    """KV bytes per token over all layers: fp16, int8 and int4 (codes plus per-token scales / zeros).

    ``model_config``: a transformers config or its dict. When its quantization_config has a calibrated
    ``kv_cache``, that layout (which layers keep asymmetric value grids) is counted at both widths; else
    symmetric values.
    """
    layers, kv_heads, head_dim = kv_geometry(model_config)
    quant = model_config.get("quantization_config") if isinstance(model_config, dict) else \
        getattr(model_config, "quantization_config", None)
    kv = quant.get("kv_cache") if isinstance(quant, dict) else None
    entries = kv.get("layers") if isinstance(kv, dict) else None
    asymmetric = sum(1 for e in entries if isinstance(e, dict) and e.get("v_symmetric") is False) \
        if isinstance(entries, list) else 0
    table = {"fp16": fp_bytes_per_token(layers, kv_heads, head_dim)}
    for bits in (8, 4):
        table[f"int{bits}"] = (layers - asymmetric) * layer_bytes_per_token(kv_heads, head_dim, bits) + \
            asymmetric * layer_bytes_per_token(kv_heads, head_dim, bits, asymmetric_values=True)
    return table


def kv_geometry(model_config: object) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder config (object or dict)."""
    get = model_config.get if isinstance(model_config, dict) else (lambda k, d=None: getattr(model_config, k, d))
    layers = int(get("num_hidden_layers"))
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads") or heads)
    head_dim = get("head_dim") or int(get("hidden_size")) // heads
    return layers, kv_heads, int(head_dim)


__all__ = [
    "KV_BITS", "KV_FILE", "CLIP_GRID", "PARAM_BYTES", "check_kv_bits", "levels", "symmetric_zero", "quantize", "dequantize",
    "pack_int4", "unpack_int4", "token_params", "key_channel_params", "fake_quantize_keys", "asymmetric_gain_needed", "KeyFit", "ValueFit", "fit_keys", "fit_values",
    "dynamic_error", "LayerKV", "KVSpec", "fp_bytes_per_token", "layer_bytes_per_token", "kv_bytes_table", "kv_geometry",
]
