"""Where a block's tensors live while it works: moving modules and keyword inputs to a compute device and back.

``squeeze compress --device cuda`` keeps the model on the host (or on the meta device, read lazily) and moves
one decoder block at a time to the GPU for its forward, its Fisher backward and its quantization. Moving is
done by swapping each parameter's (and buffer's) ``.data``, as ``nn.Module.to`` does: the Parameter objects stay
the same, so hooks, ``requires_grad`` flags and the names that refer to them still hold; on exit the host data
is put back as it was (no copy back: the weights are only read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def on_device(device: torch.device | None, *modules: nn.Module) -> Iterator[None]:
    """``modules``' parameters and buffers on ``device`` for the block, their own data back afterwards.

    ``device`` None (or the device a tensor is already on) moves nothing: the very same tensors are used, so a
    run with ``device="cpu"`` computes what a run without a device computes, bit for bit. A tensor shared by two
    modules (tied weights) is moved once. Meta tensors (a lazily read model's unread weights) stay as they are.
    """
    if device is None:
        yield
        return
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    try:
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                if id(tensor) in seen or tensor.is_meta or tensor.device == device:
                    continue
                seen.add(id(tensor))
                saved.append((tensor, tensor.data))
                tensor.data = tensor.data.to(device)
        yield
    finally:
        for tensor, data in saved:
            tensor.data = data


def to_device(value: Any, device: torch.device | None) -> Any:
    """``value`` with every tensor in it (in dicts, tuples and lists, as a block's keyword inputs hold them:
    rotary cos/sin, attention mask, position ids) on ``device``; None: ``value`` itself."""
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(to_device(item, device) for item in value)
    if isinstance(value, list):
        return [to_device(item, device) for item in value]
    return value


__all__ = ["on_device", "to_device"]
