"""Block-wise tuning of LUT values and norm gains: the math (OmniQuant / EfficientQAT's block stage).

A quantized decoder block is rebuilt with each tunable linear as :class:`LevelsLinear`: its weight is the
row's levels gathered by the fixed codes, with the exact sparse values in their positions, so the gradient
of a level is the sum of the gradients of the weights that use it and the sparse part never moves. Adam
then trains those levels and the block's norm gains to minimise the mean squared error between the block's
output and a target (the original model's hidden state after this block) over calibration windows, one
window a step; a held-out slice of the windows is scored every few steps, the best state kept, and the
run stops early when that score stops improving. The artifact's format and the runtime never change.

Codes that move (PV-tuning, Malinovskii et al. 2024): with ``code_moves`` > 0, after each step every weight
whose nearest level (to its original value) is no longer the level its code points at is a candidate, and at
most ``code_moves`` of a linear's codes (PV-tuning: <= 1% a step) move to their nearest level, those whose
squared distance falls most first. Without it the codes stay as quantized. ``lr_schedule: cosine`` decays the
learning rate to 0 over the steps (a constant rate kept moving the levels at the end of the short runs).

Everything here is device-agnostic (the block's and the windows' device); the caller
(squeeze.compression.tuning_stage) walks the blocks, keeps the hidden states and commits each block's result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from squeeze.quant.schemes import WeightFormat

#: Steps between two scores of the held-out windows (fewer when the run is shorter).
EVAL_EVERY = 8
#: Held-out scores without improvement after which a block's tuning stops.
PATIENCE = 4
#: The share of a block's windows held out for the early stop (at least one; with one window, that one).
HOLDOUT_SHARE = 8

#: ``tuned``: the best held-out state is kept; ``unchanged``: no step beat the quantized values;
#: ``refused``: the loss diverged (non-finite), the block keeps its quantized values.
Status = Literal["tuned", "unchanged", "refused"]
#: window index -> a tensor of that window (hidden states (1, T, hidden) fp32, or the block's keyword inputs)
Reader = Callable[[int], Any]


class TuningOptions(Protocol):
    """What the loop reads of a recipe's ``weights.tuning`` (squeeze.config.TuningConfig has these)."""

    @property
    def steps(self) -> int: ...
    @property
    def lr(self) -> float: ...

    # read with getattr (older option objects have neither): code_moves (float, 0: codes fixed) and
    # lr_schedule ("constant" or "cosine")


class TuningDivergedWarning(UserWarning):
    """A block's tuning loss became non-finite: the block keeps its quantized (compensated) values."""


class LevelsLinear(nn.Module):
    """A linear whose weight is ``levels`` (R, K) gathered by fixed codes (R, N), the sparse values (fixed)
    replacing theirs: the differentiable form of a tunable format's dequantize."""

    codes: Tensor
    mask: Tensor | None
    sparse_values: Tensor | None
    bias: Tensor | None
    original: Tensor | None

    def __init__(
        self, weight: WeightFormat, bias: Tensor | None, device: torch.device, original: Tensor | None = None
    ) -> None:
        super().__init__()
        if not weight.tunable:
            raise ValueError(f"the {weight.name!r} weight format has no levels to tune")
        lut: Tensor = weight.lut_values()  # type: ignore[attr-defined]  # tunable formats have LUT levels
        self.levels = nn.Parameter(lut.to(device=device, dtype=torch.float32))
        self.register_buffer("codes", weight.codes().to(device=device, dtype=torch.int64))
        sparse = weight.sparse  # type: ignore[attr-defined]
        mask, values = sparse.to_dense_mask_and_values() if sparse is not None else (None, None)
        self.register_buffer("mask", None if mask is None else mask.to(device))
        self.register_buffer("sparse_values", None if values is None else values.to(device, torch.float32))
        self.register_buffer("bias", None if bias is None else bias.detach().to(device, torch.float32).clone())
        # the weight the codes approximate (float32 (R, N)): what a moved code is nearest to; None: codes fixed
        self.register_buffer("original", None if original is None else original.detach().to(device, torch.float32))

    @torch.no_grad()
    def move_codes(self, share: float) -> int:
        """Move at most ``floor(share * R * N)`` codes (at least 1 when any is a candidate) to the level nearest
        their original weight, among the codes not pointing at it already (sparse positions excluded), those
        whose squared distance to their level falls most first. Returns how many moved. ValueError without
        ``original``."""
        if self.original is None:
            raise ValueError("moving codes needs the original weight")
        levels = self.levels.detach()
        distance = (self.original[:, :, None] - levels[:, None, :]).pow(2)  # (R, N, K)
        best = distance.argmin(dim=2)
        gain = distance.gather(2, self.codes[:, :, None]).squeeze(2) - distance.gather(2, best[:, :, None]).squeeze(2)
        if self.mask is not None:
            gain = gain.masked_fill(self.mask, 0.0)
        candidates = int((gain > 0).sum())
        if not candidates:
            return 0
        limit = min(candidates, max(1, int(share * gain.numel())))
        flat = gain.flatten()
        chosen = flat.topk(limit).indices
        codes = self.codes.flatten()
        codes[chosen] = best.flatten()[chosen]
        return limit

    @property
    def weight(self) -> Tensor:
        """float32 (R, N): levels[r, codes[r, c]], the sparse values at their positions."""
        dense = self.levels.gather(1, self.codes)
        if self.mask is not None and self.sparse_values is not None:
            dense = torch.where(self.mask, self.sparse_values, dense)
        return dense

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def norm_gains(block: nn.Module, skip: Mapping[str, nn.Module]) -> dict[str, nn.Parameter]:
    """The norm gains of ``block`` (relative name -> 1-D parameter): the ``weight`` of every module whose class
    is a norm (RMSNorm, LayerNorm, ...), outside the modules in ``skip``."""
    skipped = {id(m) for m in skip.values()}
    found: dict[str, nn.Parameter] = {}
    for name, module in block.named_modules():
        weight = getattr(module, "weight", None)
        is_norm = "norm" in type(module).__name__.lower()
        if is_norm and id(module) not in skipped and isinstance(weight, nn.Parameter) and weight.dim() == 1:
            found[f"{name}.weight" if name else "weight"] = weight
    return found


