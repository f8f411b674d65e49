"""Input Hessians of target linears, H = sum over calibration tokens of x x^T, for error compensation.

GPTQ-style error compensation (squeeze.quant.ec) needs, per linear, the second moment of its inputs:
``H = sum_t x_t x_t^T`` (in, in), summed over every calibration token ``t``. ``input_hessians`` is a context
manager that accumulates it with forward hooks while something else runs the model (the Fisher pass, so the
calibration windows are run only once).

Linears fed the very same input tensor (q/k/v of one attention block, gate/up of one MLP) share one
accumulator: the first of them seen in a forward pass adds ``x^T x``, the others only point at it. Which
modules share is fixed on the first forward call of each module: it shares when its input is the very tensor
object an earlier module of the same forward received.

Calls with fewer than :data:`MIN_ROWS` token rows (a decode step sees one token per sequence) are buffered
and added together: a rank-8 update reads and writes the whole (in, in) matrix for 8 rows' worth of work,
so without the buffer, sampling text for the Hessians (squeeze.calibrate.generated) spent 70% as long
updating them as running the model. Only the tiles on and above the diagonal of a
:data:`SYMMETRIC_BLOCKS` x :data:`SYMMETRIC_BLOCKS` tiling are accumulated (H is symmetric) and
:meth:`HessianSet.result` mirrors them below it: 10 of 16 tiles, a third less time on SmolLM2's shapes.
Either way the sum is the same up to float32 rounding order.

Memory: one float32 (in, in) matrix per distinct input, on ``device`` (default: the module's). For a Llama
block with hidden size d and MLP size f that is 3 * d**2 + f**2 floats (q/k/v, o, gate/up, down); SmolLM2-135M
(d = 576, f = 1536, 30 blocks) holds 3.4 M floats a block, 402 MB in all, a little less than its Fisher
(424 MB); for Llama shapes the Hessians stay within 1-1.5x the Fisher's bytes. The buffers add fewer than
``MIN_ROWS`` rows per distinct input: under (3 d + f) * MIN_ROWS floats a block, 25 MB for SmolLM2 (6% of
its Hessians; less for wider models, whose Hessians grow with the square of the width).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from squeeze.calibrate.block_walk import Store, block_out, model_parts, prologue, resident
from squeeze.models.modes import eval_mode

#: Token rows an update takes at least (smaller calls are buffered): at 64 rows a (1536, 1536) update runs at
#: the matrix product's full speed on one CPU core, 2.4x the per-row speed of 8-row updates.
MIN_ROWS = 64

#: Tiles per side of the upper-triangle accumulation, for inputs of at least MIN_TILED_WIDTH features (narrower
#: ones are one tile: there a product is too small for the saving to beat the extra calls).
SYMMETRIC_BLOCKS = 4
MIN_TILED_WIDTH = 256


def _tiles(width: int) -> list[slice]:
    count = SYMMETRIC_BLOCKS if width >= MIN_TILED_WIDTH else 1
    return [slice(i * width // count, (i + 1) * width // count) for i in range(count)]


def _add_upper(acc: torch.Tensor, rows: torch.Tensor) -> None:
    """acc (in, in) += rows^T rows (rows (tokens, in)) on the tiles on and above the diagonal only."""
    tiles = _tiles(acc.shape[0])
    for i, a in enumerate(tiles):
        for b in tiles[i:]:
            acc[a, b].addmm_(rows[:, a].T, rows[:, b])  # in place, without an (in, in) temporary


def _mirror_upper(acc: torch.Tensor) -> None:
    """Copy the tiles above the diagonal onto those below it (in place): acc becomes the full symmetric H."""
    tiles = _tiles(acc.shape[0])
    for i, a in enumerate(tiles):
        for b in tiles[i + 1 :]:
            acc[b, a] = acc[a, b].T


class HessianSet:
    """The accumulators: ``hessians[name]`` float32 (in, in) per module (shared tensors for shared inputs)."""

    def __init__(self, modules: Mapping[str, nn.Linear], device: torch.device | str | None = None) -> None:
        self.modules = dict(modules)
        self.device = device
        self.hessians: dict[str, torch.Tensor] = {}
        # leader -> token rows (n, in) not yet added, fewer than MIN_ROWS in all
        self._pending: dict[str, list[torch.Tensor]] = {}
        # per module: the leader whose accumulator it shares (itself for a leader), fixed on its first call
        self._leader: dict[str, str] = {}
        # id(input) -> (weak reference to it, leader): the inputs leaders have seen, while those tensors live
        # (weak: holding them would keep a whole forward's activations alive)
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}

    def hook_for(self, name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            if not args or not isinstance(args[0], torch.Tensor):
                return
            x = args[0]
            leader = self._leader.get(name)
            if leader is None:
                seen = self._seen.get(id(x))
                leader = seen[1] if seen is not None and seen[0]() is x else name
                self._leader[name] = leader
            if leader != name:
                return  # a follower: the leader already added this input
            if len(self._seen) > 64:  # forget inputs that are gone
                self._seen = {key: value for key, value in self._seen.items() if value[0]() is not None}
            self._seen[id(x)] = (weakref.ref(x), name)
            self._accumulate(name, x)

        return hook

    def _accumulate(self, name: str, x: torch.Tensor) -> None:
        with torch.no_grad():
            flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)  # (tokens, in)
            acc = self.hessians.get(name)
            if acc is None:
                device = flat.device if self.device is None else self.device
                acc = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float32, device=device)
                self.hessians[name] = acc
            pending = self._pending.setdefault(name, [])
            # a copy: the model may reuse its activation's storage after this call returns
            pending.append(flat.to(acc.device, copy=True) if flat.shape[0] < MIN_ROWS else flat.to(acc.device))
            if sum(rows.shape[0] for rows in pending) >= MIN_ROWS:
                self._flush(name)

    def _flush(self, name: str) -> None:
        pending = self._pending.pop(name, [])
        if pending:
            rows = pending[0] if len(pending) == 1 else torch.cat(pending)  # (tokens, in)
            _add_upper(self.hessians[name], rows)

    def result(self) -> dict[str, torch.Tensor]:
        """name -> float32 (in, in) Hessian; modules that shared an input share the tensor. A module never
        called gets a zero matrix (every input dead: the compensation then degenerates to plain rounding)."""
        with torch.no_grad():
            for name in list(self._pending):
                self._flush(name)
            for acc in self.hessians.values():
                _mirror_upper(acc)
        out: dict[str, torch.Tensor] = {}
        for name, module in self.modules.items():
            leader = self._leader.get(name, name)
            h = self.hessians.get(leader)
            if h is None:
                n = module.in_features
                h = torch.zeros(n, n, dtype=torch.float32)
            out[name] = h
        return out

    def shared_inputs(self) -> dict[str, str]:
        """module name -> the module whose Hessian it shares (itself when it owns one)."""
        return {name: self._leader.get(name, name) for name in self.modules}


@contextmanager
def input_hessians(
    modules: Mapping[str, nn.Linear], *, device: torch.device | str | None = None
) -> Iterator[HessianSet]:
    """Accumulate the input Hessian of every linear in ``modules`` while the body runs the model.

    Yields a :class:`HessianSet`; read ``.result()`` after the body (the hooks are removed on exit, also when
    the body raises). Tokens of every forward call count, so run only the calibration windows inside.
    """
    hessians = HessianSet(modules, device)
    handles = [module.register_forward_pre_hook(hessians.hook_for(name)) for name, module in modules.items()]
    try:
        yield hessians
    finally:
        for handle in handles:
            handle.remove()


class OutputWeightedHessians:
    """GuidedQuant's per-group Hessians: ``hessians[name]`` float32 (G, in, in), group ``g`` summing
    ``gbar_tg^2 x_t x_t^T`` over tokens ``t``, ``gbar_tg^2`` the mean over the group's output channels
    (squeeze.quant.ec.row_groups of ``out_features``) of the squared loss gradient at the module's output.

    Needs a backward pass: the forward hook hangs a gradient hook on the module's output, which sees the
    output's gradient and the (already saved) input together. No two modules share an accumulator (q/k/v see
    the same input but different output gradients). Memory: 4 * G * in_features**2 bytes per module.
    """

    def __init__(self, modules: Mapping[str, nn.Linear], groups: int, device: torch.device | str | None = None) -> None:
        if groups < 1:
            raise ValueError(f"groups must be >= 1, found {groups}")
        self.modules = dict(modules)
        self.groups = groups
        self.device = device
        self.hessians: dict[str, torch.Tensor] = {}

    def hook_for(self, name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not args or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
                return
            if not output.requires_grad:
                return  # no backward will reach this module (nothing below it requires grad)
            x = args[0].detach()  # autograd keeps it for the weight's gradient anyway: no extra copy

            def on_grad(grad: torch.Tensor) -> None:
                self._accumulate(name, x, grad)

            output.register_hook(on_grad)

        return hook

    def _accumulate(self, name: str, x: torch.Tensor, grad: torch.Tensor) -> None:
        from squeeze.quant.ec import row_groups  # the quantizer's own split: one definition of the groups

        with torch.no_grad():
            flat = x.reshape(-1, x.shape[-1]).to(torch.float32)  # (tokens, in)
            g2 = grad.detach().reshape(-1, grad.shape[-1]).to(torch.float32).square()  # (tokens, out)
            acc = self.hessians.get(name)
            if acc is None:
                device = flat.device if self.device is None else self.device
                n = flat.shape[1]
                acc = torch.zeros(self.groups, n, n, dtype=torch.float32, device=device)
                self.hessians[name] = acc
            for g, rows in enumerate(row_groups(g2.shape[1], self.groups)):
                weight = g2[:, rows].mean(dim=1).sqrt()  # (tokens,): the group's RMS output gradient
                scaled = (flat * weight[:, None]).to(acc.device)  # (tokens, in)
                acc[g].addmm_(scaled.T, scaled)

    def result(self) -> dict[str, torch.Tensor]:
        """name -> float32 (G, in, in); a module no gradient reached gets zeros (every input dead)."""
        out: dict[str, torch.Tensor] = {}
        for name, module in self.modules.items():
            h = self.hessians.get(name)
            if h is None:
                n = module.in_features
                h = torch.zeros(self.groups, n, n, dtype=torch.float32)
            out[name] = h
        return out


@contextmanager
def output_weighted_hessians(
    modules: Mapping[str, nn.Linear], groups: int, *, device: torch.device | str | None = None
) -> Iterator[OutputWeightedHessians]:
    """Accumulate :class:`OutputWeightedHessians` of ``modules`` while the body runs forward AND backward passes
    (the Fisher pass). Hooks are removed on exit, also when the body raises."""
    hessians = OutputWeightedHessians(modules, groups, device)
    handles = [module.register_forward_hook(hessians.hook_for(name)) for name, module in modules.items()]
    try:
        yield hessians
    finally:
        for handle in handles:
            handle.remove()


#: ``on_block(index, hessians)``: quantize block ``index``'s targets in place, given their input Hessians
BlockQuantizer = Callable[[int, dict[str, torch.Tensor]], None]


def sequential_hessians(
    model: nn.Module,
    windows: torch.Tensor,
    targets: Mapping[str, nn.Linear],
    on_block: BlockQuantizer,
    *,
    spill_dir: Path | None = None,
) -> None:
    """GPTQ's sequential order: block i's input Hessians taken from the outputs of blocks 0..i-1 as quantized.

    ``windows`` int64 (n, T). For each decoder block in model order: its input per window (block 0's: what the
    model feeds it) runs through it under :func:`input_hessians` hooks on the block's targets; then
    ``on_block(i, {name: float32 (in, in) H})`` is called, which is to quantize those targets in place (their
    weights replaced by what the artifact will hold); then the block runs again on the same inputs, and its
    outputs, through the quantized weights, are block i+1's inputs. So each layer's compensation sees the
    inputs the quantized model will give it, as GPTQ and llm-compressor do, instead of the original model's.

    Memory: one float32 (T, hidden) state per window (in memory, or in ``spill_dir`` as safetensors files,
    one resident at a time) and one block's Hessians. Cost: two block forwards per window and block, no
    backward. Models shaped like Llama only (``model.layers``, ``model.norm``: ConfigError otherwise); a
    target outside every block is refused (ValueError).
    """
    _embed, blocks, norm, _head = model_parts(model)
    block_of = {id(module): i for i, block in enumerate(blocks) for module in block.modules()}
    outside = [name for name, module in targets.items() if id(module) not in block_of]
    if outside:
        raise ValueError(f"sequential Hessians cover decoder blocks only; {outside[:3]} are outside every block")
    store = Store(spill_dir)
    n_windows = int(windows.shape[0])
    with torch.inference_mode(False), eval_mode(model), torch.no_grad():
        kwargs = prologue(model, windows, _embed, blocks, norm, resident, store, False)
        for i, block in enumerate(blocks):
            mine = {name: module for name, module in targets.items() if block_of[id(module)] == i}
            with input_hessians(mine) as acc:
                for w in range(n_windows):
                    block(store.get(f"h{i}-{w}"), **kwargs[i][w])
            on_block(i, acc.result())
            for w in range(n_windows):  # the quantized block's outputs: the next block's inputs
                store.put(f"h{i + 1}-{w}", block_out(block(store.take(f"h{i}-{w}"), **kwargs[i][w])))
            kwargs[i] = []
        for w in range(n_windows):
            store.take(f"h{len(blocks)}-{w}")


def hessian_bytes_bound(modules: Mapping[str, nn.Module]) -> int:
    """Upper bound of the bytes the Hessians of ``modules`` take: 4 * in_features**2 each, as if no two shared
    an input (for a Llama block the true figure is about 0.77x of this: q/k/v and gate/up share)."""
    return sum(4 * int(getattr(m, "in_features", 0)) ** 2 for m in modules.values())


def dedupe_hessians(hessians: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(distinct tensors by their first name, name -> that first name): to save shared tensors once."""
    owner_of: dict[int, str] = {}
    stored: dict[str, torch.Tensor] = {}
    alias: dict[str, str] = {}
    for name, h in hessians.items():
        owner = owner_of.setdefault(id(h), name)
        if owner == name:
            stored[name] = h
        alias[name] = owner
    return stored, alias


__all__ = [
    "MIN_ROWS",
    "MIN_TILED_WIDTH",
    "SYMMETRIC_BLOCKS",
    "HessianSet",
    "OutputWeightedHessians",
    "input_hessians",
    "output_weighted_hessians",
    "sequential_hessians",
    "BlockQuantizer",
    "dedupe_hessians",
    "hessian_bytes_bound",
]
