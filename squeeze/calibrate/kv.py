"""KV-cache calibration: run calibration windows, capture every layer's keys and values, fit their grids.

Keys and values are read from a plain DynamicCache after each window's forward, i.e. exactly the tensors a
cache receives at run time (keys post-RoPE). The first ``sink_tokens`` positions of each window are left
out: the runtime keeps them in full precision, and their outsized values would only widen the grids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from squeeze.calibrate.kv_fit import dynamic_error, fit_keys, fit_value_codebook, fit_values
from squeeze.errors import CalibrationError, ModelError
from squeeze.limits import DEFAULT_SINK_TOKENS, check_kv_bits, check_kv_group
from squeeze.models.modes import cache_kwarg, eval_mode, input_device
from squeeze.models.targets import attention_modules
from squeeze.quant.kv_spec import KVSpec, LayerKV, default_key_group, kv_geometry

Progress = Callable[[int, int], None]

#: At most this many calibration tokens per layer enter the fit (evenly strided): the clipping search costs
#: tokens x heads x dim x grid, and a few thousand tokens already pin down per-channel ranges.
MAX_FIT_TOKENS = 16384


@dataclass(frozen=True)
class KVCalibration:
    """The fitted spec plus what the fit measured: squared error per layer, calibrated vs dynamic absmax."""

    spec: KVSpec
    key_error: tuple[float, ...]
    value_error: tuple[float, ...]
    dynamic_key_error: tuple[float, ...]
    dynamic_value_error: tuple[float, ...]
    tokens: int

    def to_dict(self) -> dict[str, object]:
        return {
            "bits": self.spec.bits,
            "sink_tokens": self.spec.sink_tokens,
            "tokens": self.tokens,
            "key_error": sum(self.key_error),
            "value_error": sum(self.value_error),
            "dynamic_key_error": sum(self.dynamic_key_error),
            "dynamic_value_error": sum(self.dynamic_value_error),
            "asymmetric_key_layers": sum(1 for x in self.spec.layers if isinstance(x, LayerKV) and not x.k_symmetric),
            "asymmetric_value_layers": sum(1 for x in self.spec.layers if isinstance(x, LayerKV) and not x.v_symmetric),
            "key_group": next((x.key_group for x in self.spec.layers if isinstance(x, LayerKV)), None),
            "value_group": next((x.value_group for x in self.spec.layers if isinstance(x, LayerKV)), None),
            "value_codebook": any(isinstance(x, LayerKV) and x.v_levels is not None for x in self.spec.layers),
        }


def capture_kv(
    model: nn.Module, windows: torch.Tensor, sink_tokens: int, progress: Progress | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values of every layer over int64 ``windows (n, T)``: two lists of fp32 ``(N, H, D)``.

    N = n * (T - sink_tokens), at most MAX_FIT_TOKENS (evenly strided).
    """
    from transformers import DynamicCache

    n, t = windows.shape
    if t <= sink_tokens:
        raise CalibrationError(
            f"calibration windows of {t} tokens are not longer than the {sink_tokens} sink token(s) kept in full "
            "precision",
            hint="use a longer --seq-len or fewer sink tokens",
        )
    keys: list[list[torch.Tensor]] = []
    values: list[list[torch.Tensor]] = []
    device = input_device(model)
    with torch.inference_mode(), eval_mode(model):
        for i in range(n):
            cache = DynamicCache(config=getattr(model, "config", None))
            model(input_ids=windows[i : i + 1].to(device), use_cache=True, **{cache_kwarg(model): cache})
            for layer_idx, layer in enumerate(cache.layers):
                if layer_idx == len(keys):
                    keys.append([])
                    values.append([])
                k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
                if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
                    raise ModelError(
                        f"layer {layer_idx} caches no keys and values (linear attention?)",
                        hint="calibrate-kv quantizes the key/value cache of softmax attention only",
                    )
                # (1, H, T, D) -> (T - sink, H, D): tokens first, sink dropped
                keys[layer_idx].append(k[0, :, sink_tokens:].transpose(0, 1).float().cpu())
                values[layer_idx].append(v[0, :, sink_tokens:].transpose(0, 1).float().cpu())
            if progress is not None:
                progress(i + 1, n)
    return [_strided(torch.cat(k)) for k in keys], [_strided(torch.cat(v)) for v in values]


def _strided(samples: torch.Tensor) -> torch.Tensor:
    step = -(-samples.shape[0] // MAX_FIT_TOKENS)
    return samples[::step].contiguous()


def calibrate_kv(
    model: nn.Module,
    windows: torch.Tensor,
    bits: int,
    *,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    key_group: int | None = None,
    value_group: int | None = None,
    progress: Progress | None = None,
) -> KVCalibration:
    """Fit a KVSpec for ``model`` on calibration ``windows (n, T)`` int64 (see the module docstring).

    ``key_group`` / ``value_group``: channels per key / value grid (default:
    squeeze.quant.kv_spec.default_key_group / default_value_group). At int4 values get a calibrated codebook
    (squeeze.calibrate.kv_fit.fit_value_codebook), at int8 uniform grids with a calibrated clipping ratio.
    """
    bits = check_kv_bits(bits)
    if sink_tokens < 0:
        raise CalibrationError(f"sink_tokens must be >= 0, found {sink_tokens}")
    names = attention_modules(model)
    _, _, head_dim = kv_geometry(model.config)
    key_group = (
        default_key_group(bits, head_dim)
        if key_group is None
        else check_kv_group(key_group, head_dim, "key", CalibrationError)
    )
    if value_group is not None:
        check_kv_group(value_group, head_dim, "value", CalibrationError)
    keys, values = capture_kv(model, windows, sink_tokens, progress)
    if len(keys) != len(names):
        raise ModelError(f"the model filled {len(keys)} cache layers but has {len(names)} attention modules")
    layers, k_err, v_err, k_dyn, v_dyn = [], [], [], [], []
    for k, v in zip(keys, values, strict=True):
        kf = fit_keys(k, bits, key_group)
        vf = fit_value_codebook(v, bits, value_group) if bits == 4 else fit_values(v, bits, value_group)
        layers.append(LayerKV(kf.scale, kf.zero, vf.clip, kf.symmetric, vf.symmetric, vf.group, key_group, vf.levels))
        k_err.append(kf.sse)
        v_err.append(vf.sse)
        k_dyn.append(dynamic_error(k, bits))
        v_dyn.append(dynamic_error(v, bits))
    spec = KVSpec(bits, sink_tokens, names, tuple(layers))
    return KVCalibration(spec, tuple(k_err), tuple(v_err), tuple(k_dyn), tuple(v_dyn), tokens=int(keys[0].shape[0]))


__all__ = ["KVCalibration", "capture_kv", "calibrate_kv", "MAX_FIT_TOKENS"]
