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
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from squeeze.calibrate.fisher import (
    finish_sums,
    new_sums,
    only_targets_require_grad,
    square_and_drop_hooks,
    window_loss,
)
from squeeze.errors import ConfigError
from squeeze.models.expert_params import ExpertWeight
from squeeze.models.modes import eval_mode
from squeeze.models.placement import on_device, to_device

#: ``materialized(*modules)``: a context in which those modules' weights are resident (LazyModel.materialized)
Materializer = Callable[..., contextlib.AbstractContextManager[None]]
#: ``on_group(fisher)``: one group's finished Fisher, ``{name: fp32 tensor}``
GroupSink = Callable[[dict[str, torch.Tensor]], None]
#: ``combine(sums)``: one group's float64 sums of squared gradients, updated in place before they are rounded,
#: called for the groups in the same order on every run (a torchrun world adds its ranks' window shares there)
Combine = Callable[[dict[str, torch.Tensor]], None]
Progress = Callable[[int, int], None]


class _Stop(Exception):
    """Raised by the final norm's pre-hook in the prologue: nothing after the blocks is needed there."""


def _resident(*_modules: nn.Module) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _placed(materialize: Materializer, device: torch.device | None) -> Materializer:
    """``materialize`` followed by a move of the same modules to ``device`` (None: no move)."""
    if device is None:
        return materialize

    @contextlib.contextmanager
    def place(*modules: nn.Module) -> Iterator[None]:
        with materialize(*modules), on_device(device, *modules):
            yield

    return place


def model_parts(
    model: nn.Module, option: str = "--max-memory"
) -> tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module]:
    """``(input embedding, decoder blocks, final norm, LM head)`` of a causal LM; ConfigError if it has
    another shape (or post-processes its logits), which the block-by-block Fisher cannot reproduce. ``option``:
    the command-line option the message names (``--max-memory`` or ``--device``)."""
    arch = type(model).__name__
    get_decoder = getattr(model, "get_decoder", None)
    base = get_decoder() if callable(get_decoder) else None
    blocks = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    get_embed, get_head = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embed = get_embed() if callable(get_embed) else None
    head = get_head() if callable(get_head) else None
    config = getattr(model, "config", None)
    scaled = any(getattr(config, key, None) not in (None, 1, 1.0) for key in ("final_logit_softcapping", "logit_scale"))
    if not isinstance(blocks, nn.ModuleList) or not isinstance(norm, nn.Module) or not isinstance(head, nn.Linear):
        raise ConfigError(
            f"{option} streams decoder blocks of models shaped like Llama (model.layers, model.norm, lm_head); "
            f"{arch} is not",
            hint=f"drop {option} for this model",
        )
    if scaled or not isinstance(embed, nn.Module):
        raise ConfigError(
            f"{option} cannot stream {arch}: its logits are not lm_head(norm(hidden))",
            hint=f"drop {option} for this model",
        )
    return embed, blocks, norm, head


