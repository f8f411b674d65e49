"""KV-cache quantization math: golden codes and packing, exact round trips, fitting, the spec's format."""

from __future__ import annotations

import pytest
import torch

from squeeze.errors import ConfigError, FormatError
from squeeze.quant.kv import (
    CLIP_GRID,
    KVSpec,
    LayerKV,
    codebook_scale,
    default_key_group,
    dequantize_codebook,
    fake_quantize_keys,
    fit_value_codebook,
    quantize_codebook,
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
    with pytest.raises(ValueError, match="even head dimension"):
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


def test_codebook_golden_codes_and_ties_go_low() -> None:
    levels = torch.tensor([-1.0, -0.25, 0.0, 0.5])
    x = torch.tensor([[-2.0, -0.625, -0.1, 0.5, 0.6, 1.0]])  # absmax 2: scaled -1, -0.3125, -0.05, 0.25, 0.3, 0.5
    scale = codebook_scale(x)
    assert scale.item() == 2.0
    codes = quantize_codebook(x, scale, levels)
    assert codes.dtype == torch.uint8 and codes.tolist() == [[0, 1, 2, 2, 3, 3]]  # 0.25 is a tie: the lower level
    assert dequantize_codebook(codes, scale, levels).tolist() == [[-2.0, -0.5, 0.0, 0.0, 1.0, 1.0]]
    out = torch.empty(1, 6, dtype=torch.bfloat16)
    dequantize_codebook(codes, scale.bfloat16(), levels, out=out)
    assert out.float().tolist() == [[-2.0, -0.5, 0.0, 0.0, 1.0, 1.0]]


def test_codebook_scale_is_the_fp16_absmax() -> None:
    x = torch.tensor([[0.1, -3.14159, 2.0], [0.0, 0.0, 0.0]])
    scale = codebook_scale(x)
    assert scale[0].item() == torch.tensor(3.14159).half().item()
    assert scale[1].item() > 0  # an all-zero token gets a tiny scale, not a division by zero
    assert torch.equal(dequantize_codebook(quantize_codebook(x[1:], scale[1:], torch.tensor([-1.0, 0.0, 1.0])),
                                           scale[1:], torch.tensor([-1.0, 0.0, 1.0])), x[1:])


@pytest.mark.parametrize("group", [None, 8])
def test_fit_value_codebook_is_the_weighted_kmeans_and_beats_uniform_grids(group: int | None) -> None:
    from sklearn.cluster import KMeans

    gen = torch.Generator().manual_seed(3)
    x = torch.distributions.Laplace(0.0, 1.0).sample((1024, 2, 16)) * torch.rand(1024, 2, 1, generator=gen) * 4
    fit = fit_value_codebook(x, 4, group)
    g = group or 16
    assert fit.levels is not None and fit.levels.shape == (16,) and fit.symmetric and fit.group == g
    assert bool((fit.levels[1:] >= fit.levels[:-1]).all()) and float(fit.levels.abs().max()) <= 1.0
    grouped = x.unflatten(-1, (-1, g))
    scale = codebook_scale(grouped)
    fake = dequantize_codebook(quantize_codebook(grouped, scale, fit.levels), scale, fit.levels)
    assert float((fake - grouped).square().sum()) == pytest.approx(fit.sse, rel=1e-6)
    # differential: sklearn's weighted k-means on the same scaled values and weights lands no lower
    scaled = grouped / scale
    weights = scale.square().expand_as(grouped).reshape(-1).numpy()
    ref = KMeans(16, n_init=3, random_state=0).fit(scaled.reshape(-1, 1).numpy(), sample_weight=weights)
    ones = torch.ones_like(scale)
    ours = float(((scaled - dequantize_codebook(quantize_codebook(scaled, ones, fit.levels), ones, fit.levels))
                  .square() * scale.square()).sum())
    assert ours <= float(ref.inertia_) * 1.01
    # and a codebook beats the best clipped uniform grid on heavy-tailed values (what it is for)
    assert fit.sse < fit_values(x, 4, g).sse


def test_key_grids_of_half_a_head_halve_the_error_of_outlier_tokens() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2048, 2, 64, generator=gen)
    x[:, :, :32] *= torch.rand(2048, 2, 1, generator=gen) * 8  # the first half of each token sometimes far larger
    whole, halves = fit_keys(x, 4), fit_keys(x, 4, group=32)
    assert halves.sse < 0.6 * whole.sse
    err = float((fake_quantize_keys(x, halves.scale, halves.zero, 4, 32) - x).square().sum())
    assert err == pytest.approx(halves.sse, rel=1e-5)


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


def test_codebook_spec_round_trips_and_bad_codebooks_are_format_errors() -> None:
    layer = LayerKV(torch.rand(2, 8) + 0.1, torch.zeros(2, 8), torch.ones(2), True, True, None, 4,
                    torch.linspace(-1, 1, 16))
    spec = KVSpec(4, 4, ("a", "b"), (layer, layer))
    tensors = spec.to_tensors()
    assert sorted(tensors) == sorted(f"{n}.{r}" for n in "ab" for r in ("k_scale", "k_zero", "v_levels"))
    back = KVSpec.from_config(spec.to_config(), tensors)
    assert back.sink_tokens == 4
    for got in back.layers:
        assert got is not None and got.v_levels is not None and torch.equal(got.v_levels, layer.v_levels)
        assert (got.key_group, got.value_group, got.v_symmetric) == (4, 8, True)
    assert back.bytes_per_token(2, 8) == spec.bytes_per_token(2, 8) == 2 * (2 * 2 * 4 + 2 * 2 * 2 + 2 * 2)
    config = spec.to_config()
    with pytest.raises(FormatError, match=r"\.v_levels"):
        KVSpec.from_config(config, {k: v for k, v in tensors.items() if not k.endswith("v_levels")})
    with pytest.raises(FormatError, match="inconsistent shapes"):
        KVSpec.from_config(config, {**tensors, "a.v_levels": torch.zeros(8)})
    with pytest.raises(FormatError, match="ascending"):
        KVSpec.from_config(config, {**tensors, "a.v_levels": torch.linspace(1, -1, 16)})
    with pytest.raises(FormatError, match="ascending"):
        KVSpec.from_config(config, {**tensors, "a.v_levels": torch.full((16,), float("nan"))})
    bad = spec.to_config()
    bad["layers"][0]["v_codebook"] = "yes"  # type: ignore[index]
    with pytest.raises(FormatError, match="true or false"):
        KVSpec.from_config(bad, tensors)
    bad = spec.to_config()
    bad["layers"][1]["k_group"] = 6  # type: ignore[index]
    with pytest.raises(FormatError, match="k_group of b must be an even divisor of 8"):
        KVSpec.from_config(bad, tensors)


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
    # the int4 default: two key grids of 32 channels per head, a value codebook with one scale per head
    default4 = LayerKV(torch.rand(3, 64), torch.zeros(3, 64), torch.ones(3), False, True, None, 32, torch.arange(16.0))
    assert KVSpec(4, 4, names, tuple(default4 for _ in names)).bytes_per_token(3, 64) == 30 * (3 * 64 + 3 * 2 * 2 + 3 * 2)
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
    assert table == {"fp16": 23040, "int8": int8.bytes_per_token(3, 64), "int4": 6300}
    assert table["int4"] / fp16 <= 0.28
    assert default_value_group(4, 64) == 64 and default_value_group(8, 64) == 64
    assert default_key_group(4, 64) == 32 and default_key_group(8, 64) == 64 and default_key_group(4, 8) == 8
