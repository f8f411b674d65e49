"""KV-cache quantization math: golden codes and packing, exact round trips, fitting, the spec's format."""

from __future__ import annotations

import pytest
import torch

from squeeze.errors import ConfigError, FormatError
from squeeze.quant.kv import (
    CLIP_GRID,
    KVSpec,
    LayerKV,
    fake_quantize_keys,
    key_channel_params,
    check_kv_bits,
    dequantize,
    dynamic_error,
    fit_keys,
    fit_values,
    fp_bytes_per_token,
    layer_bytes_per_token,
    default_value_group,
    interleave,
    kv_bytes_table,
    pack_int4,
    quantize,
    token_grid,
    unpack_int4,
)


def test_pack_int4_golden_bytes() -> None:
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]  # even channel in the low nibble
    assert torch.equal(interleave(*unpack_int4(packed, signed=False)), codes)


def test_pack_int4_signed_codes_are_twos_complement_nibbles() -> None:
    codes = torch.tensor([[-7, 7, -1, 0, 3, -8]], dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x79, 0x0F, 0x83]]
    even, odd = unpack_int4(packed, signed=True)
    assert even.dtype == torch.int8 and torch.equal(interleave(even, odd), codes)


def test_pack_int4_round_trip_random_and_odd_width_rejected() -> None:
    codes = torch.randint(0, 16, (2, 3, 5, 64), dtype=torch.uint8)
    assert torch.equal(interleave(*unpack_int4(pack_int4(codes), signed=False)), codes)
    signed = torch.randint(-7, 8, (2, 3, 5, 64), dtype=torch.int8)
    assert torch.equal(interleave(*unpack_int4(pack_int4(signed), signed=True)), signed)
    with pytest.raises(ConfigError, match="even head dimension"):
        pack_int4(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_token_grid_golden(bits: int) -> None:
    x = torch.tensor([[-2.0, -1.0, 0.0, 0.5, 2.0]])
    scale, offset = token_grid(x, bits, 1.0, symmetric=True)
    qmax = (1 << (bits - 1)) - 1
    assert offset is None
    assert scale.item() == pytest.approx(2.0 / qmax, rel=1e-3)  # fp16-rounded absmax / qmax
    codes = quantize(x, scale, offset, bits)
    assert codes.dtype == torch.int8
    assert codes[0, 0].item() == -qmax and codes[0, -1].item() == qmax and codes[0, 2].item() == 0
    # extremes come back exactly up to the fp16 rounding of the scale; zero is exact
    assert torch.allclose(dequantize(codes, scale, offset)[0, [0, 2, 4]], torch.tensor([-2.0, 0.0, 2.0]), rtol=1e-3)


def test_asymmetric_token_grid_golden() -> None:
    x = torch.tensor([[1.0, 2.0, 4.0]])
    scale, offset = token_grid(x, 8, 1.0, symmetric=False)
    assert offset is not None and offset.item() == 1.0 and scale.item() == pytest.approx(3 / 255, rel=1e-3)
    codes = quantize(x, scale, offset, 8)
    assert codes.dtype == torch.uint8 and codes.tolist() == [[0, 85, 255]]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_token_grid_error_is_at_most_half_a_step(bits: int, symmetric: bool) -> None:
    x = torch.randn(7, 3, 64) * torch.rand(7, 3, 1) * 5 + (0 if symmetric else 1.5)
    scale, offset = token_grid(x, bits, 1.0, symmetric)
    codes = quantize(x, scale, offset, bits)
    err = (dequantize(codes, scale, offset) - x).abs()
    assert bool((err <= scale / 2 * 1.002 + 1e-3 * x.abs().amax(-1, keepdim=True)).all())


def test_key_channel_params_golden() -> None:
    lo, hi = torch.tensor([[-1.0, 0.0]]), torch.tensor([[3.0, 2.0]])
    scale, center = key_channel_params(lo, hi, symmetric=True)
    assert scale.tolist() == [[3.0, 2.0]] and center.tolist() == [[0.0, 0.0]]
    scale, center = key_channel_params(lo, hi, symmetric=False)
    assert scale.tolist() == [[2.0, 1.0]] and center.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("bits", [4, 8])
def test_fit_keys_normalises_outlier_channels(bits: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 2, 64, generator=gen)
    x[:, :, 3] *= 40  # an outlier channel, as keys have (KVQuant)
    x[:, :, 10] += 15  # a channel with an offset: centring pays off
    fit = fit_keys(x, bits)
    assert fit.scale.shape == (2, 64) and fit.zero.shape == (2, 64)
    assert not fit.symmetric
    assert fit.sse < 0.5 * dynamic_error(x, bits)
    # the reported error is the error of the returned normaliser
    err = float((fake_quantize_keys(x, fit.scale, fit.zero, bits) - x).square().sum())
    assert err == pytest.approx(fit.sse, rel=1e-5)


def test_keys_beyond_the_calibrated_range_are_not_clamped() -> None:
    x = torch.randn(512, 1, 8)
    fit = fit_keys(x, 8)
    far = torch.randn(4, 1, 8) * 10  # 10x the calibrated range, as other text can produce
    err = (fake_quantize_keys(far, fit.scale, fit.zero, 8) - far).abs().max()
    assert float(err) < 0.05 * float(far.abs().max())


@pytest.mark.parametrize("bits", [4, 8])
def test_fit_values_picks_the_best_clip_per_head(bits: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 3, 16, generator=gen) * torch.tensor([1.0, 3.0, 0.2])[None, :, None]
    x[::7, 1, 0] *= 6  # occasional outliers in head 1
    fit = fit_values(x, bits, group=16)
    assert fit.clip.shape == (3,) and fit.group == 16
    assert all(min(abs(c - g) for g in CLIP_GRID) < 1e-6 for c in fit.clip.tolist())

    def head_error(clip: float, head: int) -> float:
        scale, offset = token_grid(x[:, head:head + 1], bits, clip, fit.symmetric)
        return float((dequantize(quantize(x[:, head:head + 1], scale, offset, bits), scale, offset)
                      - x[:, head:head + 1]).square().sum())

    for head in range(3):  # brute force: no clip of the grid does better on any head
        best = min(head_error(c, head) for c in CLIP_GRID)
        assert head_error(float(fit.clip[head]), head) == pytest.approx(best, rel=1e-6)


def test_check_kv_bits() -> None:
    assert check_kv_bits(8) == 8
    for bad in (2, 3, 16, True, "8", None):
        with pytest.raises(ConfigError, match="must be 4 or 8"):
            check_kv_bits(bad)


def _spec(v_symmetric: bool = True, v_group: int | None = None) -> KVSpec:
    layer = LayerKV(torch.rand(2, 8) + 0.1, torch.full((2, 8), 8.0), torch.tensor([0.9, 1.0]), False, v_symmetric,
                    v_group)
    return KVSpec(4, 1, ("model.layers.0.self_attn", "model.layers.1.self_attn"), (layer, layer))


def test_spec_round_trips_through_config_and_tensors() -> None:
    spec = _spec(v_symmetric=False, v_group=4)
    tensors = spec.to_tensors()
    assert sorted(tensors) == sorted(f"model.layers.{i}.self_attn.{r}" for i in (0, 1) for r in ("k_scale", "k_zero", "v_clip"))
    back = KVSpec.from_config(spec.to_config(), tensors)
    assert back.bits == 4 and back.sink_tokens == 1 and back.names == spec.names
    for a, b in zip(back.layers, spec.layers):
        assert a is not None and b is not None
        assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_clip, b.v_clip)
        assert (a.k_symmetric, a.v_symmetric, a.value_group) == (b.k_symmetric, b.v_symmetric, 4)


