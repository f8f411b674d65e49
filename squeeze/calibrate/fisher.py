"""Diagonal Fisher information of target linears: SqueezeLLM's per-weight sensitivity.

F[w] = sum over calibration windows of (dL/dw)^2, where L is the mean next-token cross-entropy of a window.
Only the target weights require grad, and each gradient is squared into an accumulator the moment
autograd produces it (a post-accumulate-grad hook), then dropped: at no point does a second full copy of
the target gradients exist next to the accumulators.

The accumulators are float64 (twice the memory of the fp32 result, e.g. 8 bytes per target weight): a
gradient is fp32, so its square is exact in float64, and sums of such squares are exact or nearly so. The
sum therefore barely depends on the order the windows are added in, and the windows can be split across
processes (torchrun, squeeze.compression.distributed) whose float64 partials are combined in rank order
and rounded to fp32 once, at the end (:func:`finish_sums`): the same bits as one process summing them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from squeeze.limits import MIN_SEQ_LEN
from squeeze.models.modes import eval_mode, input_device

Progress = Callable[[int, int], None]


def fisher_information(
    model: nn.Module,
    windows: torch.Tensor,
    modules: Mapping[str, nn.Linear | nn.Embedding],
    *,
    batch_size: int = 1,
    accumulator_device: torch.device | str | None = None,
    progress: Progress | None = None,
) -> dict[str, torch.Tensor]:
    """Diagonal Fisher of each target linear's weight over ``windows`` (int64 ``(n, T)``); an ``nn.Embedding``
    target (its (V, d) table) works alike: F of a tied embedding / LM head sums both uses' gradients.

    Returns ``{name: F}`` with ``F`` fp32, shaped like ``modules[name].weight`` (``(out, in)``), on
    ``accumulator_device`` (default: the weight's device). With ``batch_size == 1`` (the default, as
    SqueezeLLM) ``F = sum_i (dL_i/dW)^2`` over windows ``i``, the per-sample empirical Fisher. With
    ``batch_size > 1`` each term is the square of the gradient of the batch's mean loss: cheaper, but an
    approximation (cross terms between windows are included and the scale shrinks roughly by the batch
    size; only relative values matter downstream).

    The model runs in eval mode (no dropout); its ``training`` flag and every parameter's ``requires_grad``
    are restored when this returns (or raises), and the target weights are left with ``.grad = None`` (a
    stale ``.grad`` is cleared first, or it would be summed into the first window's gradient).
    """
    sums = fisher_sums(
        model, windows, modules, batch_size=batch_size, accumulator_device=accumulator_device, progress=progress
    )
    return finish_sums(sums)


def fisher_sums(
    model: nn.Module,
    windows: torch.Tensor,
    modules: Mapping[str, nn.Linear | nn.Embedding],
    *,
    batch_size: int = 1,
    accumulator_device: torch.device | str | None = None,
    progress: Progress | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`fisher_information` before its final rounding: ``{name: float64 sum of squared gradients}``.

    The partial sums of a share of the windows (one rank's): add the partials of all shares in a fixed
    order (float64), then :func:`finish_sums`.
    """
    _check_contract(model, windows, modules, batch_size)
    weights = {name: mod.weight for name, mod in modules.items()}
    device = input_device(model)
    # Leave any caller's inference_mode/no_grad first: accumulators and inputs made inside inference mode
    # would be inference tensors, which cannot be updated in place or take part in autograd.
    with torch.inference_mode(False), torch.enable_grad():
        fisher = new_sums(weights, accumulator_device)
        if windows.is_inference():
            windows = windows.clone()
        with (
            only_targets_require_grad(model, weights.values()),
            eval_mode(model),
            square_and_drop_hooks(weights, fisher),
        ):
            _run_windows(model, windows, batch_size, device, progress)
    return fisher


#: The accumulators' dtype: fp32 gradients square exactly into it (see the module docstring).
SUM_DTYPE = torch.float64


def new_sums(weights: Mapping[str, torch.Tensor], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Zeroed float64 accumulators shaped like each weight, on ``device`` (default: the weight's device)."""
    return {
        name: torch.zeros(w.shape, dtype=SUM_DTYPE, device=w.device if device is None else device)
        for name, w in weights.items()
    }


#: Elements of a gradient widened to the accumulator's dtype at a time in :func:`add_square` (8 MB of float64).
SQUARE_CHUNK_ELEMENTS = 2**20


def add_square(acc: torch.Tensor, grad: torch.Tensor) -> None:
    """``acc += grad**2`` in ``acc``'s dtype (float64 from :func:`new_sums`: the square of an fp32 gradient is
    exact there), a slice of dim 0 at a time: the float64 copy of the gradient is one slice, not a second
    accumulator (a MoE block's 3-D expert gradient is as large as all its experts). Elementwise, so the same
    bits whatever the slicing."""
    if acc.ndim == 0 or acc.shape != grad.shape:
        g = grad.to(device=acc.device, dtype=acc.dtype)
        acc.addcmul_(g, g)  # without allocating grad**2
        return
    step = max(1, SQUARE_CHUNK_ELEMENTS // max(1, acc[0].numel()))
    for start in range(0, acc.shape[0], step):
        g = grad[start : start + step].to(device=acc.device, dtype=acc.dtype)
        acc[start : start + step].addcmul_(g, g)


def finish_sums(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Fisher in fp32: each float64 sum rounded once. Empties ``sums`` (each float64 tensor is dropped
    as its fp32 copy is made, so the peak is the float64 sums plus one fp32 tensor)."""
    out: dict[str, torch.Tensor] = {}
    for name in list(sums):
        out[name] = sums.pop(name).to(torch.float32)
    return out


def _check_contract(
    model: nn.Module, windows: torch.Tensor, modules: Mapping[str, nn.Linear | nn.Embedding], batch_size: int
) -> None:
    # Contract checks (ValueError: a bug in the caller, reported as an internal error). What users choose
    # (num_samples, seq_len) was checked against squeeze.limits when the calibration spec was read.
    if windows.ndim != 2 or windows.dtype != torch.long:
        raise ValueError(
            f"Fisher windows must be an int64 tensor (n, T), found {windows.dtype} "
            f"{tuple(windows.shape)}; build them with calibration_windows()"
        )
    n, seq_len = windows.shape
    if n < 1 or seq_len < MIN_SEQ_LEN:
        raise ValueError(f"Fisher needs at least one window of >= {MIN_SEQ_LEN} tokens, found shape {(n, seq_len)}")
    if batch_size < 1:
        raise ValueError(f"Fisher batch_size must be >= 1, found {batch_size}")
    if not modules:
        raise ValueError(
            "Fisher needs at least one target linear, found none; pass the result of find_target_linears()"
        )
    own = {id(p) for p in model.parameters()}
    foreign = [name for name, mod in modules.items() if id(mod.weight) not in own]
    if foreign:
        # A weight that is not a parameter of `model` never receives a gradient: F would silently be 0.
        raise ValueError(
            f"target linear(s) {foreign[:3]} are not part of the model passed to fisher_information; "
            "find the targets on the same model instance"
        )


def _run_windows(
    model: nn.Module, windows: torch.Tensor, batch_size: int, device: torch.device, progress: Progress | None
) -> None:
    """Forward + backward over int64 ``windows (n, T)`` in batches; the hooks do the accumulation."""
    n = windows.shape[0]
    done = 0
    for start in range(0, n, batch_size):
        batch = windows[start : start + batch_size].to(device)  # (B, T)
        window_loss(model, batch).backward()
        done += batch.shape[0]
        if progress is not None:
            progress(done, n)


def window_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of int64 ``ids (B, T)`` over the ``B * (T - 1)`` predictions."""
    logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
    # Shift by building labels rather than slicing logits: logits[:, :-1] is non-contiguous for B > 1 and
    # reshaping it would copy the whole (B, T, V) tensor; an ignored last label costs nothing.
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    # Upcast for low-precision models so the log-softmax is computed in fp32 (a no-op for fp32 logits).
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


@contextmanager
def only_targets_require_grad(model: nn.Module, targets: Iterable[torch.Tensor]) -> Iterator[None]:
    """Within the block, only ``targets`` (parameters of ``model``) require grad; every flag is restored after."""
    # Freezing everything else means autograd computes no weight gradient for embeddings, norms, lm_head
    # (a large (V, d) matmul saved per window) or untargeted linears; activations' gradients are still
    # propagated where a target lies below them.
    saved = [(p, p.requires_grad) for p in model.parameters()]
    target_ids = {id(w) for w in targets}
    try:
        for p, _ in saved:
            p.requires_grad_(id(p) in target_ids)
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


@contextmanager
def square_and_drop_hooks(weights: Mapping[str, torch.Tensor], fisher: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, each weight's gradient is squared into ``fisher[name]`` (fp32, its shape) as soon as it
    is accumulated, then dropped: no model-wide gradient is ever held. The hooks are removed after."""
    # One hook per distinct parameter: a weight shared by two target names (tied linears) must feed both
    # accumulators from the same gradient, not have the first hook drop it before the second runs.
    by_param: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for name, w in weights.items():
        by_param.setdefault(id(w), (w, []))[1].append(fisher[name])

    def make_hook(accumulators: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:  # pragma: no cover - autograd calls this hook only after accumulating a grad
                return
            for acc in accumulators:
                add_square(acc, grad)
            # Drop the gradient now, so that its memory is free for the backward of the layers below.
            param.grad = None

        return hook

    handles = []
    try:
        for w, accumulators in by_param.values():
            # A stale .grad would be summed into the first window's gradient before the hook sees it.
            w.grad = None
            handles.append(w.register_post_accumulate_grad_hook(make_hook(accumulators)))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for w, _ in by_param.values():
            w.grad = None


__all__ = [
    "SUM_DTYPE",
    "add_square",
    "finish_sums",
    "fisher_information",
    "fisher_sums",
    "new_sums",
    "window_loss",
    "only_targets_require_grad",
    "square_and_drop_hooks",
]
