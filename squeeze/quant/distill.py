"""End-to-end distillation of LUT values and norm gains: the math (EfficientQAT's end-to-end stage, with the
original model's logits as the target, as in PV-tuning's fine-tuning).

The compressed model (each quantized linear a :class:`squeeze.quant.tuning.LevelsLinear`, so its weight is its
row's levels gathered by fixed codes) is trained with Adam to match the original model's next-token
distribution at every position of every window: the loss of a window is the mean over its positions of
``KL(p_original || p_compressed)``. Block-wise tuning matches each block's output in isolation, so it cannot see
how an error in one block is amplified or undone by the blocks after it; the end-to-end loss can. One window a
step in an order drawn from the seed; the held-out windows are scored every ``eval_every`` steps, the best state
kept and the run stopped after ``patience`` scores without improvement.

The loop is resumable: :class:`DistillState` (the parameters, the best ones, Adam's moments and the counters)
is handed to a ``checkpoint`` callback after every score and can be passed back to continue exactly where it
stopped (the window order is a function of the seed and the step, so a resumed run visits the same windows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

#: ``distilled``: the best held-out state beat the start; ``unchanged``: no score did; ``refused``: the loss
#: became non-finite, the start is kept.
Status = Literal["distilled", "unchanged", "refused"]
#: window index -> int64 token ids (1, T)
Windows = Callable[[int], Tensor]
#: token ids (1, T) -> the original model's log-probabilities float32 (1, T, V)
Teacher = Callable[[Tensor], Tensor]
#: token ids (1, T) -> the compressed model's logits (1, T, V), differentiable in its parameters
Student = Callable[[Tensor], Tensor]


class DistillOptions(Protocol):
    """What the loop reads of a recipe's ``weights.distill`` (squeeze.weights_config.DistillConfig has these)."""

    @property
    def steps(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def lr_schedule(self) -> str: ...
    @property
    def eval_every(self) -> int: ...
    @property
    def patience(self) -> int: ...


@dataclass
class DistillState:
    """Where a distillation stands after ``step`` steps: ``params`` the current values, ``best`` those of the
    best held-out score ``best_loss`` (``initial`` and ``initial_loss`` before any step), ``stale`` scores since
    it improved, Adam's first and second moments per parameter (``exp_avg``, ``exp_avg_sq``); ``done``: the
    early stop fired."""

    step: int
    initial_loss: float
    best_loss: float
    stale: int
    initial: list[Tensor]
    params: list[Tensor]
    best: list[Tensor]
    exp_avg: list[Tensor]
    exp_avg_sq: list[Tensor]
    done: bool = False


@dataclass(frozen=True)
class Outcome:
    """A distillation's status, its held-out loss at the start and at the kept state, and the steps run."""

    status: Status
    initial_loss: float
    best_loss: float
    steps: int


def log_probs(logits: Tensor) -> Tensor:
    """float32 log-softmax over the last dimension of ``logits`` (any float dtype, (..., V))."""
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def kl_to_teacher(student_logits: Tensor, teacher_log_probs: Tensor) -> Tensor:
    """Mean over positions of ``KL(p_teacher || p_student)``: ``student_logits`` (1, T, V) any float dtype,
    ``teacher_log_probs`` float32 (1, T, V). A scalar float32 tensor (0 when the two agree)."""
    student = log_probs(student_logits)
    kl = (teacher_log_probs.exp() * (teacher_log_probs - student)).sum(dim=-1)
    return kl.mean()


def window_order(train: Sequence[int], step: int, seed: int) -> int:
    """The training window of step ``step`` (1-based): epochs of ``train`` each shuffled by a generator seeded from
    ``seed`` and the epoch, so any step's window is known without replaying the ones before it."""
    epoch, index = divmod(step - 1, len(train))
    permutation = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return train[int(permutation[index])]


def learning_rate(options: DistillOptions, step: int) -> float:
    """The rate of step ``step`` (1-based): constant, or cosine from ``lr`` at step 1 toward 0 after ``steps``."""
    if options.lr_schedule == "cosine":
        return options.lr * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / options.steps))
    return options.lr


