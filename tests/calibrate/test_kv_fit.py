"""KV-cache calibration fits (squeeze.calibrate.kv_fit): the fitted quantizers and the errors they report."""

from __future__ import annotations

import pytest
import torch

from squeeze.calibrate.kv_fit import (
    CLIP_GRID,
    KEY_SCALE_STEPS,
    dynamic_error,
    fit_keys,
    fit_rotation,
    fit_value_codebook,
    fit_values,
    fp8_error,
    fp8_scale,
    refine_key_scale,
)
from squeeze.quant.kv import (
    codebook_scale,
    dequantize,
    dequantize_codebook,
    fake_quantize_keys,
    quantize,
    quantize_codebook,
    token_grid,
)


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
        scale, offset = token_grid(x[:, head : head + 1], bits, clip, fit.symmetric)
        return float(
            (dequantize(quantize(x[:, head : head + 1], scale, offset, bits), scale, offset) - x[:, head : head + 1])
            .square()
            .sum()
        )

    for head in range(3):  # brute force: no clip of the grid does better on any head
        best = min(head_error(c, head) for c in CLIP_GRID)
        assert head_error(float(fit.clip[head]), head) == pytest.approx(best, rel=1e-6)


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
    ours = float(
        (
            (scaled - dequantize_codebook(quantize_codebook(scaled, ones, fit.levels), ones, fit.levels)).square()
            * scale.square()
        ).sum()
    )
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


def test_fp8_scale_is_the_absmax_over_448_golden() -> None:
    x = torch.tensor([[[-3.5, 1.0], [2.0, 0.25]]])  # (N, H, D)
    scale = fp8_scale(x.abs().amax())
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert float(scale) == 3.5 / 448  # 2**-7: exact
    assert fp8_error(x, scale) == 0.0  # x / scale = -448, 128, 256, 32: all e4m3 numbers
    assert torch.equal(fp8_scale(torch.tensor(3.0)), torch.tensor(3.0) / torch.tensor(448.0))  # float32 division
    assert float(fp8_scale(torch.tensor(0.0))) == 1.0  # an all-zero layer: vLLM's default


def test_fp8_error_of_calibrated_scales_beats_scale_one_on_small_values() -> None:
    x = torch.randn(2000, 2, 16, generator=torch.Generator().manual_seed(0)) * 0.002  # e4m3 subnormals at scale 1
    assert fp8_error(x, fp8_scale(x.abs().amax())) < 0.05 * fp8_error(x, 1.0)


