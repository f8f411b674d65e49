"""The spec of a quantized KV cache: per-layer calibrated quantizers, their artifact form, and byte accounting.

A :class:`KVSpec` is what ``squeeze calibrate-kv`` writes (``quantization_config.kv_cache`` in config.json
plus the tensors of :data:`KV_FILE`) and what the runtime cache (squeeze.runtime.quantized_cache) reads. Its layout
(grid sizes, symmetric or not, codebook or clipping ratio) also fixes the cache's bytes per token, counted
in squeeze.quant.kv_bytes for reports and memory estimates. The math on the codes is squeeze.quant.kv.

Two kinds (``KVSpec.kind``), one per layer type:

- ``"int"``: squeeze's calibrated int8 / int4 per-token grids (:class:`LayerKV`); config.json's section has
  no ``format`` key (artifacts written before fp8 existed read the same).
- ``"fp8_e4m3"``: vLLM's ``kv_cache_dtype="fp8"`` (:class:`LayerFP8`): ``{attn}.k_scale`` / ``{attn}.v_scale``,
  float32 0-dim tensors, the names vLLM maps to ``{attn}.attn.k_scale``. Its section::

      {"format": "fp8_e4m3", "version": 1, "keys": ..., "values": ..., "layers": [{"module": attn}, ...],
       "file": "kv_cache.safetensors", "calibration": ..., "calibration_hash": ...}

  validated strictly: unknown keys, another version, a missing, non-scalar, non-float32 or non-positive
  scale are FormatErrors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from squeeze.errors import FormatError
from squeeze.limits import DEFAULT_SINK_TOKENS, KV_BITS, KV_FP8, KvChoice, check_kv_bits, is_kv_group
from squeeze.quant.kv import FP8_E4M3_MAX, KeyRotation
from squeeze.quant.kv_bytes import fp_bytes_per_token, layer_bytes_per_token
from squeeze.quant.kv_file import KV_FILE, ROTATION_ROLES, fp8_scale_tensor, rotation_tensors

#: ``KVSpec.kind``, and config.json's ``kv_cache.format`` (absent: int grids).
KVKind = Literal["int", "fp8_e4m3"]
KV_INT: KVKind = "int"
KV_FP8_E4M3: KVKind = "fp8_e4m3"
KV_KINDS: tuple[KVKind, ...] = (KV_INT, KV_FP8_E4M3)

#: ``kv_cache.version`` of an int section with rotating key centres (absent: 1, none; older squeeze ignores the
#: key, so it is written only when some layer has one).
INT_ROTATION_VERSION = 2
INT_SECTION_VERSIONS = (1, INT_ROTATION_VERSION)

#: ``kv_cache.version`` of the fp8 section this squeeze writes and reads.
FP8_SECTION_VERSION = 1
_FP8_KEYS = {"format", "version", "keys", "values", "layers", "file", "calibration", "calibration_hash"}


@dataclass(frozen=True)
class LayerKV:
    """Calibrated quantizers of one attention layer's cache.

    ``k_scale`` / ``k_zero``: fp32 (H, D), the per-channel key normaliser (scale and centre, in key units).
    ``v_clip``: fp32 (H,), the clipping ratio of the per-token value grids per head. ``v_levels``: fp32
    (2**bits,) ascending, the value codebook, or None for uniform grids (then ``v_clip`` applies).
    ``k_group`` / ``v_group``: channels per key / value grid (None: the whole head). ``k_rotation``: a rotating
    key centre added to ``k_zero`` at every token's cache position (squeeze.quant.kv.KeyRotation), or None.
    """

    k_scale: Tensor
    k_zero: Tensor
    v_clip: Tensor
    k_symmetric: bool
    v_symmetric: bool
    v_group: int | None = None
    k_group: int | None = None
    v_levels: Tensor | None = None
    k_rotation: KeyRotation | None = None

    @property
    def value_group(self) -> int:
        """Channels per value grid."""
        return self.v_group or int(self.k_scale.shape[-1])

    @property
    def key_group(self) -> int:
        """Channels per key grid."""
        return self.k_group or int(self.k_scale.shape[-1])


@dataclass(frozen=True)
class LayerFP8:
    """vLLM's fp8 scales of one attention layer: ``k_scale`` / ``v_scale`` float32 0-dim tensors, > 0.

    Every key (post-RoPE) / value element of every head and token is stored as float8_e4m3fn(x / scale),
    saturated to +-448, and read back as code * scale (squeeze.quant.kv.quantize_fp8 / dequantize_fp8).
    """

    k_scale: Tensor
    v_scale: Tensor


@dataclass(frozen=True)
class KVSpec:
    """How a model's KV cache is quantized: ``bits``, the full-precision sink length, and per-layer quantizers.

    ``layers[i]`` belongs to the attention module ``names[i]`` (transformers' ``layer_idx`` i). ``kind``
    "int": :class:`LayerKV` layers, or ``None`` layers (the uncalibrated baseline), which quantize keys and
    values per token with plain absmax scales. ``kind`` "fp8_e4m3": :class:`LayerFP8` layers, ``bits`` 8 (bytes
    per element) and no sink (vLLM's fp8 cache stores every token in fp8).
    """

    bits: int
    sink_tokens: int
    names: tuple[str, ...]
    layers: tuple[LayerKV | LayerFP8 | None, ...]
    kind: KVKind = KV_INT

    def __post_init__(self) -> None:
        fp8 = self.kind == KV_FP8_E4M3
        if self.kind not in KV_KINDS or len(self.names) != len(self.layers):
            raise ValueError(
                f"a KVSpec of kind {self.kind!r} with {len(self.names)} names for {len(self.layers)} layers"
            )
        if fp8 and (self.bits != 8 or self.sink_tokens != 0):
            raise ValueError(f"an fp8 KVSpec has 8 bits and no sink, not {self.bits} and {self.sink_tokens}")
        if any(isinstance(layer, LayerFP8) != fp8 for layer in self.layers):  # int: LayerKV or None
            raise ValueError(f"a KVSpec of kind {self.kind!r} holds layers of another kind")

    @classmethod
    def fp8(cls, names: tuple[str, ...], layers: tuple[LayerFP8, ...]) -> KVSpec:
        """vLLM's fp8 cache with per-layer scales ``layers`` for the attention modules ``names``."""
        return cls(8, 0, names, layers, KV_FP8_E4M3)

    @property
    def calibrated(self) -> bool:
        return all(layer is not None for layer in self.layers)

    @property
    def choice(self) -> KvChoice:
        """What ``squeeze calibrate-kv --bits`` took to write this spec: 8, 4 or "fp8"."""
        return KV_FP8 if self.kind == KV_FP8_E4M3 else self.bits

    @property
    def label(self) -> str:
        """``int8``, ``int4`` or ``fp8``: the cache's name in reports."""
        return KV_FP8 if self.kind == KV_FP8_E4M3 else f"int{self.bits}"

    @classmethod
    def dynamic(cls, bits: int, names: tuple[str, ...], sink_tokens: int = DEFAULT_SINK_TOKENS) -> KVSpec:
        """The uncalibrated baseline: per-token absmax keys and values, symmetric."""
        return cls(check_kv_bits(bits), sink_tokens, names, tuple(None for _ in names))

    def to_tensors(self) -> dict[str, Tensor]:
        """``{attn}.k_scale`` / ``.k_zero`` (H, D), and ``{attn}.v_clip`` (H,) or ``{attn}.v_levels`` (2**bits,),
        fp32, for the artifact (plus ``.k_rot_freq`` (D,), ``.k_rot_cos`` / ``.k_rot_sin`` (H, D) for a rotating key
        centre); fp8: ``{attn}.k_scale`` / ``.v_scale``, fp32 0-dim."""
        out: dict[str, Tensor] = {}
        for name, layer in zip(self.names, self.layers, strict=True):
            if isinstance(layer, LayerFP8):
                out[f"{name}.k_scale"] = layer.k_scale.float().reshape(()).contiguous()
                out[f"{name}.v_scale"] = layer.v_scale.float().reshape(()).contiguous()
            elif layer is not None:
                out[f"{name}.k_scale"] = layer.k_scale.float().contiguous()
                out[f"{name}.k_zero"] = layer.k_zero.float().contiguous()
                if layer.k_rotation is not None:
                    rot = layer.k_rotation
                    for role, tensor in zip(ROTATION_ROLES, (rot.freq, rot.cos_amp, rot.sin_amp), strict=True):
                        out[f"{name}.{role}"] = tensor.float().contiguous()
                if layer.v_levels is None:
                    out[f"{name}.v_clip"] = layer.v_clip.float().contiguous()
                else:
                    out[f"{name}.v_levels"] = layer.v_levels.float().contiguous()
        return out

    def to_config(self) -> dict[str, object]:
        """The ``quantization_config.kv_cache`` entry of an artifact's config.json (tensors go elsewhere)."""
        if self.kind == KV_FP8_E4M3:
            return {
                "format": KV_FP8_E4M3,
                "version": FP8_SECTION_VERSION,
                "keys": "float8_e4m3fn(key / k_scale), post-RoPE; k_scale: one float32 per layer, calibration "
                f"absmax / {FP8_E4M3_MAX:g}",
                "values": f"float8_e4m3fn(value / v_scale); v_scale: one float32 per layer, calibration absmax / "
                f"{FP8_E4M3_MAX:g}",
                "layers": [{"module": name} for name in self.names],
            }
        rotating = any(isinstance(layer, LayerKV) and layer.k_rotation is not None for layer in self.layers)
        section: dict[str, object] = {"version": INT_ROTATION_VERSION} if rotating else {}
        return section | {
            "bits": self.bits,
            "sink_tokens": self.sink_tokens,
            "keys": "per-channel normaliser (k_scale, k_zero) then per-token grids of k_group channels, post-RoPE"
            + (
                "; with k_rotation, the centre is k_zero + k_rot_cos * cos(p * k_rot_freq) + k_rot_sin * "
                "sin(p * k_rot_freq) at the token's cache position p (sink included, from 0)"
                if rotating
                else ""
            ),
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
                | ({"k_rotation": True} if layer.k_rotation is not None else {})
                for name, layer in zip(self.names, self.layers, strict=True)
                if isinstance(layer, LayerKV)
            ],
        }

    @classmethod
    def from_config(cls, config: object, tensors: dict[str, Tensor], where: str = "config.json") -> KVSpec:
        """Rebuild a calibrated spec from ``to_config()``'s dict and the ``to_tensors()`` tensors (FormatError if
        bad)."""
        if not isinstance(config, dict):
            raise FormatError(f"{where}: quantization_config.kv_cache must be an object")
        kind = config.get("format", KV_INT)
        if kind not in KV_KINDS:
            raise FormatError(
                f"{where}: kv_cache.format must be one of {list(KV_KINDS)}, found {kind!r}",
                hint="the artifact may come from a newer squeeze; upgrade squeeze, or re-run squeeze calibrate-kv",
            )
        if kind == KV_FP8_E4M3:
            return cls._fp8_from_config(config, tensors, where)
        version = config.get("version", 1)
        if version not in INT_SECTION_VERSIONS or isinstance(version, bool):
            raise FormatError(
                f"{where}: kv_cache.version is {version!r}; this squeeze reads {list(INT_SECTION_VERSIONS)}",
                hint="the artifact may come from a newer squeeze; upgrade squeeze, or re-run squeeze calibrate-kv",
            )
        bits, sink, entries = config.get("bits"), config.get("sink_tokens"), config.get("layers")
        bits = check_kv_bits(bits, f"{where}: kv_cache.bits", FormatError, hint=None)
        if not isinstance(sink, int) or isinstance(sink, bool) or sink < 0:
            raise FormatError(f"{where}: kv_cache.sink_tokens must be an integer >= 0, found {sink!r}")
        if not isinstance(entries, list) or not entries:
            raise FormatError(f"{where}: kv_cache.layers must be a non-empty list")
        names, layers = [], []
        for entry in entries:
            name, layer = _int_layer(entry, tensors, int(bits), version, where)
            names.append(name)
            layers.append(layer)
        return cls(int(bits), sink, tuple(names), tuple(layers))

    @classmethod
    def _fp8_from_config(cls, config: dict[str, Any], tensors: dict[str, Tensor], where: str) -> KVSpec:
        """The fp8 spec of a ``format: fp8_e4m3`` section (see the module docstring)."""
        hint = "re-run squeeze calibrate-kv --bits fp8 on the artifact"
        unknown = sorted(set(config) - _FP8_KEYS)
        if unknown:
            raise FormatError(f"{where}: unknown kv_cache keys for format {KV_FP8_E4M3}: {unknown}", hint=hint)
        version = config.get("version")
        if version != FP8_SECTION_VERSION or isinstance(version, bool):
            raise FormatError(
                f"{where}: kv_cache.version of format {KV_FP8_E4M3} is {version!r}; this squeeze reads "
                f"{FP8_SECTION_VERSION}",
                hint="upgrade squeeze, or " + hint,
            )
        entries = config.get("layers")
        if not isinstance(entries, list) or not entries:
            raise FormatError(f"{where}: kv_cache.layers must be a non-empty list", hint=hint)
        names: list[str] = []
        for entry in entries:
            if not isinstance(entry, dict) or set(entry) != {"module"} or not isinstance(entry["module"], str):
                raise FormatError(
                    f"{where}: every fp8 kv_cache.layers entry is {{'module': name}}, found {entry!r}", hint=hint
                )
            if entry["module"] in names:
                raise FormatError(f"{where}: kv_cache.layers names {entry['module']} twice", hint=hint)
            names.append(entry["module"])
        layers = tuple(
            LayerFP8(*(fp8_scale_tensor(tensors, f"{name}.{role}") for role in ("k_scale", "v_scale")))
            for name in names
        )
        return cls.fp8(tuple(names), layers)

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> int:
        """Cache bytes one token adds over all layers: packed codes plus per-token fp16 scales / offsets (fp8: one
        byte per element, its scales are per layer)."""
        return sum(
            layer_bytes_per_token(kv_heads, head_dim, self.bits)
            if layer is None
            else fp_bytes_per_token(1, kv_heads, head_dim, element_bytes=1)
            if isinstance(layer, LayerFP8)
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


def _int_layer(
    entry: object, tensors: dict[str, Tensor], bits: int, version: object, where: str
) -> tuple[str, LayerKV]:
    """(module name, its calibrated int grids) of one ``kv_cache.layers`` entry of an int section, with its tensors
    from the KV file (FormatError if bad)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("module"), str):
        raise FormatError(f"{where}: every kv_cache.layers entry needs a 'module' name")
    name = entry["module"]
    codebook, rotating = entry.get("v_codebook", False), entry.get("k_rotation", False)
    for key, flag in (("v_codebook", codebook), ("k_rotation", rotating)):
        if not isinstance(flag, bool):
            raise FormatError(f"{where}: kv_cache {key} of {name} must be true or false, found {flag!r}")
    if rotating and version != INT_ROTATION_VERSION:
        raise FormatError(f"{where}: kv_cache k_rotation of {name} needs kv_cache.version 2")
    value_role = "v_levels" if codebook else "v_clip"
    parts = [tensors.get(f"{name}.{role}") for role in ("k_scale", "k_zero", value_role)]
    if any(p is None for p in parts):
        raise FormatError(
            f"KV scales of {name} are missing (expected {name}.k_scale, .k_zero, .{value_role})",
            hint="re-run squeeze calibrate-kv on the artifact",
        )
    k_scale, k_zero, v_part = (p.float() for p in parts if p is not None)
    v_shape = (1 << bits,) if codebook else k_scale.shape[:1]
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
    rotation = rotation_tensors(tensors, name, tuple(k_scale.shape)) if rotating else None
    return name, LayerKV(
        k_scale,
        k_zero,
        torch.ones(k_scale.shape[0]) if codebook else v_part,
        bool(entry.get("k_symmetric")),
        bool(entry.get("v_symmetric")) or codebook,
        groups[1],
        groups[0],
        v_part if codebook else None,
        rotation,
    )


__all__ = [
    "KV_BITS",
    "KV_FILE",
    "KVKind",
    "KV_INT",
    "KV_FP8_E4M3",
    "KV_KINDS",
    "FP8_SECTION_VERSION",
    "INT_ROTATION_VERSION",
    "INT_SECTION_VERSIONS",
    "ROTATION_ROLES",
    "check_kv_bits",
    "LayerKV",
    "LayerFP8",
    "KVSpec",
]