@dataclass(frozen=True)
class Outcome:
    """One block's tuning: its status, the held-out loss before and at the kept state, the steps run."""

    status: Status
    initial_loss: float
    best_loss: float
    steps: int


def _block_out(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


def _mse(block: nn.Module, x: Tensor, kwargs: dict[str, Any], target: Tensor) -> Tensor:
    out = _block_out(block(x, **kwargs)).to(torch.float32)
    return (out - target.to(torch.float32)).pow(2).mean()


def split_windows(n: int) -> tuple[list[int], list[int]]:
    """(train, held-out) window indices of ``n``: the last n // HOLDOUT_SHARE (at least 1) held out; a single
    window is both."""
    if n < 1:
        raise ValueError("tuning needs at least one window")
    held = max(1, n // HOLDOUT_SHARE)
    if n == 1:
        return [0], [0]
    return list(range(n - held)), list(range(n - held, n))


def tune_block(
    block: nn.Module,
    params: list[nn.Parameter],
    inputs: Reader,
    targets: Reader,
    kwargs: Reader,
    n_windows: int,
    options: TuningOptions,
    seed: int,
    movers: Sequence[LevelsLinear] = (),
) -> Outcome:
    """Adam on ``params`` (the levels of ``block``'s LevelsLinear modules and its norm gains, updated in place)
    minimising the MSE of ``block(inputs(w), **kwargs(w))`` against ``targets(w)`` (float (1, T, hidden)).

    One window a step, in an order drawn from ``seed``; every EVAL_EVERY steps the held-out windows are
    scored and the best state kept; PATIENCE scores without improvement stop the run. At the end ``params``
    hold the best state; a non-finite loss restores the initial values (status ``refused``). ``movers``: the
    LevelsLinear modules whose codes move after each step (``options.code_moves`` > 0; their codes are part of
    the kept state); ``options.lr_schedule`` ``cosine``: the rate decays to 0 over ``options.steps``."""
    train, held = split_windows(n_windows)
    share = float(getattr(options, "code_moves", 0.0))
    movers = list(movers) if share > 0 else []
    state = [*params, *(m.codes for m in movers)]  # what the best state and a restore cover
    initial = [p.detach().clone() for p in state]

    def held_out() -> float:
        with torch.no_grad():
            return sum(float(_mse(block, inputs(w), kwargs(w), targets(w))) for w in held) / len(held)

    def restore(values: list[Tensor]) -> None:
        with torch.no_grad():
            for p, value in zip(state, values, strict=True):
                p.copy_(value)

    start = held_out()
    best, best_state, stale, step = start, initial, 0, 0
    if not _finite(start):
        return Outcome("refused", start, start, 0)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(params, lr=options.lr)
    schedule = None
    if getattr(options, "lr_schedule", "constant") == "cosine":
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=options.steps)
    order: list[int] = []
    every = min(EVAL_EVERY, options.steps)
    for step in range(1, options.steps + 1):
        if not order:
            order = [train[i] for i in torch.randperm(len(train), generator=generator).tolist()]
        w = order.pop()
        optimizer.zero_grad(set_to_none=True)
        loss = _mse(block, inputs(w), kwargs(w), targets(w))
        if not _finite(float(loss.detach())):
            restore(initial)
            return Outcome("refused", start, float(loss.detach()), step)
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        for mover in movers:
            mover.move_codes(share)
        if step % every and step != options.steps:
            continue
        score = held_out()
        if not _finite(score):
            restore(initial)
            return Outcome("refused", start, score, step)
        if score < best:
            best, best_state, stale = score, [p.detach().clone() for p in state], 0
        else:
            stale += 1
            if stale >= PATIENCE:
                break
    restore(best_state)
    return Outcome("tuned" if best < start else "unchanged", start, best, step)


def _finite(value: float) -> bool:
    return value == value and value not in (float("inf"), float("-inf"))


__all__ = [
    "EVAL_EVERY",
    "LevelsLinear",
    "Outcome",
    "PATIENCE",
    "TuningDivergedWarning",
    "TuningOptions",
    "norm_gains",
    "split_windows",
    "tune_block",
]
