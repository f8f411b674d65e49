"""squeeze.quant.tuning: the differentiable LUT linear, tunable formats' level replacement, the Adam loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from squeeze.config import TuningConfig
from squeeze.quant.schemes.lut import Lut8Weight, LutWeight, quantize_lut
from squeeze.quant.schemes.rtn import rtn_quantize
from squeeze.quant.tuning import LevelsLinear, norm_gains, split_windows, tune_block


def _lut(lut_dtype: str = "float16", sparse: bool = True, seed: int = 0) -> tuple[torch.Tensor, LutWeight]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(12, 40, generator=g)
    q = quantize_lut(weight, None, 3, outlier_fraction=0.05 if sparse else 0.0, lut_dtype=lut_dtype)
    return weight, q


@pytest.mark.parametrize("lut_dtype", ["float16", "int8"])
def test_levels_linear_is_the_formats_dequantize(lut_dtype: str) -> None:
    _w, q = _lut(lut_dtype)
    assert q.sparse is not None and q.sparse.nnz > 0
    bias = torch.randn(12)
    module = LevelsLinear(q, bias, torch.device("cpu"))
    assert torch.equal(module.weight, q.dequantize())
    x = torch.randn(3, 40)
    assert torch.allclose(module(x), nn.functional.linear(x, q.dequantize(), bias))


def test_a_levels_gradient_is_the_sum_of_its_weights_gradients() -> None:
    _w, q = _lut()
    module = LevelsLinear(q, None, torch.device("cpu"))
    x = torch.randn(5, 40)
    upstream = torch.randn(5, 12)
    (module(x) * upstream).sum().backward()
    dense = q.dequantize().requires_grad_(True)
    (nn.functional.linear(x, dense) * upstream).sum().backward()
    mask, _values = q.sparse.to_dense_mask_and_values()  # type: ignore[union-attr]
    codes = q.codes().to(torch.int64)
    grad_w = dense.grad.masked_fill(mask, 0.0)  # type: ignore[union-attr]  # sparse weights never move
    expected = torch.zeros(12, 8).scatter_add_(1, codes, grad_w)
    assert module.levels.grad is not None
    assert torch.allclose(module.levels.grad, expected, atol=1e-5)


def test_an_untunable_format_is_refused() -> None:
    rtn = rtn_quantize(torch.randn(4, 32), 4, None)
    assert not rtn.tunable
    with pytest.raises(ValueError, match="no levels"):
        LevelsLinear(rtn, None, torch.device("cpu"))
    with pytest.raises(NotImplementedError):
        rtn.with_levels(torch.zeros(4, 16))


@pytest.mark.parametrize("lut_dtype", ["float16", "int8"])
def test_with_levels_keeps_the_assignment_sorts_and_keeps_non_finite_levels_out(lut_dtype: str) -> None:
    _w, q = _lut(lut_dtype)
    values = q.lut_values().flip(1).clone()  # descending: the result must re-sort and re-map the codes
    values[0, 3] = float("nan")
    values[1, 0] = 1e6  # past float16's range (an 8-bit LUT: it would blow the row's grid)
    values[2, 5] = float("inf")
    tuned = q.with_levels(values)
    assert type(tuned) is type(q)
    lut = tuned.lut_values()
    assert torch.isfinite(lut).all()
    assert bool((lut[:, 1:] >= lut[:, :-1]).all())  # ascending, as the format documents
    # every weight keeps its slot: the old code -> new code map is a bijection per row
    old, new = q.codes().to(torch.int64), tuned.codes().to(torch.int64)
    for row in range(old.shape[0]):
        pairs = set(zip(old[row].tolist(), new[row].tolist(), strict=True))
        assert len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs})
    # the value each weight reads is the new value of its old slot (rounded as stored), non-finite ones kept
    expected = torch.where(torch.isfinite(values), values, q.lut_values())
    if lut_dtype == "float16":
        expected[1, 0] = q.lut_values()[1, 0]  # 1e6 overflows float16: kept out
        read = tuned.lut_values().gather(1, new)
        assert torch.equal(read, expected.to(torch.float16).float().gather(1, old))
    else:
        assert isinstance(tuned, Lut8Weight)
    # the sparse part never changes
    assert torch.equal(tuned.sparse.vals, q.sparse.vals)  # type: ignore[union-attr]


class _Block(nn.Module):
    """A decoder-block-shaped toy: a norm, a LUT linear and a residual; called as block(x, **kwargs)."""

    def __init__(self, linear: nn.Module, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, elementwise_affine=True, bias=False)
        self.proj = linear

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.proj(self.norm(x))


def _setup(seed: int = 0) -> tuple[_Block, list[nn.Parameter], list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(seed)
    weight = torch.randn(16, 16) * 0.3
    original = _Block(nn.Linear(16, 16, bias=False), 16)
    original.proj.weight.data.copy_(weight)
    block = _Block(LevelsLinear(quantize_lut(weight, None, 2), None, torch.device("cpu")), 16)
    xs = [torch.randn(1, 20, 16) for _ in range(9)]
    with torch.no_grad():
        ys = [original(x) for x in xs]
    params = [block.proj.levels, *norm_gains(block, {"proj": block.proj}).values()]
    return block, params, xs, ys


def _tune(block, params, xs, ys, **options) -> object:
    config = TuningConfig(**{"steps": 40, "lr": 1e-2, **options})
    return tune_block(block, params, xs.__getitem__, ys.__getitem__, lambda w: {}, len(xs), config, seed=3)


def test_tuning_lowers_the_held_out_error_and_is_deterministic() -> None:
    block, params, xs, ys = _setup()
    assert len(params) == 2  # the levels and the norm's gain
    outcome = _tune(block, params, xs, ys)
    assert outcome.status == "tuned" and outcome.best_loss < 0.95 * outcome.initial_loss
    again, params2, _, _ = _setup()
    _tune(again, params2, xs, ys)
    for a, b in zip(params, params2, strict=True):
        assert torch.equal(a, b)


def test_a_diverging_loss_is_refused_and_the_values_restored() -> None:
    block, params, xs, ys = _setup()
    before = [p.detach().clone() for p in params]
    # the targets blow up after the third window read: the loss becomes inf, then NaN
    reads = {"n": 0}

    def targets(w: int) -> torch.Tensor:
        reads["n"] += 1
        return ys[w] * (float("inf") if reads["n"] > 3 else 1.0)

    config = TuningConfig(steps=40, lr=1e-2)
    outcome = tune_block(block, params, xs.__getitem__, targets, lambda w: {}, len(xs), config, seed=0)
    assert outcome.status == "refused"
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)


def test_split_windows() -> None:
    assert split_windows(1) == ([0], [0])
    assert split_windows(9) == (list(range(8)), [8])
    assert split_windows(32) == (list(range(28)), [28, 29, 30, 31])
    with pytest.raises(ValueError):
        split_windows(0)


def test_move_codes_respects_the_share_and_moves_the_largest_gains_to_the_nearest_level() -> None:
    weight, q = _lut(sparse=True)
    module = LevelsLinear(q, None, torch.device("cpu"), original=weight)
    with torch.no_grad():  # levels moved as a step would: many codes are no longer nearest
        module.levels.add_(0.4 * torch.randn(module.levels.shape, generator=torch.Generator().manual_seed(5)))
    before = module.codes.clone()
    levels = module.levels.detach()
    distance = (weight[:, :, None] - levels[:, None, :]).pow(2)
    nearest = distance.argmin(dim=2)
    gain = distance.gather(2, before[:, :, None]).squeeze(2) - distance.gather(2, nearest[:, :, None]).squeeze(2)
    mask = q.sparse.to_dense_mask_and_values()[0]  # type: ignore[union-attr]
    gain = gain.masked_fill(mask, 0.0)
    candidates = int((gain > 0).sum())
    share = 0.02
    cap = int(share * weight.numel())  # 9 of 480
    assert candidates > cap
    moved = module.move_codes(share)
    changed = module.codes != before
    assert moved == int(changed.sum()) == cap
    assert torch.equal(module.codes[changed], nearest[changed])  # each moved code went to its nearest level
    assert not bool((changed & mask).any())  # sparse positions never move
    assert float(gain[changed].min()) >= float(gain[~changed].max())  # the largest gains first
    # a share above what is left moves every remaining candidate, then nothing moves any more
    assert module.move_codes(1.0) == candidates - cap
    assert module.move_codes(1.0) == 0
    assert torch.equal(module.codes.masked_fill(mask, 0), nearest.masked_fill(mask, 0))


def test_moving_codes_needs_the_original_weight() -> None:
    _w, q = _lut()
    with pytest.raises(ValueError, match="original weight"):
        LevelsLinear(q, None, torch.device("cpu")).move_codes(0.01)


def _setup_movable(seed: int = 0) -> tuple[_Block, list[nn.Parameter], list[torch.Tensor], list[torch.Tensor]]:
    block, params, xs, ys = _setup(seed)
    torch.manual_seed(seed)
    weight = torch.randn(16, 16) * 0.3  # _setup's weight (same seed, first draw)
    proj = block.proj
    movable = LevelsLinear(quantize_lut(weight, None, 2), None, torch.device("cpu"), original=weight)
    block.proj = movable
    params = [movable.levels, *norm_gains(block, {"proj": movable}).values()]
    assert torch.equal(movable.codes, proj.codes)
    return block, params, xs, ys


def test_tuning_with_code_moves_moves_codes_keeps_the_best_state_and_beats_fixed_codes() -> None:
    fixed, fixed_params, xs, ys = _setup_movable()
    codes = fixed.proj.codes.clone()
    fixed_out = _tune(fixed, fixed_params, xs, ys, lr_schedule="cosine")
    assert torch.equal(fixed.proj.codes, codes)  # code_moves 0: the codes never move
    block, params, _, _ = _setup_movable()
    config = TuningConfig(steps=40, lr=1e-2, code_moves=0.01, lr_schedule="cosine")
    outcome = tune_block(
        block, params, xs.__getitem__, ys.__getitem__, lambda w: {}, len(xs), config, seed=3, movers=[block.proj]
    )
    assert outcome.status == "tuned" and outcome.best_loss < outcome.initial_loss
    assert not torch.equal(block.proj.codes, codes)  # codes moved and the kept state has them
    # the kept state is the best scored one: re-scoring the held-out window gives best_loss
    with torch.no_grad():
        held = float((block(xs[8]) - ys[8]).pow(2).mean())
    assert held == pytest.approx(outcome.best_loss, rel=1e-5)
    assert outcome.best_loss <= fixed_out.best_loss * 1.05  # type: ignore[attr-defined]
