"""The activation sensitivity (``weights.sensitivity: activation``): k-means weights from forward passes only.

For a target linear the weight of ``W[r, c]`` is ``E[x_c^2]``, the mean square of input column ``c`` over every
calibration token (the diagonal of the layer's input second moment, the weighting any4 / AWQ-style methods
use): the expected squared output error of row ``r`` from an error ``e`` in ``W[r, c]`` alone is
``e^2 E[x_c^2]``. It needs no backward and no gradient, so it fits models where the Fisher's backward through
the stack is out of reach; the price against the Fisher is measured in docs/benchmarks/quality.md.

The rule for what has no input of its own in a linear's sense (stated here, the one place):
- expert parameters (3-D, squeeze.models.expert_params): uniform (ones). Each expert's inputs are the tokens its
  router dispatches to it, which the fused experts module does not expose to a hook; ones make each
  (expert, row) LUT a plain k-means, as the Fisher does for an expert no token reached.
- quantized embeddings / LM heads (the ``embeddings`` role): uniform (ones). Each row is its own LUT, and a
  per-row weight (e.g. token frequency) is constant across that row, so it could not change its k-means.

The weights come back shaped like the weight (fp32, ``(out, in)``: the column moments repeated on every row)
so every consumer of the Fisher (quantize, the sparse part's choice, the bit budget) takes them unchanged.
The moments are summed per window in float64 and rounded to fp32 once, in window order: the whole-model pass
(:func:`activation_sensitivity`) and the block-by-block one (:func:`blockwise_activation_sensitivity`, for
``--max-memory`` and ``--device``) see the same hidden states and give the same bits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from squeeze.calibrate.block_walk import (
    GroupSink,
    Materializer,
    Progress,
    Store,
    block_out,
    model_parts,
    placed,
    prologue,
    resident,
    target_owners,
)
from squeeze.calibrate.expert_groups import MoeBlockWalk
from squeeze.calibrate.expert_streaming import ExpertStreaming, grouped_experts
from squeeze.models.expert_params import ExpertWeight
from squeeze.models.modes import eval_mode
from squeeze.models.placement import to_device

#: a target of the activation pass: a linear (moments of its input) or an expert parameter (uniform)
Target = nn.Linear | ExpertWeight


class ActivationMoments:
    """Per-column sums of squared inputs (float64) and token counts of some linears, filled by forward
    pre-hooks (:meth:`hooks`) or directly (:meth:`add`)."""

    def __init__(self, linears: Mapping[str, nn.Linear]) -> None:
        self.linears = dict(linears)
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = dict.fromkeys(self.linears, 0)

    def add(self, name: str, x: torch.Tensor) -> None:
        """Add the tokens of ``x (..., in)`` (any float dtype) to ``name``'s sums."""
        rows = x.detach().reshape(-1, x.shape[-1]).double()
        part = (rows * rows).sum(0)  # (in,) float64: one reduction per window, in window order
        self.sums[name] = part if name not in self.sums else self.sums[name] + part
        self.counts[name] += rows.shape[0]

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Within the block, every forward of a linear adds its input; the hooks are removed after."""

        def hook_for(names: list[str]) -> Callable[[nn.Module, tuple[Any, ...]], None]:
            def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
                for name in names:
                    self.add(name, args[0])

            return hook

        by_module: dict[int, tuple[nn.Module, list[str]]] = {}
        for name, module in self.linears.items():  # one hook per module, however many names share it
            by_module.setdefault(id(module), (module, []))[1].append(name)
        handles = [module.register_forward_pre_hook(hook_for(names)) for module, names in by_module.values()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def result(self) -> dict[str, torch.Tensor]:
        """``{name: fp32 (out, in)}``: each column's mean square on every row; a linear that saw no token,
        or whose inputs were all zero, gets ones (plain k-means) rather than weights that are all zero."""
        out: dict[str, torch.Tensor] = {}
        for name, linear in self.linears.items():
            rows, cols = linear.weight.shape
            total = self.sums.get(name)
            if total is None or self.counts[name] == 0 or not bool(total.any()):
                out[name] = torch.ones(rows, cols)
                continue
            moments = (total / self.counts[name]).float().cpu()  # (in,) fp32, rounded once
            out[name] = moments[None, :].expand(rows, cols).contiguous()
        return out


def uniform_weights(modules: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Ones shaped like each module's weight (fp32, host): expert parameters and embeddings (module docstring)."""
    return {name: torch.ones(tuple(module.weight.shape)) for name, module in modules.items()}


def _split(targets: Mapping[str, Target]) -> tuple[dict[str, nn.Linear], dict[str, Any]]:
    linears = {name: t for name, t in targets.items() if isinstance(t, nn.Linear)}
    return linears, {name: t for name, t in targets.items() if name not in linears}


