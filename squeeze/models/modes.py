"""Small helpers every stage that runs a model needs: where its inputs go, and eval mode for a while."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def input_device(model: nn.Module) -> torch.device:
    """The device input ids must be on: ``model.device`` for HF models (the first device under a
    ``device_map``), else the device of the first parameter."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode (no dropout) for the block; restore its ``training`` flag afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def cache_kwarg(model: nn.Module) -> str:
    """The keyword a model's forward / generate takes a KV cache under: ``cache`` in transformers >= 5.2x
    (where ``past_key_values`` still works but warns), ``past_key_values`` before."""
    import inspect

    forward = getattr(model, "forward", None)
    try:
        parameters = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        parameters = {}
    return "cache" if "cache" in parameters else "past_key_values"


__all__ = ["input_device", "eval_mode", "cache_kwarg"]
