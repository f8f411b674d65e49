"""KV-cache quantization math (squeeze.quant.kv): golden codes and packing, exact round trips, codebooks, fp8."""

from __future__ import annotations

import pytest
import torch

from squeeze.quant.kv import (
    FP8_E4M3_MAX,
    KeyRotation,
    codebook_scale,
    dequantize,
    dequantize_codebook,
    dequantize_fp8,
    fake_quantize_fp8,
    fake_quantize_keys,
    interleave,
    key_channel_params,
    pack_int4,
    quantize,
    quantize_codebook,
    quantize_fp8,
    rope_trig,
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
    assert torch.equal(
        dequantize_codebook(
            quantize_codebook(x[1:], scale[1:], torch.tensor([-1.0, 0.0, 1.0])),
            scale[1:],
            torch.tensor([-1.0, 0.0, 1.0]),
        ),
        x[1:],
    )


def test_fp8_codes_golden_and_saturated_as_vllm_writes_them() -> None:
    scale = torch.tensor(0.5)
    x = torch.tensor([0.0, 2.5, -0.75, 100.0, 300.0, -1e6, float("nan")])
    codes = quantize_fp8(x, scale)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    # e4m3fn bytes: sign, 4 exponent bits (bias 7), 3 mantissa bits; 5.0 = 1.25 * 2**2, 448 = 1.75 * 2**8
    # 200 = 1.5625 * 2**7 lies halfway between 1.5 and 1.625 * 2**7: to even, 1.5 * 2**7 = 192
    assert codes[:6].tolist() == [0x00, 0x4A, 0xBC, 0x74, 0x7E, 0xFE]
    back = dequantize_fp8(codes, scale)
    assert back[:6].tolist() == [0.0, 2.5, -0.75, 96.0, FP8_E4M3_MAX * 0.5, -FP8_E4M3_MAX * 0.5]  # saturated
    assert torch.isnan(back[6])
    assert torch.equal(codes, (x / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp8_relative_error_and_out_dtypes() -> None:
    x = torch.randn(4, 3, 50, 16, generator=torch.Generator().manual_seed(0)) * 5
    scale = x.abs().amax() / FP8_E4M3_MAX
    fake = fake_quantize_fp8(x, scale)
    normal = x.abs() / scale >= 2.0**-6  # e4m3 normal numbers: 3 mantissa bits, error <= 2**-4 relative
    assert bool(((fake - x).abs()[normal] <= x.abs()[normal] * 2.0**-4).all())
    assert float((fake - x).abs().max()) > 0
    codes = quantize_fp8(x.transpose(1, 2), scale)  # strided input
    out = torch.empty(4, 50, 3, 16, dtype=torch.bfloat16)
    dequantize_fp8(codes, scale, out=out)
    assert torch.equal(out, fake.transpose(1, 2).to(torch.bfloat16))  # the float32 product, rounded once


def test_rotating_centre_is_rope_of_the_mean_key_and_batching_free() -> None:
    from transformers.models.llama.modeling_llama import rotate_half

    gen = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))  # (4,)
    mu = torch.randn(3, 8, generator=gen) * 4  # (H, D) pre-RoPE mean key
    rotation = KeyRotation(torch.cat([inv_freq, inv_freq]), mu, rotate_half(mu))
    positions = torch.tensor([0, 1, 5, 511, 4000])
    angle = positions.float()[:, None] * torch.cat([inv_freq, inv_freq])[None]  # (T, D), as transformers builds it
    want = mu[:, None] * angle.cos() + rotate_half(mu)[:, None] * angle.sin()  # RoPE(mu) at every position
    got = rotation.at(positions)
    assert got.shape == (3, 5, 8)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert torch.equal(got[:, 0], mu)  # position 0: no rotation
    # the same bits for a position whether it comes alone or with others
    assert torch.equal(rotation.at(positions[3:4])[:, 0], got[:, 3])
    cos, sin = rope_trig(torch.arange(600), rotation.freq)
    assert torch.equal(cos[511], rope_trig(torch.tensor([511]), rotation.freq)[0][0]) and sin.dtype == torch.float32


def test_fake_quantize_keys_with_rotation_shifts_the_centre() -> None:
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(6, 2, 8, generator=gen)
    rotation = torch.randn(6, 2, 8, generator=gen) * 10
    scale, center = torch.rand(2, 8, generator=gen) + 0.5, torch.randn(2, 8, generator=gen)
    # moving the keys and the centre together moves the result with them (up to fp32 rounding)
    torch.testing.assert_close(
        fake_quantize_keys(keys + rotation, scale, center, 4, 4, rotation),
        fake_quantize_keys(keys, scale, center, 4, 4) + rotation,
        rtol=0,
        atol=1e-4,
    )
