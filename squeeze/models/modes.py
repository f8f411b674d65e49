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


__all__ = ["input_device", "eval_mode"]