def _rope_keys(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(post-RoPE keys (N, 2, 8), positions (N,), inv_freq (4,), the pre-RoPE mean (2, 8)): a large constant
    pre-RoPE component in one slowly rotating pair (channels 3 and 7), as stories260K's keys have."""
    from transformers.models.llama.modeling_llama import rotate_half

    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    mu = torch.zeros(2, 8)
    mu[:, 7] = torch.tensor([-17.0, 12.0])
    pre = mu + torch.randn(n, 2, 8, generator=gen)
    positions = torch.randint(4, 4096, (n,), generator=gen)  # the pair turns by up to 4 rad
    angle = (positions.float()[:, None] * torch.cat([inv_freq, inv_freq]))[:, None, :]  # (N, 1, D)
    return pre * angle.cos() + rotate_half(pre) * angle.sin(), positions, inv_freq, mu


def test_fit_rotation_recovers_the_pre_rope_mean() -> None:
    keys, positions, inv_freq, mu = _rope_keys(4000)
    rotation = fit_rotation(keys, positions, inv_freq)
    torch.testing.assert_close(rotation.cos_amp, mu, rtol=0, atol=0.1)  # noise of std 1 over 4000 samples
    assert torch.equal(rotation.freq, torch.cat([inv_freq, inv_freq]))
    assert torch.equal(rotation.sin_amp, torch.cat([-rotation.cos_amp[:, 4:], rotation.cos_amp[:, :4]], dim=-1))


def test_fit_keys_takes_the_rotating_centre_when_it_cuts_the_error() -> None:
    keys, positions, inv_freq, _ = _rope_keys(4000)
    static = fit_keys(keys, 4, 4)
    rope = {"positions": positions, "rope_freq": inv_freq}
    rotating = fit_keys(keys, 4, 4, **rope)
    assert static.rotation is None and rotating.rotation is not None
    assert rotating.sse < 0.5 * static.sse  # the pair no longer sets its grid
    # what the fit reports is the reference's error with the chosen quantizer
    moving = rotating.rotation.at(positions).transpose(0, 1)
    fake = fake_quantize_keys(keys, rotating.scale, rotating.zero, 4, 4, moving)
    assert float((fake - keys).square().sum()) == pytest.approx(rotating.sse, rel=1e-6)
    # keys without a rotating component get none worth the name (at most the noise of their mean)
    flat = fit_keys(torch.randn(4000, 2, 8, generator=torch.Generator().manual_seed(5)), 4, 4, positions=positions)
    assert flat.rotation is None
    noise = fit_keys(torch.randn(4000, 2, 8, generator=torch.Generator().manual_seed(5)), 4, 4, **rope)
    assert noise.rotation is None or float(noise.rotation.cos_amp.abs().max()) < 0.1


def _score_error(keys, fit, moments, group):  # noqa: ANN001, ANN202
    error = fake_quantize_keys(keys, fit.scale, fit.zero, 4, group) - keys  # (N, H, D)
    return float(torch.einsum("nhd,hde,nhe->", error, moments, error))


def test_refine_key_scale_cuts_the_score_error_the_queries_see() -> None:
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(3000, 2, 8, generator=gen) * torch.tensor([8.0, 1, 1, 1, 4, 1, 0.5, 1])
    # the queries read channels 1 and 5 only: their error is all that reaches the scores
    q = torch.zeros(500, 2, 8)
    q[..., 1], q[..., 5] = torch.randn(500, 2, generator=gen), torch.randn(500, 2, generator=gen)
    moments = torch.einsum("nhd,nhe->hde", q, q) / q.shape[0]  # (H, D, D)
    plain = fit_keys(keys, 4, 4)
    searched = fit_keys(keys, 4, 4, query_moments=moments)
    assert (searched.zero == plain.zero).all() and searched.symmetric == plain.symmetric
    assert not torch.equal(searched.scale, plain.scale)
    assert _score_error(keys, searched, moments, 4) < 0.7 * _score_error(keys, plain, moments, 4)
    # the reported error is still the keys' plain squared error, of the refined quantizer
    fake = fake_quantize_keys(keys, searched.scale, searched.zero, 4, 4)
    assert float((fake - keys).square().sum()) == pytest.approx(searched.sse, rel=1e-6)
    # and never worse than where it started, head by head, for any weighting
    for seed in range(3):
        m = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(seed))
        m = m @ m.transpose(1, 2)
        again = refine_key_scale(keys, plain.scale, plain.zero, 4, 4, m)
        for head in range(2):
            before = fake_quantize_keys(keys, plain.scale, plain.zero, 4, 4)[:, head] - keys[:, head]
            after = fake_quantize_keys(keys, again, plain.zero, 4, 4)[:, head] - keys[:, head]
            assert float(torch.einsum("nd,de,ne->", after, m[head], after)) <= float(
                torch.einsum("nd,de,ne->", before, m[head], before)
            )


def _brute_force_search(keys, scale, center, group, moments):  # noqa: ANN001, ANN202
    """The search as its docstring states it: each channel's factors tried one by one on the whole head's error."""
    scale = scale.clone()

    def errors(trial):  # noqa: ANN001, ANN202
        e = fake_quantize_keys(keys, trial, center, 4, group) - keys
        return torch.einsum("nhd,hde,nhe->h", e, moments, e)

    best = errors(scale)
    for channel in range(scale.shape[-1]):
        base = scale[:, channel].clone()
        for factor in KEY_SCALE_STEPS:
            trial = scale.clone()
            trial[:, channel] = base * factor
            found = errors(trial)
            better = found < best
            scale[better, channel] = trial[better, channel]
            best = torch.where(better, found, best)
    return scale


@pytest.mark.parametrize(("dim", "group"), [(8, 4), (16, 8), (16, None)])
def test_refine_key_scale_equals_the_brute_force_search(dim: int, group: int | None) -> None:
    gen = torch.Generator().manual_seed(dim + (group or 0))
    keys = torch.randn(2000, 2, dim, generator=gen) * torch.rand(dim, generator=gen) * 5
    fit = fit_keys(keys, 4, group)
    m = torch.randn(2, dim, dim, generator=gen)
    moments = m @ m.transpose(1, 2)
    searched = refine_key_scale(keys, fit.scale, fit.zero, 4, group, moments)
    assert torch.equal(searched, _brute_force_search(keys, fit.scale, fit.zero, group, moments))
