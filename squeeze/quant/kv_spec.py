"""The spec of a quantized KV cache: per-layer calibrated quantizers, their artifact form, and byte accounting.

A :class:`KVSpec` is what ``squeeze calibrate-kv`` writes (``quantization_config.kv_cache`` in config.json
plus the tensors of :data:`KV_FILE`) and what the runtime cache (squeeze.runtime.kvcache) reads. Its layout
(grid sizes, symmetric or not, codebook or clipping ratio) also fixes the cache's bytes per token, counted
here for reports and memory estimates. The math on the codes is squeeze.quant.kv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from squeeze.errors import FormatError
from squeeze.limits import DEFAULT_SINK_TOKENS, KV_BITS, check_kv_bits, is_kv_group
from squeeze.quant.kv import PARAM_BYTES

#: The artifact file holding the calibrated scales ({attn}.k_scale / .k_zero, and .v_clip or .v_levels), beside
#: the shards.
KV_FILE = "kv_cache.safetensors"


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
        for name, layer in zip(self.names, self.layers, strict=True):
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
            "layers": [
                {
                    "module": name,
                    "k_symmetric": layer.k_symmetric,
                    "k_group": layer.key_group,
                    "v_symmetric": layer.v_symmetric,
                    "v_group": layer.value_group,
                    "v_codebook": layer.v_levels is not None,
                }
                for name, layer in zip(self.names, self.layers, strict=True)
                if layer is not None
            ],
        }

    @classmethod
    def from_config(cls, config: object, tensors: dict[str, Tensor], where: str = "config.json") -> KVSpec:
        """Rebuild a calibrated spec from ``to_config()``'s dict and the ``to_tensors()`` tensors (FormatError if
        bad)."""
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
                raise FormatError(
                    f"KV scales of {name} are missing (expected {name}.k_scale, .k_zero, .{value_role})",
                    hint="re-run squeeze calibrate-kv on the artifact",
                )
            k_scale, k_zero, v_part = (p.float() for p in parts if p is not None)
            v_shape = (1 << int(bits),) if codebook else k_scale.shape[:1]
            if k_scale.dim() != 2 or k_zero.shape != k_scale.shape or v_part.shape != v_shape:
                raise FormatError(
                    f"KV scales of {name} have inconsistent shapes: k_scale {tuple(k_scale.shape)}, "
                    f"k_zero {tuple(k_zero.shape)}, {value_role} {tuple(v_part.shape)}"
                )
            if codebook and not (bool(torch.isfinite(v_part).all()) and bool((v_part[1:] >= v_part[:-1]).all())):
                raise FormatError(
                    f"KV value codebook {name}.v_levels must be finite and ascending",
                    hint="re-run squeeze calibrate-kv on the artifact",
                )
            head_dim = int(k_scale.shape[-1])
            groups = [entry.get(key, head_dim) for key in ("k_group", "v_group")]
            for key, group in zip(("k_group", "v_group"), groups, strict=True):
                if not is_kv_group(group, head_dim):
                    raise FormatError(
                        f"{where}: kv_cache {key} of {name} must be an even divisor of {head_dim}, found {group!r}"
                    )
            names.append(name)
            layers.append(
                LayerKV(
                    k_scale,
                    k_zero,
                    torch.ones(k_scale.shape[0]) if codebook else v_part,
                    bool(entry.get("k_symmetric")),
                    bool(entry.get("v_symmetric")) or codebook,
                    groups[1],
                    groups[0],
                    v_part if codebook else None,
                )
            )
        return cls(int(bits), sink, tuple(names), tuple(layers))

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> int:
        """Cache bytes one token adds over all layers: packed codes plus per-token fp16 scales / offsets."""
        return sum(
            layer_bytes_per_token(kv_heads, head_dim, self.bits)
            if layer is None
            else layer_bytes_per_token(
                kv_heads,
                head_dim,
                self.bits,
                asymmetric_values=not layer.v_symmetric,
                value_groups=head_dim // layer.value_group,
                key_groups=head_dim // layer.key_group,
            )
            for layer in self.layers
        )


def layer_bytes_per_token(
    kv_heads: int,
    head_dim: int,
    bits: int,
    *,
    asymmetric_values: bool = False,
    value_groups: int = 1,
    key_groups: int = 1,
) -> int:
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
    quant = (
        model_config.get("quantization_config")
        if isinstance(model_config, dict)
        else getattr(model_config, "quantization_config", None)
    )
    kv = quant.get("kv_cache") if isinstance(quant, dict) else None
    entries = kv.get("layers") if isinstance(kv, dict) else None
    table = {"fp16": fp_bytes_per_token(layers, kv_heads, head_dim)}
    for bits in sorted(KV_BITS, reverse=True):
        default = layer_bytes_per_token(
            kv_heads,
            head_dim,
            bits,
            value_groups=head_dim // default_value_group(bits, head_dim),
            key_groups=head_dim // default_key_group(bits, head_dim),
        )
        if isinstance(kv, dict) and kv.get("bits") == bits and isinstance(entries, list) and len(entries) == layers:
            table[f"int{bits}"] = sum(
                layer_bytes_per_token(
                    kv_heads,
                    head_dim,
                    bits,
                    asymmetric_values=e.get("v_symmetric") is False,
                    value_groups=head_dim // int(e.get("v_group") or head_dim),
                    key_groups=head_dim // int(e.get("k_group") or head_dim),
                )
                if isinstance(e, dict)
                else default
                for e in entries
            )
        else:
            table[f"int{bits}"] = layers * default
    return table


def kv_geometry(model_config: object) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder config (object or dict)."""

    def get(key: str) -> Any:
        return model_config.get(key) if isinstance(model_config, dict) else getattr(model_config, key, None)

    layers = int(get("num_hidden_layers"))
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads") or heads)
    head_dim = get("head_dim") or int(get("hidden_size")) // heads
    return layers, kv_heads, int(head_dim)


__all__ = [
    "KV_BITS",
    "KV_FILE",
    "check_kv_bits",
    "default_key_group",
    "default_value_group",
    "LayerKV",
    "KVSpec",
    "layer_bytes_per_token",
    "fp_bytes_per_token",
    "kv_bytes_table",
    "kv_geometry",
]
