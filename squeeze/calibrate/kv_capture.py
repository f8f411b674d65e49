"""KV-cache calibration: run calibration windows, capture every layer's keys and values, fit their grids.

Keys and values are read from a plain DynamicCache after each window's forward, i.e. exactly the tensors a
cache receives at run time (keys post-RoPE). For the int grids the first ``sink_tokens`` positions of each
window are left out: the runtime keeps them in full precision, and their outsized values would only widen
the grids. A token's position in its window is its position in the cache, which a rotating key centre needs
(:func:`sample_positions`, :func:`rope_frequencies`). fp8 (vLLM's cache) has no sink, so its per-layer absmax
runs over every token of every window.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from squeeze.calibrate.kv_fit import (
    dynamic_error,
    fit_keys,
    fit_value_codebook,
    fit_values,
    fp8_error,
    fp8_scale,
)
from squeeze.calibrate.queries import query_moments
from squeeze.errors import CalibrationError, ModelError
from squeeze.limits import KvChoice, check_kv_calibration, check_kv_group
from squeeze.models.modes import cache_kwarg, eval_mode, input_device
from squeeze.models.targets import attention_modules
from squeeze.quant.kv_bytes import default_key_group, kv_geometry
from squeeze.quant.kv_spec import KVSpec, LayerFP8, LayerKV

Progress = Callable[[int, int], None]
#: Called once per window with every layer's (keys, values), each fp32 (T, H, D) on the CPU.
WindowVisitor = Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None]

#: At most this many calibration tokens per layer enter the fit (evenly strided): the clipping search costs
#: tokens x heads x dim x grid, and a few thousand tokens already pin down per-channel ranges.
MAX_FIT_TOKENS = 16384


@dataclass(frozen=True)
class KVCalibration:
    """The fitted spec plus what the fit measured: squared error per layer, calibrated vs ``baseline`` (int
    grids: dynamic per-token absmax; fp8: scale 1.0, what vLLM uses when a checkpoint has no scales)."""

    spec: KVSpec
    key_error: tuple[float, ...]
    value_error: tuple[float, ...]
    dynamic_key_error: tuple[float, ...]
    dynamic_value_error: tuple[float, ...]
    tokens: int
    baseline: str = "dynamic per-token absmax"

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "bits": self.spec.choice,
            "sink_tokens": self.spec.sink_tokens,
            "tokens": self.tokens,
            "key_error": sum(self.key_error),
            "value_error": sum(self.value_error),
            "dynamic_key_error": sum(self.dynamic_key_error),
            "dynamic_value_error": sum(self.dynamic_value_error),
            "baseline": self.baseline,
        }
        fp8 = [x for x in self.spec.layers if isinstance(x, LayerFP8)]
        if fp8:
            out["k_scale_max"] = max(float(x.k_scale) for x in fp8)
            out["v_scale_max"] = max(float(x.v_scale) for x in fp8)
            return out
        grids = [x for x in self.spec.layers if isinstance(x, LayerKV)]
        out.update(
            asymmetric_key_layers=sum(1 for x in grids if not x.k_symmetric),
            asymmetric_value_layers=sum(1 for x in grids if not x.v_symmetric),
            key_group=next((x.key_group for x in grids), None),
            value_group=next((x.value_group for x in grids), None),
            value_codebook=any(x.v_levels is not None for x in grids),
            rotating_key_layers=sum(1 for x in grids if x.k_rotation is not None),
        )
        return out


def for_each_window(model: nn.Module, windows: torch.Tensor, visit: WindowVisitor, progress: Progress | None) -> None:
    """Run every window of int64 ``windows (n, T)`` through ``model`` with a fresh DynamicCache and hand
    ``visit`` every layer's keys (post-RoPE) and values as the cache received them: fp32 (T, H, D) on the CPU."""
    from transformers import DynamicCache

    n = windows.shape[0]
    device = input_device(model)
    with torch.inference_mode(), eval_mode(model):
        for i in range(n):
            cache = DynamicCache(config=getattr(model, "config", None))
            model(input_ids=windows[i : i + 1].to(device), use_cache=True, **{cache_kwarg(model): cache})
            layers = []
            for layer_idx, layer in enumerate(cache.layers):
                k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
                if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
                    raise ModelError(
                        f"layer {layer_idx} caches no keys and values (linear attention?)",
                        hint="calibrate-kv quantizes the key/value cache of softmax attention only",
                    )
                # (1, H, T, D) -> (T, H, D): tokens first
                layers.append((k[0].transpose(0, 1).float().cpu(), v[0].transpose(0, 1).float().cpu()))
            visit(layers)
            if progress is not None:
                progress(i + 1, n)