class _Store:
    """Per-window tensors at block boundaries (hidden states, carried gradients), by key: in host memory, or
    spilled to ``directory`` as one fp32 safetensors file each, so one window's worth is resident at a time.
    ``device``: where :meth:`get` / :meth:`take` return them (None: where they were put)."""

    def __init__(self, directory: Path | None, device: torch.device | None = None) -> None:
        self.directory = directory
        self.device = device
        self.memory: dict[str, torch.Tensor] = {}
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, tensor: torch.Tensor) -> None:
        if self.device is not None:  # off the device between steps: its memory holds one block's work
            tensor = tensor.cpu()
        if self.directory is None:
            self.memory[key] = tensor
        else:
            save_file({"t": tensor.contiguous()}, str(self._path(key)))

    def get(self, key: str) -> torch.Tensor:
        tensor = self.memory[key] if self.directory is None else load_file(str(self._path(key)))["t"]
        return to_device(tensor, self.device)

    def take(self, key: str) -> torch.Tensor:
        """The tensor under ``key``, forgotten here (a spilled file is removed)."""
        if self.directory is None:
            return to_device(self.memory.pop(key), self.device)
        tensor = self.get(key)
        self._path(key).unlink()
        return tensor

    def _path(self, key: str) -> Path:
        return Path(self.directory or ".") / f"{key}.safetensors"


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
    Fisher is on the host either way. Raises ConfigError for a model this cannot stream (see :func:`model_parts`).
    """
    host_materialize = materialized or _resident
    materialize = _placed(host_materialize, device)
    embed, blocks, norm, head = model_parts(model)
    n_blocks, n_windows = len(blocks), windows.shape[0]
    owners = _owners(model, modules, embed, blocks, head)
    store = _Store(spill_dir, device)
    done: dict[str, torch.Tensor] = {}
    host_sink = on_group or done.update

    def on_host(part: dict[str, torch.Tensor]) -> None:
        host_sink({name: tensor.cpu() for name, tensor in part.items()})  # cpu(): the same tensor on the host

    sink = _rounding_sink(on_host, combine)
    total = n_blocks + 2
    tied = _tied(embed, head)
    embed_targets = [name for name, owner in owners.items() if owner == "embed"]
    head_targets = [name for name, owner in owners.items() if owner == "head"]
    with torch.inference_mode(False), eval_mode(model), _frozen(model):
        # on the host: the keyword inputs (rotary tables, masks) are the host run's, moved per block below
        kwargs = _prologue(model, windows, embed, blocks, norm, host_materialize, store, bool(embed_targets))
        ids = to_device(windows, device)
        # -- forward, block by block: block i's input per window (h{i}-{w}) kept for its recomputation
        for i, block in enumerate(blocks):
            with materialize(block), torch.no_grad():
                for w in range(n_windows):
                    kw = to_device(kwargs[i][w], device)
                    store.put(f"h{i + 1}-{w}", _block_out(block(store.get(f"h{i}-{w}"), **kw)))
        # -- the head: dL/d(last output) per window (and an untied LM head's own Fisher); with a quantized tied
        # embedding the last outputs stay: the head's share of that weight is recomputed with the embedding's
        with materialize(norm, head):
            head_weights = {n: modules[n] for n in head_targets}
            _head_grads(ids, store, n_blocks, norm, head, head_weights, sink, keep=tied and bool(embed_targets))
        if progress:
            progress(1, total)
        # -- blocks from the end backwards
        for i in range(n_blocks - 1, -1, -1):
            names = [name for name, owner in owners.items() if owner == i]
            need_input = i > 0 or bool(embed_targets)
            with materialize(blocks[i]):
                kw = to_device(kwargs[i], device)
                _block_backward(blocks[i], i, store, kw, {n: modules[n] for n in names}, need_input, sink)
            kwargs[i] = []
            if progress:
                progress(n_blocks - i + 1, total)
        # -- the input embedding (and a tied LM head's share of its weight)
        if embed_targets:
            with materialize(embed, norm, head):
                embed_weights = {n: modules[n] for n in embed_targets}
                _embedding_backward(ids, store, n_blocks, embed, norm, head, tied, embed_weights, sink)
        if progress:
            progress(total, total)
    return done


def _rounding_sink(finished: GroupSink, combine: Combine | None) -> GroupSink:
    """A group's float64 sums -> ``combine`` (when given) -> rounded once to the fp32 Fisher -> ``finished``."""

    def sink(sums: dict[str, torch.Tensor]) -> None:
        if combine is not None:
            combine(sums)
        finished(finish_sums(sums))

    return sink


def _owners(
    model: nn.Module,
    modules: Mapping[str, Any],
    embed: nn.Module,
    blocks: nn.ModuleList,
    head: nn.Module,
) -> dict[str, int | str]:
    """Each target name -> the block index holding it, or "embed" / "head"; ConfigError for one elsewhere."""
    block_of = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
    owners: dict[str, int | str] = {}
    for name, target in modules.items():
        # an expert parameter (squeeze.models.expert_params.ExpertWeight) belongs where its experts module is
        module = target.module if isinstance(target, ExpertWeight) else target
        if module is embed:
            owners[name] = "embed"
        elif module is head:
            owners[name] = "embed" if _tied(embed, head) else "head"
        elif id(module) in block_of:
            owners[name] = block_of[id(module)]
        else:
            raise ConfigError(
                f"--max-memory computes the Fisher block by block, and the target {name} of {type(model).__name__} "
                "is in no decoder block",
                hint="drop --max-memory, or leave that module out of the recipe's targets",
            )
    return owners


