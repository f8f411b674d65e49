"""KV-cache quantization math: int8 / int4 codes on per-token grids, int4 packing, scale fitting.

Every quantized K/V element is a code ``q`` on a per-token grid (one fp16 ``scale`` per batch row, head and
token): symmetric grids read back ``q * scale`` with int8 codes in [-qmax - 1, qmax]; asymmetric ones
``offset + q * scale`` with uint8 codes in [0, 2**bits - 1] and an fp16 ``offset`` per token too.

- Values, int8: the token's own range, shrunk by a clipping ratio per head calibrated offline (KVQuant:
  values per token). Values, int4: a calibrated codebook of 16 levels per layer (KVQuant's non-uniform
  "nuq" datatype) on the token's absmax-scaled values, ``levels[code] * scale``: the levels are a weighted
  1-D k-means of the calibration values, so they sit where values are dense instead of evenly spaced.
- Keys: keys have a few channels far larger than the rest (KVQuant), so they are first normalised per
  channel with a calibrated ``k_scale`` and centre ``k_zero`` (H, D), ``(k - k_zero) / k_scale``, and the
  normalised vector gets symmetric per-token grids (one per ``k_group`` channels: 32 at int4). A purely
  static per-channel grid (KVQuant without its sparse outliers) clamps every key outside the calibrated
  range: on stories260K, calibrated on 500 tokens, one key of another text came back off by 18 (its range
  is +-24). Normalising per channel and then scaling per token keeps the calibrated channel balance and
  adapts to every token.
- The uncalibrated baseline: symmetric per-token absmax grids for keys and values, no normalisation.

int4 codes are packed two per byte along the head dimension (their low 4 bits, two's complement for
signed codes; codebook indices unsigned), the even channel in the low nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from squeeze.config import DEFAULT_SINK_TOKENS
from squeeze.errors import FormatError
from squeeze.limits import KV_BITS, check_kv_bits, check_kv_group, is_kv_group
from squeeze.quant.kmeans import weighted_kmeans_1d

#: The artifact file holding the calibrated scales ({attn}.k_scale / .k_zero, and .v_clip or .v_levels), beside
#: the shards.
KV_FILE = "kv_cache.safetensors"
#: Clipping ratios tried for per-token value grids (range shrunk to ``ratio * range``); 1.0 = plain min-max.
CLIP_GRID = tuple(round(0.5 + 0.025 * i, 3) for i in range(21))

#: Per-token grid parameters are stored in fp16: 2 bytes per scale / offset.
PARAM_BYTES = 2


def asymmetric_gain_needed(group: int) -> float:
    """Error ratio an asymmetric value grid must beat to pay for its per-token offset.

    The offset adds 16 bits per grid of ``group`` channels, i.e. 16 / group bits per value; one more bit per
    value cuts the squared error of a uniform grid by 4x, so the offset is worth it only when it cuts the
    error by more than 4 ** (16 / group) (1.41x for 64 channels): a rate-distortion rule, the same at 8 and
    4 bits.
    """
    return float(4.0 ** (-PARAM_BYTES * 8 / group))


def default_value_group(bits: int, head_dim: int) -> int:
    """Channels per value grid by default: the whole head, at both widths.

    Measured on SmolLM2-135M (docs/benchmarks.md): grids of 32 channels at int4 helped symmetric-only
    grids (+4.1% -> +3.1% perplexity on 10 windows) but not the calibrated layout, whose asymmetric
    layers then no longer pay for their offsets (+3.81% per head vs +3.98% per 32 channels on 40
    windows, at 0.270 vs 0.274 of fp16 bytes). ``--value-group-size 32`` keeps the option.
    """
    return head_dim


def default_key_group(bits: int, head_dim: int) -> int:
    """Channels per key grid by default: 32 at int4 (heads of 64 channels or more), else the whole head.

    Measured on SmolLM2-135M (docs/benchmarks.md, 10 windows): int4 keys alone cost +2.37% perplexity with
    one grid per head and +1.30% with grids of 32 channels; the second fp16 scale per head costs 1/64 of
    fp16's bytes at head_dim 64 (0.273 of fp16 in all). At int8 the error is already negligible and the
    bytes budget tight (0.52), so keys keep one grid per head.
    """
    return 32 if bits == 4 and head_dim >= 64 and head_dim % 32 == 0 else head_dim


#: The table and its checks live in squeeze.limits (KV_BITS, the even-divisor rule); these names stay for callers.
is_group = is_kv_group
check_group = check_kv_group


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


def fake_quantize_keys(keys: Tensor, scale: Tensor, center: Tensor, bits: int, group: int | None = None) -> Tensor:
    """The reference of the runtime key path: normalise per channel, per-token grids of ``group`` channels
    (default: the whole head), back. Shape of ``keys``.

    ``keys (..., H, T, D)`` or ``(N, H, D)`` with ``scale`` / ``center`` broadcast to it.
    """
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


@dataclass(frozen=True)
class KeyFit:
    """Key normaliser of one layer: scale / centre fp32 (H, D); the squared error it had on calibration."""

    scale: Tensor
    zero: Tensor
    symmetric: bool
    sse: float


@dataclass(frozen=True)
class ValueFit:
    """Per-token value quantizer of one layer, grids of ``group`` channels: a clipping ratio per head, fp32
    (H,), or a codebook ``levels`` fp32 (2**bits,) (then ``clip`` is all ones and ``symmetric`` True)."""

    clip: Tensor
    symmetric: bool
    sse: float
    group: int
    levels: Tensor | None = None


def fit_keys(samples: Tensor, bits: int, group: int | None = None) -> KeyFit:
    """Fit the per-channel key normaliser on ``samples (N, H, D)`` fp32 (N calibration tokens, sink excluded),
    for per-token grids of ``group`` channels (default: the whole head).

    Centred (asymmetric) vs not is chosen per layer by the total squared error of :func:`fake_quantize_keys`.
    """
    lo, hi = samples.amin(dim=0), samples.amax(dim=0)  # (H, D)
    best: KeyFit | None = None
    for symmetric in (True, False):
        scale, center = key_channel_params(lo, hi, symmetric)
        sse = float((fake_quantize_keys(samples, scale, center, bits, group) - samples).square().sum())
        if best is None or sse < best.sse:
            best = KeyFit(scale, center, symmetric, sse)
    assert best is not None  # the loop runs twice
    return best


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


def dynamic_error(samples: Tensor, bits: int) -> float:
    """Squared error of plain per-token absmax quantization (the uncalibrated baseline) on ``samples``."""
    scale, _ = token_grid(samples, bits, 1.0, True)
    return float((dequantize(quantize(samples, scale, None, bits), scale, None) - samples).square().sum())




@dataclass(frozen=True)
class LayerKV:
    """Calibrated quantizers of one attention layer's cache.

    ``k_scale`` / ``k_zero``: fp32 (H, D), the per-channel key normaliser (scale and centre, in key units).
    ``v_clip``: fp32 (H,), the clipping ratio of the per-token value grids per head. ``v_levels``: fp32
    (2**bits,) ascending, the value codebook, or None for uniform grids (then ``v_clip`` applies).
    ``k_group`` / ``v_group``: channels per key / value grid (None: the whole head).
    """

    k_scale: Tensor
    k_zero: Tensor
    v_clip: Tensor
    k_symmetric: bool
    v_symmetric: bool
    v_group: int | None = None
    k_group: int | None = None
    v_levels: Tensor | None = None

    @property
    def value_group(self) -> int:
        """Channels per value grid."""
        return self.v_group or int(self.k_scale.shape[-1])

    @property
    def key_group(self) -> int:
        """Channels per key grid."""
        return self.k_group or int(self.k_scale.shape[-1])


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
    def dynamic(cls, bits: int, names: tuple[str, ...], sink_tokens: int = DEFAULT_SINK_TOKENS) -> KVSpec:
        """The uncalibrated baseline: per-token absmax keys and values, symmetric."""
        return cls(check_kv_bits(bits), sink_tokens, names, tuple(None for _ in names))

    def to_tensors(self) -> dict[str, Tensor]:
        """``{attn}.k_scale`` / ``.k_zero`` (H, D), and ``{attn}.v_clip`` (H,) or ``{attn}.v_levels`` (2**bits,),
        fp32, for the artifact."""
        out: dict[str, Tensor] = {}
        for name, layer in zip(self.names, self.layers):
            if layer is not None:
                out[f"{name}.k_scale"] = layer.k_scale.float().contiguous()
                out[f"{name}.k_zero"] = layer.k_zero.float().contiguous()
                if layer.v_levels is None:
                    out[f"{name}.v_clip"] = layer.v_clip.float().contiguous()
                else:
                    out[f"{name}.v_levels"] = layer.v_levels.float().contiguous()
        return out

    def to_config(self) -> dict[str, object]:
        """The ``quantization_config.kv_cache`` entry of an artifact's config.json (tensors go elsewhere)."""
        return {
            "bits": self.bits,
            "sink_tokens": self.sink_tokens,
            "keys": "per-channel normaliser (k_scale, k_zero) then per-token grids of k_group channels, post-RoPE",
            "values": "per-token grids of v_group channels: a calibrated clipping ratio per head (v_clip), or a "
                      "codebook of levels scaled by the grid's absmax (v_levels, when v_codebook)",
            "layers": [{"module": name, "k_symmetric": layer.k_symmetric, "k_group": layer.key_group,
                        "v_symmetric": layer.v_symmetric, "v_group": layer.value_group,
                        "v_codebook": layer.v_levels is not None}
                       for name, layer in zip(self.names, self.layers) if layer is not None],
        }

    @classmethod
    def from_config(cls, config: object, tensors: dict[str, Tensor], where: str = "config.json") -> KVSpec:
        """Rebuild a calibrated spec from ``to_config()``'s dict and the ``to_tensors()`` tensors (FormatError if bad)."""
        if not isinstance(config, dict):
            raise FormatError(f"{where}: quantization_config.kv_cache must be an object")
        bits, sink, entries = config.get("bits"), config.get("sink_tokens"), config.get("layers")
        bits = check_kv_bits(bits, f"{where}: kv_cache.bits", FormatError, hint=None)
        if not isinstance(sink, int) or isinstance(sink, bool) or sink < 0:
            raise FormatError(f"{where}: kv_cache.sink_tokens must be an integer >= 0, found {sink!r}")
        if not isinstance(entries, list) or not entries:
            raise FormatError(f"{where}: kv_cache.layers must be a non-empty list")
        names, layers = [], []
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("module"), str):
                raise FormatError(f"{where}: every kv_cache.layers entry needs a 'module' name")
            name = entry["module"]
            codebook = entry.get("v_codebook", False)
            if not isinstance(codebook, bool):
                raise FormatError(f"{where}: kv_cache v_codebook of {name} must be true or false, found {codebook!r}")
            value_role = "v_levels" if codebook else "v_clip"
            parts = [tensors.get(f"{name}.{role}") for role in ("k_scale", "k_zero", value_role)]
            if any(p is None for p in parts):
                raise FormatError(f"KV scales of {name} are missing (expected {name}.k_scale, .k_zero, .{value_role})",
                                  hint="re-run squeeze calibrate-kv on the artifact")
            k_scale, k_zero, v_part = (p.float() for p in parts if p is not None)
            v_shape = (1 << int(bits),) if codebook else k_scale.shape[:1]
            if k_scale.dim() != 2 or k_zero.shape != k_scale.shape or v_part.shape != v_shape:
                raise FormatError(f"KV scales of {name} have inconsistent shapes: k_scale {tuple(k_scale.shape)}, "
                                  f"k_zero {tuple(k_zero.shape)}, {value_role} {tuple(v_part.shape)}")
            if codebook and not (bool(torch.isfinite(v_part).all()) and bool((v_part[1:] >= v_part[:-1]).all())):
                raise FormatError(f"KV value codebook {name}.v_levels must be finite and ascending",
                                  hint="re-run squeeze calibrate-kv on the artifact")
            head_dim = int(k_scale.shape[-1])
            groups = [entry.get(key, head_dim) for key in ("k_group", "v_group")]
            for key, group in zip(("k_group", "v_group"), groups):
                if not is_kv_group(group, head_dim):
                    raise FormatError(f"{where}: kv_cache {key} of {name} must be an even divisor of {head_dim}, "
                                      f"found {group!r}")
            names.append(name)
            layers.append(LayerKV(k_scale, k_zero, torch.ones(k_scale.shape[0]) if codebook else v_part,
                                  bool(entry.get("k_symmetric")), bool(entry.get("v_symmetric")) or codebook,
                                  groups[1], groups[0], v_part if codebook else None))
        return cls(int(bits), sink, tuple(names), tuple(layers))

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> int:
        """Cache bytes one token adds over all layers: packed codes plus per-token fp16 scales / offsets."""
        return sum(
            layer_bytes_per_token(kv_heads, head_dim, self.bits) if layer is None else
            layer_bytes_per_token(kv_heads, head_dim, self.bits, asymmetric_values=not layer.v_symmetric,
                                  value_groups=head_dim // layer.value_group, key_groups=head_dim // layer.key_group)
            for layer in self.layers
        )


def layer_bytes_per_token(kv_heads: int, head_dim: int, bits: int, *, asymmetric_values: bool = False,
                          value_groups: int = 1, key_groups: int = 1) -> int:
    """Bytes one token adds to one quantized layer: key and value codes, an fp16 scale per key grid, and
    an fp16 scale (plus an offset when asymmetric) per value grid. Key normalisers and value codebooks are
    per layer."""
    codes = 2 * kv_heads * head_dim * bits // 8
    key_params = kv_heads * key_groups * PARAM_BYTES
    value_params = kv_heads * value_groups * PARAM_BYTES * (2 if asymmetric_values else 1)
    return codes + key_params + value_params


def fp_bytes_per_token(n_layers: int, kv_heads: int, head_dim: int, element_bytes: int = 2) -> int:
    """Bytes one token adds to an unquantized cache (fp16 by default) over all layers."""
    return 2 * n_layers * kv_heads * head_dim * element_bytes


def kv_bytes_table(model_config: object) -> dict[str, int]:
    """KV bytes per token over all layers: fp16, int8 and int4 (codes plus per-token scales / offsets).

    ``model_config``: a transformers config or its dict. The width its quantization_config's ``kv_cache``
    was calibrated for is counted with that layout (asymmetric layers, grid sizes); other widths with the
    default one (symmetric values, :func:`default_key_group`, :func:`default_value_group`).
    """
    layers, kv_heads, head_dim = kv_geometry(model_config)
    quant = model_config.get("quantization_config") if isinstance(model_config, dict) else \
        getattr(model_config, "quantization_config", None)
    kv = quant.get("kv_cache") if isinstance(quant, dict) else None
    entries = kv.get("layers") if isinstance(kv, dict) else None
    table = {"fp16": fp_bytes_per_token(layers, kv_heads, head_dim)}
    for bits in (8, 4):
        default = layer_bytes_per_token(kv_heads, head_dim, bits,
                                        value_groups=head_dim // default_value_group(bits, head_dim),
                                        key_groups=head_dim // default_key_group(bits, head_dim))
        if isinstance(kv, dict) and kv.get("bits") == bits and isinstance(entries, list) and len(entries) == layers:
            table[f"int{bits}"] = sum(
                layer_bytes_per_token(kv_heads, head_dim, bits, asymmetric_values=e.get("v_symmetric") is False,
                                      value_groups=head_dim // int(e.get("v_group") or head_dim),
                                      key_groups=head_dim // int(e.get("k_group") or head_dim))
                if isinstance(e, dict) else default for e in entries)
        else:
            table[f"int{bits}"] = layers * default
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
    "KV_BITS", "KV_FILE", "CLIP_GRID", "PARAM_BYTES", "check_kv_bits", "levels", "qmax", "quantize", "dequantize", "interleave",
    "pack_int4", "unpack_int4", "token_grid", "codebook_scale", "quantize_codebook", "dequantize_codebook",
    "fit_value_codebook", "default_key_group", "is_group", "check_group", "key_channel_params", "normalize_keys", "denormalize_keys_", "fake_quantize_keys", "asymmetric_gain_needed", "default_value_group", "KeyFit", "ValueFit", "fit_keys", "fit_values",
    "dynamic_error", "LayerKV", "KVSpec", "fp_bytes_per_token", "layer_bytes_per_token", "kv_bytes_table", "kv_geometry",
]
