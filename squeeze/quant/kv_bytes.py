"""Bytes per token of a KV cache (fp16, fp8, int8, int4), the default grid layout they are counted with, and a
decoder's KV geometry; for reports and memory estimates.

Split from ``squeeze.quant.kv_spec`` (whose ``KVSpec.bytes_per_token`` counts a calibrated spec with these).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from squeeze.limits import KV_BITS, KV_FP8
from squeeze.quant.kv import PARAM_BYTES


def default_value_group(bits: int, head_dim: int) -> int:
    """Channels per value grid by default: the whole head, at both widths.

    Measured on SmolLM2-135M (docs/benchmarks.md): grids of 32 channels at int4 helped symmetric-only
    grids (+4.1% -> +3.1% perplexity on 10 windows) but not the calibrated layout, whose asymmetric
    layers then no longer pay for their offsets (+3.81% per head vs +3.98% per 32 channels on 40
    windows, at 0.270 vs 0.274 of fp16 bytes). ``--value-group-size 32`` keeps the option.
    """
    return head_dim


def default_key_group(bits: int, head_dim: int) -> int:
    """Channels per key grid by default: at int4 32 (heads of 64 channels or more) or half the head (smaller
    heads); at int8 the whole head.

    Measured on SmolLM2-135M (docs/benchmarks.md, 10 windows): int4 keys alone cost +2.37% perplexity with
    one grid per head and +1.30% with grids of 32 channels; the second fp16 scale per head costs 1/64 of
    fp16's bytes at head_dim 64 (0.273 of fp16 in all). Small heads: on stories260K w4 (head_dim 8, one
    slowly rotating post-RoPE channel pair far larger than the rest, which sets every token's grid), int4
    KV calibrated on sotu.txt cost +8.9% perplexity on tinystories_sample.txt with one key grid per head
    and +4.7% with two (0.375 -> 0.4375 of fp16's bytes); re-weighting the per-channel normaliser by
    queries, Fisher information or attention-output error moved it by less than the spread between
    calibration texts. At int8 the error is already negligible and the bytes budget tight (0.52), so keys
    keep one grid per head.
    """
    if bits != 4:
        return head_dim
    if head_dim >= 64:
        return 32 if head_dim % 32 == 0 else head_dim
    half = head_dim // 2
    return half if half >= 2 and half % 2 == 0 else head_dim  # int4 packs channel pairs: grids span even counts


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


def kv_bytes_table(model_config: object, kv: Mapping[str, Any] | None = None) -> dict[str, int]:
    """KV bytes per token over all layers: fp16, fp8, int8 and int4 (codes plus per-token scales / offsets).

    ``model_config``: a transformers config or its dict (its geometry). ``kv``: the artifact's calibrated
    ``kv_cache`` entry (:meth:`KVSpec.to_config`), if any: the width it was calibrated for is counted with that
    layout (asymmetric layers, grid sizes); other widths with the default one (symmetric values,
    :func:`default_key_group`, :func:`default_value_group`).
    """
    layers, kv_heads, head_dim = kv_geometry(model_config)
    entries = kv.get("layers") if isinstance(kv, dict) else None
    table = {
        "fp16": fp_bytes_per_token(layers, kv_heads, head_dim),
        KV_FP8: fp_bytes_per_token(layers, kv_heads, head_dim, element_bytes=1),  # per-layer scales only
    }
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
