"""The diagonal Fisher computed one decoder block at a time, from the end backwards (``--max-memory``).

Same numbers as :func:`squeeze.calibrate.fisher.fisher_information` on the whole model (bit for bit: the same
windows, the same per-window gradients, added in the same order by the same helpers), but only one block's
weights and one block's autograd graph are alive at a time:

1. prologue: each window runs through the model with every decoder block stubbed out (identity), which
   records block 0's input hidden states and the keyword inputs each block gets (rotary cos/sin, attention
   mask, position ids), as accelerate / llm-compressor capture them;
2. forward, block by block (no grad): block i's output for each window is block i+1's input; every block's
   inputs are kept until its backward (in memory, or spilled to ``spill_dir``, one fp32 safetensors file per
   window and block boundary, never pickle), so one window's hidden state is resident at a time;
3. the head (final norm, LM head, loss) gives dL/d(last block's output) per window;
4. for block i = N-1 .. 0: its forward is recomputed from its saved input with grad, and backpropagated
   with the carried dL/d(output); each target weight's gradient is squared into its accumulator (the hooks
   of fisher.py) and dL/d(input) is carried to block i-1;
5. the input embedding's gradient last, when it is a target (with a tied LM head the head's share of the
   same weight's gradient is recomputed in the same backward, so the two are summed before squaring, as
   autograd sums them on the whole model).

Each group's Fisher (one block's targets, or an embedding) is handed to ``on_group`` as soon as its windows are
done, so a caller can commit it and free its accumulators.

``device`` (``--device cuda``): the model stays where it is (host memory, or the meta device of a lazily read
model); each step moves only the modules it runs to the device (squeeze.models.placement) and back, the
block-boundary tensors are kept on the host between steps, the accumulators live on the device and each
group's finished Fisher comes back to the host. The prologue (embedding, rotary tables, masks) runs on the host,
so every block gets the same keyword inputs as a host run. With ``device="cpu"`` nothing moves: the same bits as
no device. Supported: models whose ``get_decoder()`` has
``layers`` (the blocks) and ``norm`` (the final norm), and whose logits are ``lm_head(norm(h))``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from squeeze.calibrate.block_walk import (
    Combine,
    GroupSink,
    Materializer,
    Progress,
    Store,
    block_out,
    is_tied,
    model_parts,
    placed,
    prologue,
    resident,
    target_owners,
)
from squeeze.calibrate.expert_groups import ExpertStreaming, MoeBlockWalk, expert_targets, grouped_experts
from squeeze.calibrate.fisher import (
    finish_sums,
    new_sums,
    only_targets_require_grad,
    square_and_drop_hooks,
    window_loss,
)
from squeeze.models.expert_params import ExpertWeight
from squeeze.models.modes import eval_mode
from squeeze.models.placement import to_device


def blockwise_fisher(
    model: nn.Module,
    windows: torch.Tensor,
    modules: Mapping[str, nn.Linear | nn.Embedding | ExpertWeight],
    *,
    materialized: Materializer | None = None,
    spill_dir: Path | None = None,
    on_group: GroupSink | None = None,
    progress: Progress | None = None,
    combine: Combine | None = None,
    device: torch.device | None = None,
    experts: ExpertStreaming | None = None,
) -> dict[str, torch.Tensor]:
    """The Fisher of ``modules``' weights (an ExpertWeight's: its 3-D parameter) over int64 ``windows (n, T)``,
    block by block (batch 1, as fisher_information's default). ``model`` may live on the meta device:
    ``materialized(*modules)`` makes the given modules' weights resident for a block (LazyModel.materialized);
    by default they already are.

    Returns ``{name: fp32 F}`` (shaped like the weight), or ``{}`` when ``on_group`` takes each group's
    Fisher as it is done. ``spill_dir``: keep the per-window hidden states and carried gradients (T x hidden
    fp32 each; all blocks' inputs are kept until their backward) in files there instead of in memory, each
    removed once read for the last time. ``progress(done, total)`` counts blocks. ``combine``: see
    :data:`Combine`. ``device``: run each step there (see the module docstring); the returned (or sunk)
    Fisher is on the host either way. ``experts``: a MoE block's routed experts streamed that many at a time
    (squeeze.calibrate.expert_groups: the same bits). Raises ConfigError for a model this cannot stream (see
    :func:`model_parts`).
    """
    host_materialize = materialized or resident
    materialize = placed(host_materialize, device)
    embed, blocks, norm, head = model_parts(model)
    n_blocks, n_windows = len(blocks), windows.shape[0]
    owners = target_owners(model, modules, embed, blocks, head)
    store = Store(spill_dir, device)
    done: dict[str, torch.Tensor] = {}
    host_sink = _on_host(on_group or done.update)
    sink = _rounding_sink(host_sink, combine)
    total = n_blocks + 2
    tied = is_tied(embed, head)
    embed_targets = [name for name, owner in owners.items() if owner == "embed"]
    head_targets = [name for name, owner in owners.items() if owner == "head"]
    with torch.inference_mode(False), eval_mode(model), _frozen(model):
        # on the host: the keyword inputs (rotary tables, masks) are the host run's, moved per block below
        kwargs = prologue(model, windows, embed, blocks, norm, host_materialize, store, bool(embed_targets))
        ids = to_device(windows, device)
        _forward_blocks(blocks, kwargs, store, materialize, n_windows, device, experts)
        # -- the head: dL/d(last output) per window (and an untied LM head's own Fisher); with a quantized tied
        # embedding the last outputs stay: the head's share of that weight is recomputed with the embedding's
        with materialize(norm, head):
            head_weights = {n: modules[n] for n in head_targets}
            _head_grads(ids, store, n_blocks, norm, head, head_weights, sink, keep=tied and bool(embed_targets))
        if progress:
            progress(1, total)
        walk = _Walk(store, materialize, device, experts, combine, host_sink)
        _backward_blocks(blocks, kwargs, walk, owners, modules, bool(embed_targets), sink, progress)
        # -- the input embedding (and a tied LM head's share of its weight)
        if embed_targets:
            with materialize(embed, norm, head):
                embed_weights = {n: modules[n] for n in embed_targets}
                _embedding_backward(ids, store, n_blocks, embed, norm, head, tied, embed_weights, sink)
        if progress:
            progress(total, total)
    return done


def _forward_blocks(
    blocks: Any,
    kwargs: list[Any],
    store: Store,
    materialize: Materializer,
    n_windows: int,
    device: torch.device | None,
    experts: ExpertStreaming | None = None,
) -> None:
    """Forward, block by block (no grad): block i's input per window (h{i}-{w}) kept for its recomputation."""
    for i, block in enumerate(blocks):
        grouped = grouped_experts(block, experts)
        if grouped is not None and experts is not None:
            walk = MoeBlockWalk(block, grouped, experts, materialize, store, kwargs[i], device, f"f{i}")
            walk.forward(functools.partial(_get, store, i), n_windows, functools.partial(_put, store, i + 1))
            continue
        with materialize(block), torch.no_grad():
            for w in range(n_windows):
                kw = to_device(kwargs[i][w], device)
                store.put(f"h{i + 1}-{w}", block_out(block(store.get(f"h{i}-{w}"), **kw)))


def _get(store: Store, index: int, w: int) -> torch.Tensor:
    return store.get(f"h{index}-{w}")


def _put(store: Store, index: int, w: int, hidden: torch.Tensor) -> None:
    store.put(f"h{index}-{w}", hidden)


@dataclass(frozen=True)
class _Walk:
    """What the backward walk over the blocks shares: the store, placement, expert streaming, the combine step
    and the sink of already rounded Fisher."""

    store: Store
    materialize: Materializer
    device: torch.device | None
    experts: ExpertStreaming | None
    combine: Combine | None
    host_sink: GroupSink


def _backward_blocks(
    blocks: Any,
    kwargs: list[Any],
    walk: _Walk,
    owners: Mapping[str, int | str],
    modules: Mapping[str, Any],
    has_embed_targets: bool,
    sink: GroupSink,
    progress: Progress | None,
) -> None:
    """The blocks from the end backwards, each block's targets' Fisher handed to ``sink`` (blockwise_fisher)."""
    n_blocks = len(blocks)
    total = n_blocks + 2
    store, materialize, device = walk.store, walk.materialize, walk.device
    for i in range(n_blocks - 1, -1, -1):
        names = [name for name, owner in owners.items() if owner == i]
        need_input = i > 0 or has_embed_targets
        grouped = grouped_experts(blocks[i], walk.experts)
        if grouped is not None:
            targets = {n: modules[n] for n in names}
            _moe_block_backward(blocks[i], grouped, i, kwargs[i], targets, need_input, walk, sink)
        else:
            with materialize(blocks[i]):
                kw = to_device(kwargs[i], device)
                _block_backward(blocks[i], i, store, kw, {n: modules[n] for n in names}, need_input, sink)
        kwargs[i] = []
        if progress:
            progress(n_blocks - i + 1, total)


def _on_host(host_sink: GroupSink) -> GroupSink:
    """``host_sink`` fed each group's rounded Fisher on the host."""

    def on_host(part: dict[str, torch.Tensor]) -> None:
        host_sink({name: tensor.cpu() for name, tensor in part.items()})  # cpu(): the same tensor on the host

    return on_host


def _rounding_sink(finished: GroupSink, combine: Combine | None) -> GroupSink:
    """A group's float64 sums -> ``combine`` (when given) -> rounded once to the fp32 Fisher -> ``finished``."""

    def sink(sums: dict[str, torch.Tensor]) -> None:
        if combine is not None:
            combine(sums)
        finished(finish_sums(sums))

    return sink


@contextlib.contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    """Nothing requires grad but what a step turns on (as fisher_information freezes all but its targets);
    every flag is restored afterwards."""
    with only_targets_require_grad(model, ()):
        yield


def _loss(norm: nn.Module, head: nn.Module, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fisher.py's window loss on ``lm_head(norm(hidden))``: the same code computes the same bits."""
    logits_of = lambda **_kw: SimpleNamespace(logits=head(norm(hidden)))  # noqa: E731
    return window_loss(logits_of, ids)  # type: ignore[arg-type]


def _head_grads(
    windows: torch.Tensor,
    store: Store,
    n_blocks: int,
    norm: nn.Module,
    head: nn.Module,
    targets: Mapping[str, Any],
    sink: GroupSink,
    keep: bool,
) -> None:
    """dL/d(last block's output) per window into ``store`` (``g{n_blocks}-{w}``); an untied LM head's Fisher
    sums (when it is a target) to ``sink``. ``keep``: leave the last outputs in ``store`` (else they are taken)."""
    weights = _weights(targets)
    sums = new_sums(weights)
    with torch.enable_grad(), _requires_grad(weights.values()), square_and_drop_hooks(weights, sums):
        for w, row in enumerate(windows):
            final = store.get(f"h{n_blocks}-{w}") if keep else store.take(f"h{n_blocks}-{w}")
            x = final.detach().requires_grad_(True)
            _loss(norm, head, x, row[None]).backward(inputs=[x, *weights.values()])
            store.put(f"g{n_blocks}-{w}", _take_grad(x))
    if weights:
        sink(sums)


def _block_backward(
    block: nn.Module,
    index: int,
    store: Store,
    kwargs: list[dict[str, Any]],
    targets: Mapping[str, Any],
    need_input: bool,
    sink: GroupSink,
) -> None:
    """Recompute block ``index`` per window from its input (``h{index}-{w}``) with grad, backpropagate the carried
    gradient (``g{index+1}-{w}``); the block's Fisher sums to ``sink``; dL/d(input) into ``g{index}-{w}`` when
    ``need_input``. Both inputs are taken from ``store``."""
    weights = _weights(targets)
    sums = new_sums(weights)
    with torch.enable_grad(), _requires_grad(weights.values()), square_and_drop_hooks(weights, sums):
        for w, kw in enumerate(kwargs):
            x = store.take(f"h{index}-{w}").detach().requires_grad_(need_input)
            grad = store.take(f"g{index + 1}-{w}")
            out = block_out(block(x, **kw))
            wanted = [x, *weights.values()] if need_input else list(weights.values())
            if wanted:
                out.backward(grad, inputs=wanted)
            if need_input:
                store.put(f"g{index}-{w}", _take_grad(x))
    if weights:
        sink(sums)


def _moe_block_backward(
    block: nn.Module,
    experts: nn.Module,
    index: int,
    kwargs: list[dict[str, Any]],
    targets: Mapping[str, Any],
    need_input: bool,
    walk: _Walk,
    sink: GroupSink,
) -> None:
    """:func:`_block_backward` for a MoE block whose routed experts are streamed in groups
    (squeeze.calibrate.expert_groups): the experts' Fisher group by group, then the resident targets' and
    dL/d(input) in one last backward per window. Both inputs are taken from the store."""
    assert walk.experts is not None
    store = walk.store
    moe = MoeBlockWalk(block, experts, walk.experts, walk.materialize, store, kwargs, walk.device, f"b{index}")
    n_windows = len(kwargs)
    moe.capture(lambda w: store.get(f"h{index}-{w}"), n_windows)
    moe.rows(n_windows)
    with walk.materialize(*moe.resident), torch.enable_grad():
        for w in range(n_windows):
            moe.output_grads(store.get(f"h{index}-{w}"), store.get(f"g{index + 1}-{w}"), w)
    routed = expert_targets(experts, targets)
    expert_fisher = moe.group_backward(n_windows, routed, walk.combine)  # also the slots' input gradients
    if expert_fisher:  # combined and rounded group by group
        walk.host_sink(expert_fisher)
    with walk.materialize(*moe.resident):
        weights = _weights({n: t for n, t in targets.items() if n not in routed})
        sums = new_sums(weights)
        with torch.enable_grad(), _requires_grad(weights.values()), square_and_drop_hooks(weights, sums):
            for w in range(n_windows):
                x = store.take(f"h{index}-{w}").detach().requires_grad_(need_input)
                moe.input_backward(x, store.take(f"g{index + 1}-{w}"), w)
                if need_input:
                    store.put(f"g{index}-{w}", _take_grad(x))
    if weights:
        sink(sums)


def _embedding_backward(
    windows: torch.Tensor,
    store: Store,
    n_blocks: int,
    embed: nn.Module,
    norm: nn.Module,
    head: nn.Module,
    tied: bool,
    targets: Mapping[str, Any],
    sink: GroupSink,
) -> None:
    """The input embedding's Fisher: dL/dE from block 0's input gradient (``g0-{w}``) plus, for a tied LM head,
    the head's gradient of the same weight, recomputed from the last block's output (``h{n_blocks}-{w}``)."""
    weights = _weights(targets)
    sums = new_sums(weights)
    with torch.enable_grad(), _requires_grad(weights.values()), square_and_drop_hooks(weights, sums):
        for w, row in enumerate(windows):
            ids = row[None]
            outputs, seeds = [embed(ids)], [store.take(f"g0-{w}")]
            if tied:  # the LM head uses the same weight: one backward sums both gradients, as on the whole model
                outputs.append(_loss(norm, head, store.take(f"h{n_blocks}-{w}"), ids))
                seeds.append(torch.ones((), device=outputs[-1].device))
            torch.autograd.backward(outputs, seeds, inputs=list(weights.values()))
    sink(sums)


def _weights(targets: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Each target's weight as it is now (read inside ``materialize``: the resident parameter, not the meta one)."""
    found: dict[str, torch.Tensor] = {}
    for name, module in targets.items():
        weight = module.weight
        if not isinstance(weight, torch.Tensor):  # pragma: no cover - linears, embeddings, expert parameters
            raise TypeError(f"{name} has no weight tensor")
        found[name] = weight
    return found


@contextlib.contextmanager
def _requires_grad(weights: Any) -> Iterator[None]:
    params = list(weights)
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(False)


def _take_grad(x: torch.Tensor) -> torch.Tensor:
    grad = x.grad
    if grad is None:  # pragma: no cover - x takes part in the loss
        raise RuntimeError("no gradient reached a block's input")
    return grad


__all__ = ["blockwise_fisher", "model_parts"]