def activation_sensitivity(
    model: nn.Module,
    windows: torch.Tensor,
    targets: Mapping[str, Target],
    embeddings: Mapping[str, Any] | None = None,
    *,
    progress: Progress | None = None,
) -> dict[str, torch.Tensor]:
    """The activation sensitivity of ``targets`` (and ``embeddings``: ones) over int64 ``windows (n, T)``, one
    forward of the whole model per window (batch 1), no gradient. Returns ``{name: fp32}`` shaped like each
    weight (an expert's: its 3-D parameter). ``progress(done, total)`` counts windows."""
    linears, others = _split(targets)
    moments = ActivationMoments(linears)
    device = next(iter(model.parameters())).device
    n = windows.shape[0]
    with torch.no_grad(), eval_mode(model), moments.hooks():
        for w, row in enumerate(windows):
            model(input_ids=row[None].to(device), use_cache=False)
            if progress is not None:
                progress(w + 1, n)
    return {**moments.result(), **uniform_weights(others), **uniform_weights(embeddings or {})}


def blockwise_activation_sensitivity(
    model: nn.Module,
    windows: torch.Tensor,
    targets: Mapping[str, Target],
    embeddings: Mapping[str, Any] | None = None,
    *,
    materialized: Materializer | None = None,
    spill_dir: Path | None = None,
    on_group: GroupSink | None = None,
    progress: Progress | None = None,
    device: torch.device | None = None,
    experts: ExpertStreaming | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`activation_sensitivity` one decoder block at a time, forwards only (the same bits).

    The prologue of squeeze.calibrate.blockwise records block 0's inputs and every block's keyword inputs;
    then block i runs on each window's input (kept in memory, or spilled to ``spill_dir``, one fp32 file per
    window, removed once read: only two block boundaries exist at a time) with its targets' hooks on, and its
    targets' weights are finished. ``materialized`` / ``device``: as blockwise_fisher's. Each block's group
    (and the embeddings', and an untied LM head target's) goes to ``on_group`` as soon as it is done; returns
    everything when ``on_group`` is None, else ``{}``. ``progress(done, total)`` counts blocks. ``experts``: a MoE
    block's routed experts run that many at a time (squeeze.calibrate.expert_groups: the same bits)."""
    host_materialize = materialized or resident
    materialize = placed(host_materialize, device)
    embed, blocks, norm, head = model_parts(model)
    owners = target_owners(model, targets, embed, blocks, head)
    store = Store(spill_dir, device)
    done: dict[str, torch.Tensor] = {}
    sink = on_group or done.update
    n_blocks, n_windows = len(blocks), windows.shape[0]
    if embeddings:
        sink(uniform_weights(embeddings))
    with torch.no_grad(), eval_mode(model):
        kwargs = prologue(model, windows, embed, blocks, norm, host_materialize, store, False)
        for i, block in enumerate(blocks):
            linears, others = _split({name: targets[name] for name, owner in owners.items() if owner == i})
            moments = ActivationMoments(linears)
            grouped = grouped_experts(block, experts)
            if grouped is not None and experts is not None:
                walk = MoeBlockWalk(block, grouped, experts, materialize, store, kwargs[i], device, f"a{i}")
                walk.forward(
                    functools.partial(_input, store, i), n_windows, functools.partial(_output, store, i), moments.hooks
                )
            else:
                with materialize(block), moments.hooks():
                    for w in range(n_windows):
                        kw = to_device(kwargs[i][w], device)
                        store.put(f"h{i + 1}-{w}", block_out(block(store.take(f"h{i}-{w}"), **kw)))
            kwargs[i] = []
            if linears or others:
                sink({**moments.result(), **uniform_weights(others)})
            if progress is not None:
                progress(i + 1, n_blocks + 1)
        _head_moments(targets, owners, store, n_blocks, n_windows, norm, head, materialize, sink)
        if progress is not None:
            progress(n_blocks + 1, n_blocks + 1)
    return done


def _input(store: Store, index: int, w: int) -> torch.Tensor:
    return store.get(f"h{index}-{w}")


def _output(store: Store, index: int, w: int, hidden: torch.Tensor) -> None:
    """Block ``index``'s output for window ``w`` kept; its input, read for the last time, forgotten."""
    store.take(f"h{index}-{w}")
    store.put(f"h{index + 1}-{w}", hidden)


def _head_moments(
    targets: Mapping[str, Target],
    owners: Mapping[str, int | str],
    store: Store,
    n_blocks: int,
    n_windows: int,
    norm: nn.Module,
    head: nn.Module,
    materialize: Materializer,
    sink: GroupSink,
) -> None:
    """An untied LM head that is a target linear: its input is norm(last block's output) per window. Every
    last output is taken from ``store`` either way (a spilled file is removed)."""
    names = [name for name, owner in owners.items() if owner == "head"]
    heads = {name: targets[name] for name in names if isinstance(targets[name], nn.Linear)}
    moments = ActivationMoments(heads)  # type: ignore[arg-type]
    with materialize(norm, head) if heads else contextlib.nullcontext():
        for w in range(n_windows):
            last = store.take(f"h{n_blocks}-{w}")
            if heads:
                normed = norm(last)
                for name in heads:
                    moments.add(name, normed)
    if heads:
        sink(moments.result())


__all__ = [
    "ActivationMoments",
    "activation_sensitivity",
    "blockwise_activation_sensitivity",
    "uniform_weights",
]
