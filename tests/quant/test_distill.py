"""squeeze.quant.distill: the KL loss against a reference, the window order and learning rate, a toy student
that learns its teacher, an exact resume from a checkpointed state, and a non-finite loss refused."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

from squeeze.quant.distill import DistillState, distill, kl_to_teacher, learning_rate, log_probs, window_order


@dataclass(frozen=True)
class Options:
    steps: int = 40
    lr: float = 0.05
    lr_schedule: str = "cosine"
    eval_every: int = 5
    patience: int = 3


def test_kl_matches_torch_and_is_zero_for_the_same_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(1, 7, 11, generator=g), torch.randn(1, 7, 11, generator=g)
    expected = nn.functional.kl_div(
        log_probs(student).reshape(7, 11), log_probs(teacher).reshape(7, 11), log_target=True, reduction="batchmean"
    )
    assert torch.allclose(kl_to_teacher(student, log_probs(teacher)), expected, rtol=1e-6, atol=1e-7)
    assert float(kl_to_teacher(teacher, log_probs(teacher))) == pytest.approx(0.0, abs=1e-6)
    assert kl_to_teacher(student.to(torch.bfloat16), log_probs(teacher)).dtype == torch.float32


def test_window_order_visits_every_window_once_an_epoch_and_is_a_function_of_the_step() -> None:
    train = [3, 5, 8, 9, 11]
    first = [window_order(train, step, seed=7) for step in range(1, 6)]
    second = [window_order(train, step, seed=7) for step in range(6, 11)]
    assert sorted(first) == sorted(second) == train
    assert first != second or first != [window_order(train, s, seed=8) for s in range(1, 6)]
    assert [window_order(train, step, seed=7) for step in range(1, 11)] == first + second


def test_cosine_rate_starts_at_lr_and_falls_to_half_midway() -> None:
    options = Options(steps=10, lr=0.2)
    assert learning_rate(options, 1) == pytest.approx(0.2)
    assert learning_rate(options, 6) == pytest.approx(0.1)
    assert learning_rate(options, 10) < 0.01
    assert learning_rate(Options(lr_schedule="constant", lr=0.3), 9) == 0.3


class Toy(nn.Module):
    """Logits = ids' embedding (fixed) through a trainable scale and bias: a student with a few parameters."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.embed = torch.randn(16, 6, generator=g)
        self.scale = nn.Parameter(torch.ones(6))
        self.bias = nn.Parameter(torch.zeros(6))

    def forward(self, ids: Tensor) -> Tensor:
        return self.embed[ids] * self.scale + self.bias


def _setup() -> tuple[Toy, list[nn.Parameter], Tensor, Toy]:
    student, teacher = Toy(), Toy()
    with torch.no_grad():
        teacher.scale.mul_(1.7)
        teacher.bias.add_(torch.linspace(-1, 1, 6))
    ids = torch.randint(0, 16, (10, 1, 12), generator=torch.Generator().manual_seed(2))
    return student, [student.scale, student.bias], ids, teacher


def _run(state: DistillState | None = None, checkpoint=None, options: Options = Options()):
    student, params, ids, teacher = _setup()
    outcome = distill(
        student,
        params,
        windows=lambda w: ids[w],
        teacher=lambda x: log_probs(teacher(x)),
        train=list(range(8)),
        held=[8, 9],
        options=options,
        seed=3,
        state=state,
        checkpoint=checkpoint,
    )
    return outcome, [p.detach().clone() for p in params]


def test_a_toy_student_learns_its_teacher_and_keeps_the_best_held_out_state() -> None:
    outcome, _params = _run()
    assert outcome.status == "distilled"
    assert outcome.best_loss < 0.5 * outcome.initial_loss
    assert outcome.steps == 40


def test_a_resumed_run_ends_bit_for_bit_where_an_uninterrupted_one_does() -> None:
    whole, expected = _run()
    saved: list[DistillState] = []

    class Killed(Exception):
        pass

    def kill_after_second_score(state: DistillState) -> None:
        saved.append(
            DistillState(
                state.step,
                state.initial_loss,
                state.best_loss,
                state.stale,
                [t.clone() for t in state.initial],
                [t.clone() for t in state.params],
                [t.clone() for t in state.best],
                [t.clone() for t in state.exp_avg],
                [t.clone() for t in state.exp_avg_sq],
                state.done,
            )
        )
        if len(saved) == 2:
            raise Killed

    with pytest.raises(Killed):
        _run(checkpoint=kill_after_second_score)
    assert saved[-1].step == 10
    resumed, got = _run(state=saved[-1])
    assert resumed == whole
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_early_stop_ends_the_run_after_patience_scores_without_improvement() -> None:
    # a rate so large the held-out loss never improves on the start: stopped after 3 scores, start kept
    outcome, params = _run(options=Options(steps=400, lr=50.0, lr_schedule="constant"))
    student, start, _ids, _teacher = _setup()
    assert outcome.steps < 400
    if outcome.status == "unchanged":
        for a, b in zip(params, start, strict=True):
            assert torch.equal(a, b.detach())


def test_a_non_finite_loss_restores_the_start_and_is_refused() -> None:
    student, params, ids, teacher = _setup()
    calls = {"n": 0}

    def exploding(x: Tensor) -> Tensor:
        calls["n"] += 1
        out = student(x)
        return out * math.nan if calls["n"] > 6 else out

    outcome = distill(
        exploding,
        params,
        windows=lambda w: ids[w],
        teacher=lambda x: log_probs(teacher(x)),
        train=list(range(8)),
        held=[8, 9],
        options=Options(),
        seed=3,
    )
    assert outcome.status == "refused"
    assert torch.equal(student.scale.detach(), torch.ones(6))
    assert torch.equal(student.bias.detach(), torch.zeros(6))


def test_no_windows_is_a_value_error() -> None:
    student, params, ids, teacher = _setup()
    with pytest.raises(ValueError, match="at least one"):
        distill(student, params, lambda w: ids[w], lambda x: log_probs(teacher(x)), [], [1], Options(), 0)
