"""Walking a causal LM one decoder block at a time, shared by the block-wise passes (Fisher, activation
sensitivity, Hessians, tuning): the model's parts, the prologue that records block 0's inputs and each block's
keyword inputs, the store that keeps block-boundary tensors (in memory or spilled to safetensors), modules
placed on a device while they run, and which group (embedding, block, head) owns each target.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from squeeze.errors import ConfigError
from squeeze.models.expert_params import ExpertWeight
from squeeze.models.families import family_of, model_parts  # noqa: F401 - the block passes' import (the family decides)
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


def resident(*_modules: nn.Module) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def placed(materialize: Materializer, device: torch.device | None) -> Materializer:
    """``materialize`` followed by a move of the same modules to ``device`` (None: no move)."""
    if device is None:
        return materialize

    @contextlib.contextmanager
    def place(*modules: nn.Module) -> Iterator[None]:
        with materialize(*modules), on_device(device, *modules):
            yield

    return place


class Store:
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


def target_owners(
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
            owners[name] = "embed" if is_tied(embed, head) else "head"
        elif id(module) in block_of:
            owners[name] = block_of[id(module)]
        else:
            raise ConfigError(
                f"--max-memory computes the Fisher block by block, and the target {name} of {type(model).__name__} "
                "is in no decoder block",
                hint="drop --max-memory, or leave that module out of the recipe's targets",
            )
    return owners


def is_tied(embed: nn.Module, head: nn.Module) -> bool:
    return getattr(embed, "weight", None) is getattr(head, "weight", None)


def prologue(
    model: nn.Module,
    windows: torch.Tensor,
    embed: nn.Module,
    blocks: nn.ModuleList,
    norm: nn.Module,
    materialize: Materializer,
    store: Store,
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
        # the family's other modules before block 0 (OPT's position embeddings) run with the embedding
        with materialize(embed, *family_of(model).before_blocks(model)), torch.no_grad():
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


def block_out(output: Any) -> torch.Tensor:
    """A block's hidden-state output (transformers 5 returns the tensor, older versions a tuple)."""
    return output[0] if isinstance(output, tuple) else output
