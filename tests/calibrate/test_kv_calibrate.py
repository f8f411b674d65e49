"""KV calibration (squeeze.calibrate.kv_capture) for vLLM's fp8 cache: scales are the absmax of every token / 448."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from squeeze.calibrate.kv_capture import calibrate_kv
from squeeze.calibrate.windows import sample_windows, tokenize_text
from squeeze.errors import CalibrationError
from squeeze.models.modes import cache_kwarg
from squeeze.models.targets import attention_modules
from squeeze.quant.kv_spec import KV_FP8_E4M3, LayerFP8


@pytest.fixture(scope="module")
def stories_windows(stories, tinystories_text):  # noqa: ANN001, ANN201
    model, tokenizer = stories
    return model, sample_windows(tokenize_text(tinystories_text, tokenizer), 3, 48, seed=0)


def test_fp8_scales_are_the_absmax_of_every_token_over_448(stories_windows) -> None:  # noqa: ANN001
    model, windows = stories_windows
    fit = calibrate_kv(model, windows, "fp8")
    spec = fit.spec
    assert spec.kind == KV_FP8_E4M3 and spec.sink_tokens == 0 and spec.names == attention_modules(model)
    # the reference: what each layer's DynamicCache holds after each window (keys post-RoPE), position 0 included
    k_max = torch.zeros(len(spec.names))
    v_max = torch.zeros(len(spec.names))
    with torch.inference_mode():
        for window in windows:
            cache = DynamicCache(config=model.config)
            model(input_ids=window[None], use_cache=True, **{cache_kwarg(model): cache})
            for i, layer in enumerate(cache.layers):
                k_max[i] = max(k_max[i], layer.keys.abs().max())
                v_max[i] = max(v_max[i], layer.values.abs().max())
    for i, layer in enumerate(spec.layers):
        assert isinstance(layer, LayerFP8) and layer.k_scale.dtype == torch.float32 and layer.k_scale.shape == ()
        assert torch.equal(layer.k_scale, k_max[i] / 448) and torch.equal(layer.v_scale, v_max[i] / 448)
    summary = fit.to_dict()
    assert summary["bits"] == "fp8" and summary["tokens"] == windows.numel()
    assert summary["k_scale_max"] == pytest.approx(float(k_max.max() / 448))
    # the errors reported: fp8 with these scales, and with vLLM's default scale 1.0 (about as good here: nothing
    # of stories260K reaches 448 or falls below e4m3's normal range, where a scale starts to matter)
    assert len(fit.key_error) == len(fit.dynamic_key_error) == len(spec.names) and all(e > 0 for e in fit.key_error)
    assert fit.key_error != fit.dynamic_key_error and "scale 1.0" in fit.baseline


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"key_group": 4}, "--key-group-size applies to the int8 / int4 grids only"),
        ({"value_group": 8}, "--value-group-size applies"),
        ({"sink_tokens": 4}, "--sink-tokens applies"),
    ],
)
def test_fp8_refuses_int_grid_options(stories_windows, options: dict, match: str) -> None:  # noqa: ANN001
    model, windows = stories_windows
    with pytest.raises(CalibrationError, match=match) as info:
        calibrate_kv(model, windows, "fp8", **options)
    assert "--bits 8" in (info.value.hint or "")


def test_unknown_kv_choice_lists_the_choices(stories_windows) -> None:  # noqa: ANN001
    model, windows = stories_windows
    with pytest.raises(CalibrationError, match="must be one of 8, 4, fp8, found 'fp4'"):
        calibrate_kv(model, windows, "fp4")  # type: ignore[arg-type]
