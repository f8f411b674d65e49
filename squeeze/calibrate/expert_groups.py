"""A MoE block's routed experts streamed in groups (``--max-memory`` / ``--device``): the same bits as the block.

A block whose experts module (squeeze.models.expert_params) runs transformers' ``grouped_mm`` implementation is
walked with its attention, router, norms and shared experts resident and only ``size`` routed experts at a time:

* capture: the block runs up to its experts module, which records its inputs (hidden states ``(T, H)``, top-k
  expert ids and routing weights ``(T, k)``) and stops the block;
* group rows: for each group ``[start, stop)`` the experts module's own forward runs on the group's experts only,
  as transformers' expert parallelism runs a rank's local experts (``_is_expert_parallel``: the other experts'
  slots are sentinels that cost nothing and come back zero). Every (token, slot) is fed as its own row (top-1
  layout, ``S = T*k`` rows) and the sort that orders rows by expert is made to order each expert's rows as the
  whole block's sort did, so every expert multiplies the same rows in the same order: each slot's weighted output
  row (and, backwards, its input and routing-weight gradients, and each expert's weight gradient) has the bits
  of the whole-block run;
* replay: the block runs again with its experts module returning ``sum over slots`` of those rows (the very
  reduction transformers does), or, for the gradients, a graph with the whole block's gathers around one node
  whose backward hands over the gradients the groups computed: autograd then adds them into the block input's
  gradient in the order the whole block adds them.

Gradients of the block output are taken per group: one resident backward gives dL/d(experts output) (the other
groups' outputs are constants there), each group backpropagates it through its experts (its Fisher sums float64,
rounded once), and a last resident backward gives the resident targets' Fisher and dL/d(block input).
Fused 3-D expert parameters are sliced per group: views of a resident parameter, or the group's rows read from the
checkpoint (squeeze.models.lazy.LazyModel.experts_slice); nothing copies the whole parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from squeeze.calibrate.block_walk import Combine, Materializer, Store, block_out

# ExpertStreaming, expert_targets and grouped_experts are also re-exported (__all__) for blockwise's imports
from squeeze.calibrate.expert_streaming import (
    ExpertStreaming,
    expert_targets,
    grouped_experts,
    groups_of,
    resident_modules,
    view_slice,
)
from squeeze.calibrate.fisher import finish_sums, new_sums, square_and_drop_hooks
from squeeze.models.placement import on_device, to_device


@contextlib.contextmanager
def _local(experts: nn.Module, count: int) -> Iterator[None]:
    """The module runs as one expert-parallel rank holding ``count`` experts (ids >= count are sentinels)."""
    saved = (getattr(experts, "num_experts"), getattr(experts, "_is_expert_parallel"))  # noqa: B009
    experts.__dict__.update(num_experts=count, _is_expert_parallel=True)
    try:
        yield
    finally:
        experts.__dict__.update(num_experts=saved[0], _is_expert_parallel=saved[1])


class _Stop(Exception):
    """Raised by the experts module in the capture pass: nothing after it is needed there."""


@contextlib.contextmanager
def _patched(experts: nn.Module, forward: Callable[..., torch.Tensor]) -> Iterator[None]:
    experts.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del experts.forward


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = [*args, *kwargs.values()]
    return values[0], values[1], values[2]


class _SortAs(TorchFunctionMode):
    """``torch.sort(ids)`` of the experts forward answered with the order the whole block's sort gave its rows."""

    def __init__(self, ids: torch.Tensor, order: torch.Tensor) -> None:
        super().__init__()
        self.ids, self.order, self.used = ids, order, False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.sort and args and args[0].shape == self.ids.shape and torch.equal(args[0], self.ids):
            self.used = True
            return self.ids[self.order], self.order.clone()
        return func(*args, **kwargs)