def _tied(embed: nn.Module, head: nn.Module) -> bool:
    return getattr(embed, "weight", None) is getattr(head, "weight", None)


@contextlib.contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    """Nothing requires grad but what a step turns on (as fisher_information freezes all but its targets);
    every flag is restored afterwards."""
    with only_targets_require_grad(model, ()):
        yield


def _prologue(
    model: nn.Module,
    windows: torch.Tensor,
    embed: nn.Module,
    blocks: nn.ModuleList,
    norm: nn.Module,
    materialize: Materializer,
    store: _Store,
    check_embedding: bool,
) -> list[list[dict[str, Any]]]:
    """Block 0's input per window into ``store`` (``h0-{w}``); returns each block's keyword inputs per window
    (``kwargs[block][window]``). ``check_embedding``: refuse (ConfigError) a model whose block 0 input is not its
    embedding's output (e.g. scaled), as the embedding's gradient is then taken from the embedding alone."""
    kwargs: list[list[dict[str, Any]]] = [[] for _ in blocks]
    first: list[torch.Tensor] = []

    def stub(index: int) -> Callable[..., torch.Tensor]:
        def forward(*args: Any, **kw: Any) -> torch.Tensor:
            h = args[0] if args else kw.pop("hidden_states")
            if len(args) > 1:
                raise ConfigError(
                    f"--max-memory cannot stream {type(model).__name__}: its blocks take positional inputs",
                    hint="drop --max-memory for this model",
                )
            kwargs[index].append(kw)
            if index == 0:
                first.append(h.detach())
            return h

        return forward

    def stop(_module: nn.Module, _args: Any) -> None:
        raise _Stop

    saved = [block.forward for block in blocks]
    handle = norm.register_forward_pre_hook(stop)
    try:
        for index, block in enumerate(blocks):
            block.forward = stub(index)  # type: ignore[method-assign]
        with materialize(embed), torch.no_grad():
            for w, row in enumerate(windows):
                with contextlib.suppress(_Stop):
                    model(input_ids=row[None], use_cache=False)
                hidden = first.pop()
                if check_embedding and not torch.equal(embed(row[None]), hidden):
                    raise ConfigError(
                        f"--max-memory cannot take {type(model).__name__}'s embedding gradient block by block: its "
                        "first block's input is not the embedding's output",
                        hint="drop --max-memory, or keep the embeddings unquantized (no --embedding-bits)",
                    )
                store.put(f"h0-{w}", hidden)
    finally:
        handle.remove()
        for block, forward in zip(blocks, saved, strict=True):
            block.forward = forward  # type: ignore[method-assign]
    return kwargs


def _block_out(output: Any) -> torch.Tensor:
    """A block's hidden-state output (transformers 5 returns the tensor, older versions a tuple)."""
    return output[0] if isinstance(output, tuple) else output


def _loss(norm: nn.Module, head: nn.Module, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fisher.py's window loss on ``lm_head(norm(hidden))``: the same code computes the same bits."""
    logits_of = lambda **_kw: SimpleNamespace(logits=head(norm(hidden)))  # noqa: E731
    return window_loss(logits_of, ids)  # type: ignore[arg-type]


def _head_grads(
    windows: torch.Tensor,
    store: _Store,
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
    store: _Store,
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
            out = _block_out(block(x, **kw))
            wanted = [x, *weights.values()] if need_input else list(weights.values())
            if wanted:
                out.backward(grad, inputs=wanted)
            if need_input:
                store.put(f"g{index}-{w}", _take_grad(x))
    if weights:
        sink(sums)


def _embedding_backward(
    windows: torch.Tensor,
    store: _Store,
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