def test_spec_from_bad_config_is_a_format_error() -> None:
    spec = _spec()
    tensors = spec.to_tensors()
    with pytest.raises(FormatError, match="bits must be 4 or 8"):
        KVSpec.from_config({**spec.to_config(), "bits": 3}, tensors)
    with pytest.raises(FormatError, match="are missing"):
        KVSpec.from_config(spec.to_config(), {k: v for k, v in tensors.items() if not k.endswith("v_clip")})
    tensors["model.layers.1.self_attn.k_zero"] = torch.zeros(3, 8)
    with pytest.raises(FormatError, match="inconsistent shapes"):
        KVSpec.from_config(spec.to_config(), tensors)
    with pytest.raises(FormatError):
        KVSpec.from_config([], {})
    bad_group = spec.to_config()
    bad_group["layers"][0]["v_group"] = 3  # type: ignore[index]
    with pytest.raises(FormatError, match="even divisor"):
        KVSpec.from_config(bad_group, spec.to_tensors())


def test_bytes_per_token_smollm2_geometry_meets_the_ratios() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 channels
    fp16 = fp_bytes_per_token(30, 3, 64)
    assert fp16 == 23040
    names = tuple(str(i) for i in range(30))
    layer = LayerKV(torch.rand(3, 64), torch.zeros(3, 64), torch.ones(3), False, True)
    int8 = KVSpec(8, 1, names, tuple(layer for _ in names))
    assert int8.bytes_per_token(3, 64) == 30 * (2 * 3 * 64 + 2 * 3 * 2)  # codes + key and value scales
    assert int8.bytes_per_token(3, 64) / fp16 <= 0.52
    grouped = LayerKV(torch.rand(3, 64), torch.zeros(3, 64), torch.ones(3), False, True, 32)
    int4 = KVSpec(4, 1, names, tuple(grouped for _ in names))
    assert int4.bytes_per_token(3, 64) == 30 * (2 * 3 * 32 + 3 * 2 + 2 * 3 * 2)  # two value grids per head
    assert int4.bytes_per_token(3, 64) / fp16 <= 0.28
    assert layer_bytes_per_token(3, 64, 4, asymmetric_values=True) == 2 * 3 * 32 + 3 * 2 + 3 * 2 * 2
    assert KVSpec.dynamic(4, names).bytes_per_token(3, 64) == 30 * (2 * 3 * 32 + 3 * 2 * 2)
    table = kv_bytes_table({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                            "hidden_size": 576})
    per_head = KVSpec(4, 1, names, tuple(layer for _ in names))
    assert table == {"fp16": 23040, "int8": int8.bytes_per_token(3, 64), "int4": per_head.bytes_per_token(3, 64)}
    assert default_value_group(4, 64) == 64 and default_value_group(8, 64) == 64