def _group_rows(
    experts: nn.Module,
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    perm: torch.Tensor,
    span: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``span``'s weighted output rows ``(S, H)`` for the slots routed to them (other rows zero) and the
    mask of those slots ``(S,)``. ``h (S, H)`` / ``weights (S, 1)``: each slot's hidden state and routing weight;
    ``ids (S,)``: each slot's expert; ``perm``: the whole block's sort of ``ids``. Run inside the group's slicer."""
    start, stop = span
    inside = (ids >= start) & (ids < stop)
    local = torch.where(inside, ids - start, torch.full_like(ids, stop - start))
    ordered = inside[perm]
    order = torch.cat([perm[ordered], perm[~ordered]])
    mode = _SortAs(local[:, None].reshape(-1), order)
    with mode:
        out = type(experts).forward(experts, h, local[:, None], weights)
    if not mode.used:  # pragma: no cover - guarded by grouped_experts (transformers' grouped_mm sorts its rows)
        raise RuntimeError(f"{type(experts).__name__}'s forward did not sort its rows by expert")
    return out, inside


class _Replay(torch.autograd.Function):
    """The experts' weighted rows in sorted order, constant, whose backward returns the groups' gradients."""

    @staticmethod
    def forward(ctx: Any, sel: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor, d_sel: Any, d_sw: Any) -> Any:
        ctx.grads = (d_sel, d_sw)
        return rows.clone()

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> Any:
        d_sel, d_sw = ctx.grads
        return d_sel, d_sw, None, None, None


@dataclass
class _Window:
    """One window's experts inputs (captured) and the whole block's sort of its slots."""

    h: torch.Tensor  # (T, H)
    ids: torch.Tensor  # (T, k) int64
    weights: torch.Tensor  # (T, k)
    perm: torch.Tensor  # (S,)

    @property
    def k(self) -> int:
        return int(self.ids.shape[-1])

    def slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(h (S, H), ids (S,), weights (S, 1))``: one row per (token, slot)."""
        rows = torch.arange(self.ids.numel(), device=self.ids.device) // self.k
        return self.h[rows], self.ids.reshape(-1), self.weights.reshape(-1, 1)

    def total(self, rows: torch.Tensor) -> torch.Tensor:
        """transformers' reduction of the slots' rows ``(S, H)`` to the experts output ``(T, H)``."""
        tokens, hidden = self.h.shape
        return rows.view(tokens, self.k, hidden).sum(dim=1).to(self.h.dtype)


class MoeBlockWalk:
    """One MoE block's passes over its windows with the experts in groups (see the module docstring).

    ``materialize`` makes modules resident (and placed on ``device``); ``inputs(w)`` / ``kwargs[w]``: window ``w``'s
    block input and keyword inputs; ``store`` keeps the per-window tensors (keys ``e{tag}-...``)."""

    def __init__(
        self,
        block: nn.Module,
        experts: nn.Module,
        streaming: ExpertStreaming,
        materialize: Materializer,
        store: Store,
        kwargs: list[dict[str, Any]],
        device: torch.device | None,
        tag: str,
    ) -> None:
        self.block, self.experts, self.store, self.kwargs = block, experts, store, kwargs
        self.materialize, self.device, self.tag = materialize, device, tag
        self.slicer = streaming.slicer or view_slice
        self.groups = groups_of(experts, streaming.size)
        self.resident = resident_modules(block, experts)

    # -- helpers
    def _key(self, what: str, w: int) -> str:
        return f"e{self.tag}{what}-{w}"

    @contextlib.contextmanager
    def _group(self, span: tuple[int, int]) -> Iterator[None]:
        with self.slicer(self.experts, *span), _local(self.experts, span[1] - span[0]):
            with on_device(self.device, self.experts):
                yield

    def _window(self, w: int) -> _Window:
        h, ids, weights = (self.store.get(self._key(k, w)) for k in ("h", "i", "r"))
        return _Window(h, ids, weights, torch.sort(ids.reshape(-1)).indices)

    def _run(self, x: torch.Tensor, w: int, forward: Callable[..., torch.Tensor]) -> torch.Tensor:
        with _patched(self.experts, forward):
            return block_out(self.block(x, **to_device(self.kwargs[w], self.device)))

    # -- passes
    def capture(self, inputs: Callable[[int], torch.Tensor], n_windows: int) -> None:
        """Each window's experts inputs into the store (the block stopped at its experts module)."""

        def stop(*args: Any, **kw: Any) -> torch.Tensor:
            h, ids, weights = _inputs(args, kw)
            self._captured = (h.detach(), ids, weights.detach())
            raise _Stop

        with self.materialize(*self.resident), torch.no_grad():
            for w in range(n_windows):
                with contextlib.suppress(_Stop):
                    self._run(inputs(w), w, stop)
                for key, tensor in zip("hir", self._captured, strict=True):
                    self.store.put(self._key(key, w), tensor)
        del self._captured

    def rows(self, n_windows: int) -> None:
        """Each window's weighted expert rows ``(S, H)``, group by group, into the store (``o``)."""
        with torch.no_grad():
            for g, span in enumerate(self.groups):
                with self._group(span):
                    for w in range(n_windows):
                        win = self._window(w)
                        h, ids, weights = win.slots()
                        out, inside = _group_rows(self.experts, h, ids, weights, win.perm, span)
                        rows = out if g == 0 else torch.where(inside[:, None], out, self.store.get(self._key("o", w)))
                        self.store.put(self._key("o", w), rows)

    def replay(self, x: torch.Tensor, w: int) -> torch.Tensor:
        """The block's output for window ``w`` from its stored expert rows (resident modules materialized);
        window ``w``'s stored tensors are forgotten."""
        win = self._window(w)
        total = win.total(self.store.take(self._key("o", w)))
        for key in "hir":
            self.store.take(self._key(key, w))
        return self._run(x, w, lambda *_a, **_k: total)

    def forward(
        self,
        inputs: Callable[[int], torch.Tensor],
        n_windows: int,
        put: Callable[[int, torch.Tensor], None],
        hooks: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        """The block's output per window (no grad) handed to ``put(w, output)``: capture, the experts' rows group
        by group, then the resident modules once more with ``hooks()`` on (the activation pass's moments)."""
        self.capture(inputs, n_windows)
        self.rows(n_windows)
        with self.materialize(*self.resident), torch.no_grad(), hooks():
            for w in range(n_windows):
                put(w, self.replay(inputs(w), w))

    def output_grads(self, x: torch.Tensor, grad: torch.Tensor, w: int) -> None:
        """dL/d(experts output) of window ``w`` into the store (``d``): the other experts' outputs are constants."""
        win = self._window(w)
        leaf = win.total(self.store.get(self._key("o", w))).detach().requires_grad_(True)
        out = self._run(x.detach(), w, lambda *_a, **_k: leaf)
        torch.autograd.backward(out, grad, inputs=[leaf])
        self.store.put(self._key("d", w), _grad_of(leaf))

    def group_backward(
        self, n_windows: int, targets: Mapping[str, str], combine: Combine | None
    ) -> dict[str, torch.Tensor]:
        """Every group backpropagates dL/d(experts output) through its experts: the slots' input and routing-weight
        gradients into the store (``g``, ``s``); returns the Fisher (fp32, host) of ``targets`` ({target name:
        parameter attribute}), each group's float64 sums combined (``combine``) and rounded once."""
        fisher = {name: torch.empty(tuple(getattr(self.experts, attr).shape)) for name, attr in targets.items()}
        for g, span in enumerate(self.groups):
            with self._group(span):
                params = {name: getattr(self.experts, attr) for name, attr in targets.items()}
                sums = new_sums(params)
                with _requires_grad(params.values()), square_and_drop_hooks(params, sums), torch.enable_grad():
                    for w in range(n_windows):
                        self._group_window(w, g, span, list(params.values()))
                if combine is not None:
                    combine(sums)
                for name, part in finish_sums(sums).items():
                    fisher[name][span[0] : span[1]] = part.cpu()
        return fisher

    def _group_window(self, w: int, g: int, span: tuple[int, int], params: list[torch.Tensor]) -> None:
        win = self._window(w)
        h, ids, weights = win.slots()
        h, weights = h.requires_grad_(True), weights.clone().requires_grad_(True)
        out, inside = _group_rows(self.experts, h, ids, weights, win.perm, span)
        rows = torch.arange(ids.numel(), device=ids.device) // win.k
        upstream = self.store.get(self._key("d", w))[rows]
        torch.autograd.backward(out, upstream, inputs=[h, weights, *params])
        d_h, d_w = _grad_of(h), _grad_of(weights).reshape(-1)
        if g > 0:
            d_h = torch.where(inside[:, None], d_h, self.store.get(self._key("g", w)))
            d_w = torch.where(inside, d_w, self.store.get(self._key("s", w)))
        self.store.put(self._key("g", w), d_h)
        self.store.put(self._key("s", w), d_w)

    def input_backward(self, x: torch.Tensor, grad: torch.Tensor, w: int) -> None:
        """The block's backward for window ``w`` with the groups' gradients replayed at its experts module: the
        resident targets' gradients (their hooks) and ``x.grad``. Forgets window ``w``'s stored tensors."""
        win = self._window(w)
        rows = self.store.take(self._key("o", w))
        d_sel, d_sw = self.store.take(self._key("g", w))[win.perm], self.store.take(self._key("s", w))[win.perm]

        def replayed(*args: Any, **kw: Any) -> torch.Tensor:
            h, _ids, weights = _inputs(args, kw)
            sel = h[win.perm // win.k]  # the whole block's gathers, so autograd adds their gradients as it does
            sw = weights.reshape(-1)[win.perm]
            sorted_rows = _Replay.apply(sel, sw, rows[win.perm], d_sel, d_sw)
            inverse = torch.empty_like(win.perm)
            inverse[win.perm] = torch.arange(win.perm.numel(), device=win.perm.device)
            return win.total(sorted_rows[inverse])

        out = self._run(x, w, replayed)
        wanted = [t for t in (x, *self._resident_grads()) if t.requires_grad]
        if wanted:
            out.backward(grad, inputs=wanted)
        for key in ("h", "i", "r", "d"):
            self.store.take(self._key(key, w))

    def _resident_grads(self) -> list[torch.Tensor]:
        return [p for m in self.resident for p in m.parameters(recurse=False) if p.requires_grad]


@contextlib.contextmanager
def _requires_grad(params: Any) -> Iterator[None]:
    tensors = list(params)
    for p in tensors:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in tensors:
            p.requires_grad_(False)


def _grad_of(x: torch.Tensor) -> torch.Tensor:
    if x.grad is None:  # pragma: no cover - x takes part in the output
        raise RuntimeError("no gradient reached an experts input")
    return x.grad


__all__ = ["MoeBlockWalk", "ExpertStreaming", "expert_targets", "grouped_experts"]