def distill(
    student: Student,
    params: list[nn.Parameter],
    windows: Windows,
    teacher: Teacher,
    train: Sequence[int],
    held: Sequence[int],
    options: DistillOptions,
    seed: int,
    *,
    state: DistillState | None = None,
    checkpoint: Callable[[DistillState], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Outcome:
    """Adam on ``params`` (updated in place) minimising :func:`kl_to_teacher` of ``student(windows(w))``
    against ``teacher(windows(w))`` over the ``train`` windows, early-stopped on the ``held`` ones.

    ``state``: a state a ``checkpoint`` call saved, to continue from (its parameters are copied in). At the end
    ``params`` hold the best state (the start when no score beat it, or when a loss became non-finite).
    ``progress(step, steps)`` after every step."""
    if not train or not held:
        raise ValueError("distillation needs at least one training and one held-out window")
    targets = {w: teacher(windows(w)) for w in held}  # the held-out targets, computed once

    def held_out() -> float:
        with torch.no_grad():
            return sum(float(kl_to_teacher(student(windows(w)), targets[w])) for w in held) / len(held)

    def copy_into(values: list[Tensor]) -> None:
        with torch.no_grad():
            for p, value in zip(params, values, strict=True):
                p.copy_(value)

    optimizer = torch.optim.Adam(params, lr=options.lr)
    if state is None:
        start = held_out()
        initial = [p.detach().clone() for p in params]
        state = DistillState(0, start, start, 0, initial, initial, initial, [], [])
        if not math.isfinite(start):
            return Outcome("refused", start, start, 0)
    else:
        copy_into(state.params)
        _load_moments(optimizer, params, state)
    while not state.done and state.step < options.steps:
        step = state.step + 1
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(options, step)
        ids = windows(window_order(train, step, seed))
        with torch.no_grad():
            target = teacher(ids)
        optimizer.zero_grad(set_to_none=True)
        loss = kl_to_teacher(student(ids), target)
        if not math.isfinite(float(loss.detach())):
            copy_into(state.initial)
            return Outcome("refused", state.initial_loss, float(loss.detach()), step)
        loss.backward()
        optimizer.step()
        state.step = step
        if progress is not None:
            progress(step, options.steps)
        if step % options.eval_every and step != options.steps:
            continue
        score = held_out()
        if not math.isfinite(score):
            copy_into(state.initial)
            return Outcome("refused", state.initial_loss, score, step)
        if score < state.best_loss:
            state.best_loss, state.best, state.stale = score, [p.detach().clone() for p in params], 0
        else:
            state.stale += 1
            state.done = state.stale >= options.patience
        state.params = [p.detach().clone() for p in params]
        state.exp_avg, state.exp_avg_sq = _moments(optimizer, params)
        if checkpoint is not None:
            checkpoint(state)
    copy_into(state.best)
    status: Status = "distilled" if state.best_loss < state.initial_loss else "unchanged"
    return Outcome(status, state.initial_loss, state.best_loss, state.step)


def _moments(optimizer: torch.optim.Adam, params: list[nn.Parameter]) -> tuple[list[Tensor], list[Tensor]]:
    first, second = [], []
    for p in params:
        found = optimizer.state.get(p, {})
        first.append(found["exp_avg"].clone() if "exp_avg" in found else torch.zeros_like(p))
        second.append(found["exp_avg_sq"].clone() if "exp_avg_sq" in found else torch.zeros_like(p))
    return first, second


def _load_moments(optimizer: torch.optim.Adam, params: list[nn.Parameter], state: DistillState) -> None:
    """Adam's moments and step count as they were at ``state`` (Adam's bias correction reads the step)."""
    for p, first, second in zip(params, state.exp_avg, state.exp_avg_sq, strict=True):
        optimizer.state[p] = {
            "step": torch.tensor(float(state.step)),
            "exp_avg": first.to(p.device, p.dtype).clone(),
            "exp_avg_sq": second.to(p.device, p.dtype).clone(),
        }


__all__ = [
    "DistillOptions",
    "DistillState",
    "Outcome",
    "distill",
    "kl_to_teacher",
    "learning_rate",
    "log_probs",
    "window_order",
]