def capture_kv(
    model: nn.Module, windows: torch.Tensor, sink_tokens: int, progress: Progress | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values of every layer over int64 ``windows (n, T)``: two lists of fp32 ``(N, H, D)``.

    N = n * (T - sink_tokens), at most MAX_FIT_TOKENS (evenly strided).
    """
    t = windows.shape[1]
    if t <= sink_tokens:
        raise CalibrationError(
            f"calibration windows of {t} tokens are not longer than the {sink_tokens} sink token(s) kept in full "
            "precision",
            hint="use a longer --seq-len or fewer sink tokens",
        )
    keys: list[list[torch.Tensor]] = []
    values: list[list[torch.Tensor]] = []

    def keep(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer_idx, (k, v) in enumerate(layers):
            if layer_idx == len(keys):
                keys.append([])
                values.append([])
            keys[layer_idx].append(k[sink_tokens:])  # the sink dropped
            values[layer_idx].append(v[sink_tokens:])

    for_each_window(model, windows, keep, progress)
    return [_strided(torch.cat(k)) for k in keys], [_strided(torch.cat(v)) for v in values]


def _strided(samples: torch.Tensor) -> torch.Tensor:
    step = -(-samples.shape[0] // MAX_FIT_TOKENS)
    return samples[::step].contiguous()


def sample_positions(n: int, t: int, sink_tokens: int) -> torch.Tensor:
    """Cache positions (N,) int64 of the samples :func:`capture_kv` returns for ``n`` windows of ``t`` tokens."""
    return _strided(torch.arange(sink_tokens, t).repeat(n))


def rope_frequencies(model: nn.Module, head_dim: int) -> torch.Tensor | None:
    """The RoPE frequencies (D/2,) fp32 every attention layer of ``model`` rotates its keys with (transformers'
    rotary embedding ``inv_freq``, rotate-half layout), or None: no rotary embedding, several different ones
    (e.g. local and global layers), or one that does not rotate the whole head (partial rotary)."""
    found = [
        buffer.detach().float().cpu()
        for module in model.modules()
        if isinstance(buffer := getattr(module, "inv_freq", None), torch.Tensor)
    ]
    if not found or any(f.shape != found[0].shape or not torch.equal(f, found[0]) for f in found[1:]):
        return None
    freq = found[0]
    return freq if freq.shape == (head_dim // 2,) and bool(torch.isfinite(freq).all()) else None


def calibrate_kv(
    model: nn.Module,
    windows: torch.Tensor,
    bits: KvChoice,
    *,
    sink_tokens: int | None = None,
    key_group: int | None = None,
    value_group: int | None = None,
    key_rotation: bool = True,
    key_search: bool = True,
    progress: Progress | None = None,
) -> KVCalibration:
    """Fit a KVSpec for ``model`` on calibration ``windows (n, T)`` int64 (see the module docstring).

    ``bits`` 8 / 4: int grids. ``sink_tokens`` (default squeeze.limits.DEFAULT_SINK_TOKENS) are kept exact;
    ``key_group`` / ``value_group``: channels per key / value grid (default:
    squeeze.quant.kv_bytes.default_key_group / default_value_group). At int4 values get a calibrated codebook
    (squeeze.calibrate.kv_fit.fit_value_codebook), at int8 uniform grids with a calibrated clipping ratio.
    ``key_rotation``: at int4, also try a rotating key centre per layer (squeeze.calibrate.kv_fit.fit_rotation;
    kept where it cuts the key error) when the model's RoPE is known (:func:`rope_frequencies`). ``key_search``:
    at int4, refine the key scales channel by channel for the least error of the attention scores, weighted by
    the queries' second moments captured in the same pass (squeeze.calibrate.queries,
    squeeze.calibrate.kv_fit.refine_key_scale).
    ``bits`` "fp8": :func:`calibrate_fp8` (no sink, no grid options: CalibrationError if given).
    """
    bits, sink_tokens = check_kv_calibration(bits, sink_tokens, key_group, value_group, CalibrationError)
    if isinstance(bits, str):  # KV_FP8, the one choice that is not a width
        return calibrate_fp8(model, windows, progress=progress)
    names = attention_modules(model)
    _, kv_heads, head_dim = kv_geometry(model.config)
    key_group = (
        default_key_group(bits, head_dim)
        if key_group is None
        else check_kv_group(key_group, head_dim, "key", CalibrationError)
    )
    if value_group is not None:
        check_kv_group(value_group, head_dim, "value", CalibrationError)
    search = bits == 4 and key_search
    with query_moments(model, kv_heads, sink_tokens) if search else nullcontext() as queries:
        keys, values = capture_kv(model, windows, sink_tokens, progress)
    if len(keys) != len(names):
        raise ModelError(f"the model filled {len(keys)} cache layers but has {len(names)} attention modules")
    moments = queries.result(len(keys)) if queries is not None else [None] * len(keys)
    # rotating key centres at int4 only: at int8 the key error is already negligible (docs/benchmarks.md)
    rope = rope_frequencies(model, head_dim) if bits == 4 and key_rotation else None
    n, t = windows.shape
    positions = sample_positions(n, t, sink_tokens) if rope is not None else None
    layers, k_err, v_err, k_dyn, v_dyn = [], [], [], [], []
    for k, v, moment in zip(keys, values, moments, strict=True):
        kf = fit_keys(k, bits, key_group, positions=positions, rope_freq=rope, query_moments=moment)
        vf = fit_value_codebook(v, bits, value_group) if bits == 4 else fit_values(v, bits, value_group)
        layers.append(
            LayerKV(kf.scale, kf.zero, vf.clip, kf.symmetric, vf.symmetric, vf.group, key_group, vf.levels, kf.rotation)
        )
        k_err.append(kf.sse)
        v_err.append(vf.sse)
        k_dyn.append(dynamic_error(k, bits))
        v_dyn.append(dynamic_error(v, bits))
    spec = KVSpec(bits, sink_tokens, names, tuple(layers))
    return KVCalibration(spec, tuple(k_err), tuple(v_err), tuple(k_dyn), tuple(v_dyn), tokens=int(keys[0].shape[0]))


def calibrate_fp8(model: nn.Module, windows: torch.Tensor, *, progress: Progress | None = None) -> KVCalibration:
    """vLLM's fp8 KV scales for ``model`` from calibration ``windows (n, T)`` int64.

    Per layer ``k_scale = max |key| / 448`` (post-RoPE keys) and ``v_scale = max |value| / 448``, the maxima
    over every token (no sink), head and channel of every window (squeeze.calibrate.kv_fit.fp8_scale). The
    errors reported are the fp8 cache's squared error with these scales and with scale 1.0 (vLLM's default)
    on at most MAX_FIT_TOKENS evenly strided tokens per layer.
    """
    names = attention_modules(model)
    n, t = windows.shape
    step = -(-n * t // MAX_FIT_TOKENS)
    k_max: list[torch.Tensor] = []
    v_max: list[torch.Tensor] = []
    k_samples: list[list[torch.Tensor]] = []
    v_samples: list[list[torch.Tensor]] = []

    def reduce(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer_idx, (k, v) in enumerate(layers):
            k_abs, v_abs = k.abs().amax(), v.abs().amax()
            if layer_idx == len(k_max):
                k_max.append(k_abs)
                v_max.append(v_abs)
                k_samples.append([])
                v_samples.append([])
            else:  # NaN propagates (torch.maximum), so a broken forward cannot pass for a small scale
                k_max[layer_idx] = torch.maximum(k_max[layer_idx], k_abs)
                v_max[layer_idx] = torch.maximum(v_max[layer_idx], v_abs)
            k_samples[layer_idx].append(k[::step].clone())  # a copy: the window's cache can go
            v_samples[layer_idx].append(v[::step].clone())

    for_each_window(model, windows, reduce, progress)
    if len(k_max) != len(names):
        raise ModelError(f"the model filled {len(k_max)} cache layers but has {len(names)} attention modules")
    bad = [name for name, k, v in zip(names, k_max, v_max, strict=True) if not bool(torch.isfinite(k + v))]
    if bad:
        raise CalibrationError(
            f"keys or values of {bad[0]} (and {len(bad) - 1} more layers) are not finite on the calibration text",
            hint="check the model in full precision (squeeze eval), or calibrate on other text",
        )
    layers = tuple(LayerFP8(fp8_scale(k), fp8_scale(v)) for k, v in zip(k_max, v_max, strict=True))
    keys, values = [torch.cat(k) for k in k_samples], [torch.cat(v) for v in v_samples]
    return KVCalibration(
        KVSpec.fp8(names, layers),
        tuple(fp8_error(k, layer.k_scale) for k, layer in zip(keys, layers, strict=True)),
        tuple(fp8_error(v, layer.v_scale) for v, layer in zip(values, layers, strict=True)),
        tuple(fp8_error(k, 1.0) for k in keys),
        tuple(fp8_error(v, 1.0) for v in values),
        tokens=n * t,
        baseline="scale 1.0 (vLLM's default without scales)",
    )


__all__ = [
    "KVCalibration",
    "for_each_window",
    "capture_kv",
    "sample_positions",
    "rope_frequencies",
    "calibrate_kv",
    "calibrate_fp8",
    "MAX_FIT_TOKENS",
]
